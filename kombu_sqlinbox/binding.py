"""The caller's own transaction, as the transport sees it (transactional enqueue).

A publish made while a Connection or Session is bound writes its row in that
transaction instead of a connection of the transport's own, so the task exists
if and only if the caller's data commits. :mod:`celery_ext.binding` binds
(``with celery_ext.bind(session): task.delay()``) and adds after-commit
callbacks; this module only holds the binding, so the transport needs nothing
from the Celery layer above it.

A binding may also batch (:func:`batching`): its publishes are held and written as
one multi-row INSERT per table when the transaction commits, a savepoint begins or
ends, or the binding's block ends, whichever comes first; a rollback (to a savepoint)
drops those held since. So a loop of ``delay()`` or a group costs one statement.

A :class:`~contextvars.ContextVar` keeps each thread and each asyncio task to
its own binding.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any
from weakref import WeakKeyDictionary

from sqlalchemy import event
from sqlalchemy.engine import Connection
from sqlalchemy.orm import Session

BOUND: ContextVar[Connection | Session | None] = ContextVar(
    "sqlinbox_bound_transaction", default=None)
#: the connections whose publishes the current batching block holds (None: publishes are
#: written at once)
BATCHES: ContextVar[list[Connection] | None] = ContextVar("sqlinbox_batches", default=None)


def current() -> Connection | None:
    """The bound transaction's Connection (a Session's current one), or None."""
    target = BOUND.get()
    if isinstance(target, Session):
        return target.connection()
    return target


#: writes held rows: (connection, key, rows) where a key is what the writer needs to know
#: of their table
Writer = Callable[[Connection, Any, list[Mapping[str, Any]]], None]


class Batch:
    """The publishes held for one connection's transaction, by table in arrival order.
    It keeps no reference to its connection, which the weak registry below forgets."""

    def __init__(self, write: Writer) -> None:
        self.write = write
        self.rows: dict[Any, list[Mapping[str, Any]]] = {}

    def add(self, key: Any, row: Mapping[str, Any]) -> None:
        self.rows.setdefault(key, []).append(row)

    def flush(self, conn: Connection) -> None:
        """Write what is held, in ``conn``'s transaction (a table's rows in the order
        published)."""
        rows, self.rows = self.rows, {}
        for key, held in rows.items():
            self.write(conn, key, held)

    def drop(self) -> None:
        self.rows = {}


_BATCH_OF: WeakKeyDictionary[Connection, Batch] = WeakKeyDictionary()


def batch_for(conn: Connection, write: Writer) -> Batch | None:
    """The batch of ``conn`` in the current batching block, made on the first publish
    (None outside such a block: write at once)."""
    batched = BATCHES.get()
    if batched is None:
        return None
    found = _BATCH_OF.get(conn)
    if found is None:
        found = _BATCH_OF[conn] = Batch(write)
        # first, ahead of any commit listener that commits the DBAPI connection itself
        event.listen(conn, "commit", lambda c: _BATCH_OF[c].flush(c), insert=True)
        event.listen(conn, "savepoint", lambda c, name: _BATCH_OF[c].flush(c))
        event.listen(conn, "release_savepoint", lambda c, name, ctx: _BATCH_OF[c].flush(c))
        event.listen(conn, "rollback_savepoint", lambda c, name, ctx: _BATCH_OF[c].drop())
        event.listen(conn, "rollback", lambda c: _BATCH_OF[c].drop())
    if not (batched and batched[-1] is conn) and not any(conn is known for known in batched):
        batched.append(conn)
    return found


def write_pending(conn: Connection) -> None:
    """Write the rows held for ``conn``, if any (before what must see or follow them)."""
    found = _BATCH_OF.get(conn)
    if found is not None and found.rows:
        found.flush(conn)


@contextmanager
def batching() -> Iterator[None]:
    """Hold the block's bound publishes for multi-row INSERTs (see the module doc); what
    is still held when the block ends normally is written then. A block that raises
    writes nothing more: its transaction is expected to roll back, and a commit after
    all still writes the held rows first."""
    token = BATCHES.set([])
    try:
        yield
        for conn in BATCHES.get() or []:
            write_pending(conn)
    finally:
        BATCHES.reset(token)
