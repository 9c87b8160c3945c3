"""The queue tables of proj.py (``emails`` and its dead-letter queue) and the routing
tables remote control needs.

Revision ID: 0001
"""

from __future__ import annotations

import os

from celery_ext.migrations import (
    create_inbox_table,
    create_routing_tables,
    drop_inbox_table,
    drop_routing_tables,
    queue_table,
)

revision = "0001"
down_revision = None

PREFIX = os.environ.get("OPS_EXAMPLE_PREFIX", "sqlinbox_")
TABLES = [queue_table(queue, PREFIX) for queue in ("emails", "emails.dead")]


def upgrade() -> None:
    for table in TABLES:
        create_inbox_table(table)
    create_routing_tables(PREFIX)


def downgrade() -> None:
    drop_routing_tables(PREFIX)
    for table in reversed(TABLES):
        drop_inbox_table(table)
