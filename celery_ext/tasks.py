"""The Celery task base for inbox queues: retry in place, transactional tasks.

Retry in place
--------------
Celery's ``self.retry()`` publishes a new message and acks the old one. On an
inbox queue that loses the row's place: a FIFO group's head would move behind
the rows queued after it. ``self.retry_after(seconds)`` instead keeps the same
row, counts the attempt, and hides it until due, behind rows that became ready
earlier.

The task raises :class:`RetryAfter` (a ``Reject(requeue=True)``, so on any
other broker it is an immediate requeue); the worker-side :class:`InboxRequest`
turns it into the transport's in-place retry. The request runs in the worker's
main process, which holds the claim, so this works in the prefork, threads and
solo pools alike.

Transactional tasks (exactly once inside the database)
------------------------------------------------------
``@app.task(base=InboxTask, transactional=True)`` runs the body inside one
transaction on the queue's database, reachable as ``self.connection`` (and
bound, so ``other_task.delay()`` inside writes its row in it). The transaction
first takes the delivered row over by id and fencing token (``SELECT ... FOR
UPDATE``; the lease does not block it), and completes the row before it
commits: the task's writes and the row's completion commit together. Wherever
the task runs (a prefork child, a thread, the main process) the claim stays
with the worker's main process, whose later ack finds the row already gone.
On an exception the writes roll back before Celery settles the row; a crash
of the pool process commits nothing and the row comes back. A delivery whose
row is no longer there (already done, or claimed again elsewhere) skips the
body. A body that violates a unique key of its own (the same work published
twice) is dropped with nothing changed; any other constraint error is an
ordinary failure. A connection lost on the way, like a deadlock, puts the row
back in place to run again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, NoReturn

from celery import Task
from celery.exceptions import Ignore, Reject
from sqlalchemy import Connection
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from kombu_sqlinbox import binding
from kombu_sqlinbox.broker import QueueTable, same_database

from .acks import ResultRequest
from .delivery import TransactionalTaskError, broker_of, delivered_row
from .results import STORED, SqlInboxBackend

__all__ = ["InboxRequest", "InboxTask", "RetryAfter", "TransactionalTaskError", "delivered_row"]

logger = logging.getLogger(__name__)


class RetryAfter(Reject):  # type: ignore[misc]
    """Retry this delivery in place after ``seconds`` (same row, attempt counted)."""

    def __init__(self, seconds: float, reason: str | None = None) -> None:
        super().__init__(reason or f"retry in place in {seconds}s", requeue=True)
        self.seconds = float(seconds)

    def __reduce__(self) -> tuple[Any, ...]:  # survives the trip from a pool process
        return (RetryAfter, (self.seconds, self.reason))


class InboxRequest(ResultRequest):
    """A worker request that settles :class:`RetryAfter` through the transport (and
    needs no ack of a success its result completed)."""

    def on_failure(self, exc_info: Any, send_failed_event: bool = True,
                   return_ok: bool = False) -> Any:
        exc = getattr(exc_info.exception, "exc", exc_info.exception)
        qos: Any = getattr(getattr(self.message, "channel", None), "qos", None)
        if isinstance(exc, RetryAfter) and hasattr(qos, "retry_after"):
            from celery.worker.state import task_ready

            task_ready(self)
            if not self.acknowledged:
                qos.retry_after(self.message.delivery_tag, exc.seconds)
                self.acknowledged: bool = True
                self.send_event("task-retried", exception=repr(exc))
            return None
        return super().on_failure(exc_info, send_failed_event, return_ok)


#: the running transactional task's transaction (a task object serves every thread)
_DELIVERY: ContextVar[Connection | None] = ContextVar("sqlinbox_delivery", default=None)


@contextmanager
def delivery_transaction(app: Any, row: dict[str, Any] | None) -> Iterator[
        tuple[Connection, QueueTable | None]]:
    """A transaction on the queue's database that owns the delivered row, if there is one.

    Yields ``(connection, table)``; the caller completes the row before leaving the block.
    Raises :class:`~celery.exceptions.Ignore` when the row is no longer this delivery's.
    """
    broker = broker_of(app)
    table = broker.table(row["queue"]) if row else None
    options: dict[str, Any] = {}
    if table is not None:
        if table.options.claim == "row_lock":
            raise TransactionalTaskError(
                f"queue {table.queue!r}: a transactional task cannot take over a row held by "
                "claim='row_lock' (the worker's own transaction locks it); use 'lease' or "
                "'advisory'")
        if table.options.isolation_level:
            options["isolation_level"] = table.options.isolation_level
        options["sqlite_begin"] = table.options.sqlite_begin
    with broker.engine.connect() as conn:
        conn = conn.execution_options(**options)
        with conn.begin():
            if table is not None and row is not None and not broker.still_held(
                    conn, table, row["id"], row["attempt"]):
                raise row_gone(row, "skipped")
            yield conn, table


def row_gone(row: dict[str, Any], what: str) -> Ignore:
    """The Ignore for a delivery whose row is no longer its own (done, or claimed again
    after its lease lapsed: the other delivery runs it)."""
    logger.warning("sqlinbox: message %s of queue %r is no longer this delivery's: %s",
                   row["id"], row["queue"], what)
    return Ignore()


def mark_outbox_record(task: Task, conn: Connection) -> None:
    """With an outbox on the same database, mark the message's record processed in the
    task's transaction: a duplicate delivery racing this one finds it marked and rolls
    back (effect once). A record the outbox does not hold is no duplicate."""
    from .outbox import HEADER, OutboxError, outbox_of

    record_id = task.request.get(HEADER)
    if record_id is None:
        return
    try:
        outbox = outbox_of(task.app)
    except OutboxError:
        return
    if not outbox.tracked_id(record_id) or not same_database(outbox.engine, conn.engine):
        return  # another kind of id (not this outbox's) or another database: untracked
    outbox.mark_for_task(conn, task, record_id)
    task.request.outbox_marked = True


def complete_row(app: Any, conn: Connection, table: QueueTable, row: dict[str, Any]) -> None:
    """Complete the delivered row inside the task's transaction, fenced by its attempt.

    The row is not locked while the body runs (the lease keeps other claimers off and
    the keeper keeps extending it); if it was claimed again meanwhile, nothing of this
    delivery commits.
    """
    if not broker_of(app).complete_in(conn, table, row["id"], row["attempt"]):
        raise row_gone(row, "its writes are rolled back")


class InboxTask(Task):  # type: ignore[misc]
    """Base for tasks on inbox queues: late acks, and rows given back on a lost worker.

    ``acks_late`` keeps the row held (and its lease extended) until the task has
    finished; ``reject_on_worker_lost`` puts it back in place when a pool process
    dies mid-task, where ``max_attempts`` bounds how often that may happen.
    """

    Request = "celery_ext.tasks:InboxRequest"
    acks_late = True
    reject_on_worker_lost = True
    #: run the body in the delivery's transaction (see the module docs)
    transactional = False
    #: in a transactional task, treat a unique-key violation as the same work done twice
    drop_duplicates = True

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.transactional:
            return super().__call__(*args, **kwargs)
        row = delivered_row(self.request) if self.request.id else None
        if row is not None:  # retries in place are earlier deliveries of this very row
            self.request.retries = max(int(row["attempt"]) - 1, self.request.retries or 0)
        backend = self.backend if isinstance(self.backend, SqlInboxBackend) else None
        if backend is not None:
            backend.store.ensure()  # not inside the transaction: SQLite has one writer
        try:
            with delivery_transaction(self.app, row) as (conn, table):
                delivery_token = _DELIVERY.set(conn)
                bound_token = binding.BOUND.set(conn)
                try:
                    result = super().__call__(*args, **kwargs)
                finally:
                    binding.BOUND.reset(bound_token)
                    _DELIVERY.reset(delivery_token)
                mark_outbox_record(self, conn)
                stored = self._complete(conn, table, row, backend, result)
            self._stored(stored)
            return result
        except DBAPIError as exc:
            broker = broker_of(self.app)
            if exc.connection_invalidated or broker.dialect.is_transient(exc):
                # a lost connection, a deadlock, a serialization failure or busy SQLite:
                # the row goes back in place and runs again (had the commit landed before
                # the connection was lost, the row went with it: nothing comes back)
                what = "connection lost" if exc.connection_invalidated else "transient error"
                raise Reject(f"database {what}, requeued: {exc.orig}", requeue=True) from exc
            if not (self.drop_duplicates and broker.dialect.is_unique_violation(exc)):
                raise
            logger.warning("sqlinbox: task %s[%s] violated a unique key (%s): the same work "
                           "was done before; dropped with nothing changed",
                           self.name, self.request.id, exc.orig)
            if row is not None:
                with delivery_transaction(self.app, row) as (again, again_table):
                    stored = self._complete(again, again_table, row, backend, None)
                self._stored(stored)
            return None

    def _complete(self, conn: Connection, table: QueueTable | None,
                  row: dict[str, Any] | None, backend: SqlInboxBackend | None,
                  result: Any) -> SqlInboxBackend | None:
        """Complete the delivered row in the task's transaction, with the task's result
        where the backend writes it there; that backend, if it did."""
        if table is None or row is None:
            return None
        writer = backend if backend is not None and backend.writes_in(self, conn) else None
        if writer is not None:
            writer.store_in(conn, self, result)
        complete_row(self.app, conn, table, row)
        return writer

    def _stored(self, writer: SqlInboxBackend | None) -> None:
        """After the commit: Celery's own write of the result is skipped, waiters woken."""
        if writer is not None:
            setattr(self.request, STORED, True)
            writer.store.announce()

    @property
    def connection(self) -> Connection:
        """The delivery's transaction (transactional tasks only, while the body runs)."""
        conn = _DELIVERY.get()
        if conn is None:
            raise TransactionalTaskError(
                f"task {self.name}: self.connection exists only inside a transactional task")
        return conn

    def session(self, **options: Any) -> Session:
        """An ORM Session joined to the delivery's transaction (it must not commit)."""
        return Session(bind=self.connection, join_transaction_mode="create_savepoint",
                       **options)

    def retry(self, *args: Any, countdown: float | None = None, eta: Any = None,
              **kwargs: Any) -> Any:
        """Celery's retry; inside a transactional task it retries in place instead.

        A new message would have to be written outside the delivery's transaction (which
        the retry rolls back): on SQLite that write waits for the write lock the task itself
        holds. The same row, hidden for ``countdown`` (or until ``eta``), needs no write
        at all; ``max_attempts`` bounds it as it bounds every delivery.
        """
        if not self.transactional or _DELIVERY.get() is None:
            return super().retry(*args, countdown=countdown, eta=eta, **kwargs)
        max_retries = kwargs.get("max_retries", self.max_retries)
        if max_retries is not None and self.request.retries >= max_retries:
            if kwargs.get("exc") is not None:
                raise kwargs["exc"]
            raise self.MaxRetriesExceededError(
                f"Can't retry {self.name}[{self.request.id}] args:{self.request.args} "
                f"kwargs:{self.request.kwargs}")
        if countdown is None and eta is not None:
            countdown = eta.timestamp() - time.time()
        raise RetryAfter(self.default_retry_delay if countdown is None else countdown,
                         "retry in place (transactional task)")

    def retry_after(self, seconds: float, reason: str | None = None) -> NoReturn:
        """Retry in place: ``raise self.retry_after(30)``, like ``raise self.retry()``."""
        raise RetryAfter(seconds, reason)
