"""The inbox's queue tables and the outbox's table, from the transport's own DDL.

Which tables: ``SQLINBOX_QUEUES`` (default ``["celery"]``, with the table prefix of
``CELERY_BROKER_TRANSPORT_OPTIONS``) and ``SQLINBOX_OUTBOX_TABLE`` (none by default).
"""

from __future__ import annotations

from django.db import migrations

from celery_ext.django.schema import create_tables, drop_tables


class Migration(migrations.Migration):
    initial = True
    dependencies: list[tuple[str, str]] = []
    operations = [migrations.RunPython(create_tables, drop_tables)]
