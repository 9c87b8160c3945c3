"""Django: the broker URL from ``DATABASES``, enqueue inside ``transaction.atomic()``, and
migrations that create the inbox's and the outbox's tables.

Add ``"celery_ext.django"`` to ``INSTALLED_APPS`` for the migrations. Binding Django's
connection (``with celery_ext.bind(django.db.connection): task.delay()``) gives the
transport and the outbox an SQLAlchemy connection over Django's own DBAPI connection:
the queue row, or the outbox record, is written in Django's transaction, and the
outbox's send waits for ``transaction.on_commit``.

The connection's parts live in :mod:`celery_ext.django_db` and the binding's in
:mod:`celery_ext.binding` (which binds Django's connection like a Session, and so builds
on ``django_db``, not on this package); they are gathered here.
"""

from __future__ import annotations

from ..binding import bind_django as bind
from ..django_db import broker_url, database_url, is_django_connection, sqlalchemy_connection

__all__ = ["bind", "broker_url", "database_url", "is_django_connection", "sqlalchemy_connection"]
