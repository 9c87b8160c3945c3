"""The caller's own transaction, as the transport sees it (transactional enqueue).

A publish made while a Connection or Session is bound writes its row in that
transaction instead of a connection of the transport's own, so the task exists
if and only if the caller's data commits. :mod:`celery_ext.binding` binds
(``with celery_ext.bind(session): task.delay()``) and adds after-commit
callbacks; this module only holds the binding, so the transport needs nothing
from the Celery layer above it.

A :class:`~contextvars.ContextVar` keeps each thread and each asyncio task to
its own binding.
"""

from __future__ import annotations

from contextvars import ContextVar

from sqlalchemy.engine import Connection
from sqlalchemy.orm import Session

BOUND: ContextVar[Connection | Session | None] = ContextVar(
    "sqlinbox_bound_transaction", default=None)


def current() -> Connection | None:
    """The bound transaction's Connection (a Session's current one), or None."""
    target = BOUND.get()
    if isinstance(target, Session):
        return target.connection()
    return target
