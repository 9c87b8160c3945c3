"""The Celery side of kombu-sqlinbox: the transactional outbox and transaction binding.

``celery_ext.install(app, "postgresql://...")`` records every task the app sends in
the service's database before dispatch, with any broker; ``with celery_ext.bind(session):``
makes tracked sends part of the caller's own transaction.
"""

from __future__ import annotations

from .binding import NotBound, after_commit, bind, current
from .declaration import (
    OutboxColumn,
    OutboxRole,
    OutboxSpec,
    OutboxTable,
    OutboxTableBuilder,
    default_outbox_table,
)
from .outbox import (
    HEADER,
    Outbox,
    OutboxError,
    OutboxNotReady,
    OutboxStatus,
    RecordFailed,
    Republished,
    WriteLockHeld,
    install,
    mark_processed,
    outbox_of,
)

__all__ = [
    "HEADER", "NotBound", "Outbox", "OutboxColumn", "OutboxError", "OutboxNotReady",
    "OutboxRole", "OutboxSpec", "OutboxStatus", "OutboxTable", "OutboxTableBuilder",
    "RecordFailed", "Republished", "WriteLockHeld", "after_commit", "bind", "current",
    "default_outbox_table", "install", "mark_processed", "outbox_of",
]
