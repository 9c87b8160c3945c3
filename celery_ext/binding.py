"""Binding the caller's own SQLAlchemy transaction to the code it calls.

``with bind(session_or_connection):`` makes that transaction the one the outbox
(and transactional enqueue) writes into, without passing it through every
call: :func:`current` returns its :class:`~sqlalchemy.engine.Connection`, and
:func:`after_commit` defers work (sending a message) until it commits, dropping
that work when it rolls back.

The binding lives in a :class:`contextvars.ContextVar`, not a global or a
thread-local: each thread starts with no binding, so a web server's threads never
see each other's transactions, and each asyncio task copies the context it was
created in, so two coroutines interleaved on one thread keep their own binding
(a thread-local would leak one coroutine's transaction into the other). The
variable is :data:`kombu_sqlinbox.binding.BOUND`: the sqlinbox transport reads it
for its transactional enqueue and transactional tasks set it, so one binding
serves the outbox, the transport and the tasks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any
from weakref import WeakKeyDictionary

from sqlalchemy import event
from sqlalchemy.engine import Connection
from sqlalchemy.orm import Session

from kombu_sqlinbox.binding import BOUND, batching, current

from .django_db import is_django_connection, sqlalchemy_connection

__all__ = ["NotBound", "after_commit", "bind", "bind_django", "current", "defer_with", "unbound"]

logger = logging.getLogger(__name__)
Target = Connection | Session


class NotBound(RuntimeError):
    """:func:`after_commit` was called with no transaction bound."""


class _Pending:
    """Callbacks waiting for one bound target's transaction to commit.

    ``marks`` holds how many callbacks existed when each open savepoint began, so a
    savepoint rolled back drops exactly the callbacks registered inside it.
    """

    def __init__(self) -> None:
        self.callbacks: list[Callable[[], Any]] = []
        self.marks: list[int] = []

    def run(self) -> None:
        callbacks, self.callbacks, self.marks = self.callbacks, [], []
        for callback in callbacks:
            try:
                callback()
            except Exception:  # the data is committed: a failing callback must not undo that
                logger.exception("after-commit callback %r failed", callback)

    def drop(self) -> None:
        self.callbacks, self.marks = [], []

    def savepoint(self) -> None:
        self.marks.append(len(self.callbacks))

    def release(self) -> None:
        if self.marks:
            self.marks.pop()

    def rollback_to_savepoint(self) -> None:
        if self.marks:
            del self.callbacks[self.marks.pop():]


#: the pending callbacks of each watched Session and Connection
_PENDING: WeakKeyDictionary[Any, _Pending] = WeakKeyDictionary()


def _watch_connection(conn: Connection, pending: _Pending, owns_commit: bool) -> None:
    """Track savepoints and rollback on ``conn``; with ``owns_commit`` also its commit.

    SQLAlchemy's Connection ``commit`` event fires *before* the DBAPI commit and there is
    no event after it, so for a bound Connection the listener commits the DBAPI
    connection itself and runs the callbacks once that returned; SQLAlchemy's own commit
    that follows finds nothing left to commit. A failing commit raises out of
    ``conn.commit()`` as usual and the callbacks are dropped.
    """
    if conn in _PENDING:
        return
    _PENDING[conn] = pending
    event.listen(conn, "savepoint", lambda c, name: _PENDING[c].savepoint())
    event.listen(conn, "release_savepoint", lambda c, name, ctx: _PENDING[c].release())
    event.listen(conn, "rollback_savepoint",
                 lambda c, name, ctx: _PENDING[c].rollback_to_savepoint())
    event.listen(conn, "rollback", lambda c: _PENDING[c].drop())
    if owns_commit:
        event.listen(conn, "commit", _commit_then_run)


def _commit_then_run(conn: Connection) -> None:
    pending = _PENDING[conn]
    if not pending.callbacks:
        return
    try:
        conn.connection.dbapi_connection.commit()  # type: ignore[union-attr]
    except BaseException:
        pending.drop()
        raise
    pending.run()


def _watch_session(session: Session) -> _Pending:
    """Run callbacks after the session commits; watch each connection it begins on."""
    if session in _PENDING:
        return _PENDING[session]
    pending = _PENDING[session] = _Pending()
    event.listen(session, "after_commit", lambda s: _PENDING[s].run())
    event.listen(session, "after_begin",
                 lambda s, trans, conn: _watch_connection(conn, _PENDING[s], owns_commit=False))
    return pending


#: connections whose transaction another framework commits (Django's), with how it runs
#: work after its commit
_DEFERRERS: WeakKeyDictionary[Connection, Callable[[Callable[[], Any]], None]] = (
    WeakKeyDictionary())


def defer_with(conn: Connection, schedule: Callable[[Callable[[], Any]], None]) -> None:
    """Work :func:`after_commit` defers while ``conn`` is bound goes to ``schedule`` (e.g.
    Django's ``transaction.on_commit``): the transaction is not SQLAlchemy's to commit."""
    _DEFERRERS[conn] = schedule


@contextmanager
def bind(target: Target | Any) -> Iterator[Connection]:
    """Bind ``target`` (a Session or a Connection, or Django's connection: see
    :mod:`celery_ext.django`) for the code inside the block.

    Tracked publishes inside write their outbox record in this transaction and are
    sent only once it commits. Tasks sent inside to sqlinbox queues are held and
    written as one multi-row INSERT per queue table when the transaction commits, a
    savepoint begins or ends, or the block ends (see :mod:`kombu_sqlinbox.binding`);
    Django's transactions, which SQLAlchemy does not commit, write each row at once.
    The binding ends with the block; the transaction does not: the caller commits or
    rolls back as usual, inside or after the block.
    Bind before opening the savepoints whose rollback should drop messages.
    """
    if not isinstance(target, (Session, Connection)) and is_django_connection(target):
        with bind_django(target) as conn:
            yield conn
        return
    if isinstance(target, Session):
        _watch_session(target)
        conn = target.connection()  # begins the session's transaction: after_begin watches it
    elif isinstance(target, Connection):
        conn = target
        _watch_connection(conn, _Pending(), owns_commit=True)
    else:
        raise TypeError("bind() takes an SQLAlchemy Session or Connection or Django's "
                        f"connection, not {target!r}")
    token = BOUND.set(target)
    try:
        # a transaction another framework commits (Django's) is not batched: its commits
        # and savepoints happen where SQLAlchemy's events cannot see them
        with nullcontext() if conn in _DEFERRERS else batching():
            yield conn
    finally:
        BOUND.reset(token)


@contextmanager
def bind_django(connection: Any) -> Iterator[Connection]:
    """Bind Django's ``connection`` (``django.db.connection``, or ``connections[alias]``)
    for the code inside: sends there write their queue row or outbox record in Django's
    transaction, and deferred sends run on ``transaction.on_commit``. Call it inside
    ``transaction.atomic()``."""
    from django.db import transaction

    conn = sqlalchemy_connection(connection)
    defer_with(conn, lambda callback: transaction.on_commit(
        callback, using=connection.alias))
    try:
        with bind(conn) as bound:
            yield bound
    finally:
        conn.close()


@contextmanager
def unbound() -> Iterator[None]:
    """No binding inside the block: work run after a commit must not join the next
    transaction of a Session that is still bound."""
    token = BOUND.set(None)
    try:
        yield
    finally:
        BOUND.reset(token)


def after_commit(callback: Callable[[], Any]) -> None:
    """Run ``callback`` once the bound transaction commits; forget it if it rolls back.

    Callbacks run in registration order on the committing thread; an exception in one
    is logged and does not stop the others (the data is already committed).
    """
    target = BOUND.get()
    if target is None:
        raise NotBound("after_commit() needs a transaction bound with celery_ext.bind()")
    schedule = _DEFERRERS.get(target) if isinstance(target, Connection) else None
    if schedule is not None:
        schedule(callback)
        return
    if isinstance(target, Session):
        pending = _watch_session(target)
        _watch_connection(target.connection(), pending, owns_commit=False)
    else:  # bound by bind(), or set directly (a transactional task's delivery transaction)
        _watch_connection(target, _Pending(), owns_commit=True)
        pending = _PENDING[target]
    pending.callbacks.append(callback)
