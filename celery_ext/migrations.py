"""Alembic helpers: create and drop a queue table and its indexes from its declaration.

For services that own their schema and run the transport with
``create_tables=False``: a migration creates each queue table with exactly the DDL
the transport would run (``celery sqlinbox ddl`` prints it), for the database the
migration runs on, online or as ``alembic upgrade --sql``::

    from celery_ext.migrations import create_inbox_table, drop_inbox_table, queue_table

    def upgrade():
        create_inbox_table(queue_table("emails"))
        create_inbox_table(EmailJobs)          # a declared table

    def downgrade():
        drop_inbox_table(EmailJobs)
        drop_inbox_table(queue_table("emails"))

and the transport's routing tables (bindings, the queue registry, transient
messages: remote control and events need them) with :func:`create_routing_tables`.

Needs the ``alembic`` extra.
"""

from __future__ import annotations

from alembic import op

from kombu_sqlinbox.dialects import Dialect, dialect_class
from kombu_sqlinbox.tables import (
    InboxTable,
    TableBuilder,
    TableSpec,
    as_spec,
    default_table,
    table_name_for_queue,
)

__all__ = ["create_inbox_table", "create_routing_tables", "drop_inbox_table",
           "drop_routing_tables", "inbox_ddl", "queue_table"]

Declaration = TableSpec | type[InboxTable] | TableBuilder


def queue_table(queue: str, prefix: str = "sqlinbox_") -> TableSpec:
    """The default table the transport would create for ``queue`` (with the transport's
    ``table_prefix``)."""
    return default_table(table_name_for_queue(queue, prefix))


def _dialect() -> Dialect:
    """The kombu-sqlinbox dialect of the database the migration runs on."""
    return dialect_class(op.get_context().dialect.name)()


def inbox_ddl(declaration: Declaration) -> list[str]:
    """CREATE TABLE and CREATE INDEX of a declaration, for the migration's database."""
    return _dialect().create_ddl(as_spec(declaration))


def create_inbox_table(declaration: Declaration) -> None:
    """Create the table of a declaration and the indexes its claims use."""
    for statement in inbox_ddl(declaration):
        op.execute(statement)


def drop_inbox_table(declaration: Declaration) -> None:
    """Drop the table of a declaration (its indexes go with it)."""
    op.execute(_dialect().drop_ddl(as_spec(declaration)))


def create_routing_tables(prefix: str = "sqlinbox_") -> None:
    """Create the routing tables under the transport's ``table_prefix``, the table of
    paused queues every worker reads (``sqlinbox pause``), the concurrency limits' slots,
    the rate budget of the queues with a ``rate_limit`` and the throughput counts."""
    dialect = _dialect()
    for statement in [*dialect.routing_statements(prefix).ddl,
                      *dialect.pause_statements(prefix).ddl,
                      *dialect.limit_statements(prefix).ddl,
                      *dialect.rate_statements(prefix).ddl,
                      *dialect.throughput_statements(prefix).ddl]:
        op.execute(statement)


def drop_routing_tables(prefix: str = "sqlinbox_") -> None:
    dialect = _dialect()
    for statement in [*dialect.throughput_statements(prefix).drop,
                      *dialect.rate_statements(prefix).drop,
                      *dialect.limit_statements(prefix).drop,
                      *dialect.pause_statements(prefix).drop,
                      *dialect.routing_statements(prefix).drop]:
        op.execute(statement)
