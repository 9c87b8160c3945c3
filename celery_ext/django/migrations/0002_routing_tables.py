"""The routing tables of the table prefix of ``CELERY_BROKER_TRANSPORT_OPTIONS``: where
a worker's remote-control queue, reply queues and fanout bindings live. With them, a
worker runs with ``create_tables: False`` on what ``migrate`` created."""

from __future__ import annotations

from django.db import migrations

from celery_ext.django.schema import create_routing_tables, drop_routing_tables


class Migration(migrations.Migration):
    dependencies = [("sqlinbox", "0001_initial")]
    operations = [migrations.RunPython(create_routing_tables, drop_routing_tables)]
