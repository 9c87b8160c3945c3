"""The tables the migrations create: the transport's DDL for the configured queues, the
routing tables, the outbox and the database scheduler's tables, run on the migration's
own connection."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.conf import settings

from celery_ext.declaration import default_outbox_table
from celery_ext.django_db import sqlalchemy_connection
from kombu_sqlinbox.dialects import Dialect, ScheduleStatements, dialect_for
from kombu_sqlinbox.options import parse_options
from kombu_sqlinbox.tables import default_table, table_name_for_queue


def _ddl(dialect: Dialect) -> tuple[list[str], list[str]]:
    """CREATE and DROP statements of every configured table."""
    options = parse_options(getattr(settings, "CELERY_BROKER_TRANSPORT_OPTIONS", None))
    create: list[str] = []
    drop: list[str] = []
    for queue in getattr(settings, "SQLINBOX_QUEUES", ["celery"]):
        names = [queue, options.for_queue(queue).dead_letter_queue]
        for name in filter(None, names):
            spec = default_table(table_name_for_queue(name, options.table_prefix))
            create += dialect.create_ddl(spec)
            drop.append(dialect.statements(spec).drop.text)
    outbox = getattr(settings, "SQLINBOX_OUTBOX_TABLE", None)
    if outbox:
        table = default_outbox_table(outbox)
        layout = (table.table, table.schema, table.column_names(), table.generated_id)
        create += dialect.outbox_create_ddl(*layout)
        drop.append(dialect.outbox_statements(*layout)["drop"].text)
    return create, drop


def _routing(dialect: Dialect) -> tuple[list[str], list[str]]:
    """CREATE and DROP statements of the routing tables (the queue registry, the bindings,
    the transient messages) of the configured table prefix: a worker's remote-control
    queue, reply queues and fanout bindings live there."""
    routing = dialect.routing_statements(_prefix())
    return routing.ddl, routing.drop


def _schedules(dialect: Dialect) -> tuple[list[str], list[str]]:
    """CREATE and DROP statements of the database scheduler's tables (its schedules and
    the ticks they sent) of the configured table prefix."""
    schedules = dialect.schedule_statements(_prefix())
    return schedules.ddl, schedules.drop


def _prefix() -> str:
    return parse_options(getattr(settings, "CELERY_BROKER_TRANSPORT_OPTIONS", None)).table_prefix


def schedules_table() -> str:
    """The configured prefix's schedules table: the admin's model of it is named so."""
    return ScheduleStatements.tables(_prefix())[0]


def _run(schema_editor: Any, which: int,
         ddl: Callable[[Dialect], tuple[list[str], list[str]]] = _ddl) -> None:
    conn = sqlalchemy_connection(schema_editor.connection)
    try:
        for statement in ddl(dialect_for(conn.engine))[which]:
            conn.exec_driver_sql(statement)
    finally:
        conn.close()


def create_tables(apps: Any, schema_editor: Any) -> None:
    _run(schema_editor, 0)


def drop_tables(apps: Any, schema_editor: Any) -> None:
    _run(schema_editor, 1)


def create_routing_tables(apps: Any, schema_editor: Any) -> None:
    _run(schema_editor, 0, _routing)


def drop_routing_tables(apps: Any, schema_editor: Any) -> None:
    _run(schema_editor, 1, _routing)


def create_schedule_tables(apps: Any, schema_editor: Any) -> None:
    _run(schema_editor, 0, _schedules)


def drop_schedule_tables(apps: Any, schema_editor: Any) -> None:
    _run(schema_editor, 1, _schedules)
