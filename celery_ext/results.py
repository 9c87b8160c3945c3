"""Celery's result backend in the service's database: ``result_backend =
"sqlinbox+postgresql://..."`` (MariaDB/MySQL and SQLite URLs too, as the broker takes
them).

Celery finds it under the ``celery.result_backends`` entry point ``sqlinbox``: Celery
reads a result backend URL's scheme up to its ``+`` as the backend's name, and hands
the rest (the SQLAlchemy URL) to it. One row per task (:mod:`kombu_sqlinbox.results`),
a late-acked task's final state written in the transaction that completes its queue
row; chords counted in the same transaction, the last header task publishing the body
in it; ``get()`` and ``join_native()`` wait for a NOTIFY, the same-host signal or an
adaptive poll rather than a fixed half second.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any

from celery import states
from celery.app.task import Task, get_actual_ignore_result
from celery.exceptions import Reject, WorkerLostError
from celery.exceptions import TimeoutError as CeleryTimeout
from celery.result import result_from_tuple
from kombu.utils.encoding import ensure_bytes
from sqlalchemy import Connection
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError, ProgrammingError

from kombu_sqlinbox.broker import Broker, same_database
from kombu_sqlinbox.codec import ROW_KEY
from kombu_sqlinbox.errors import (
    ConfigurationError,
    DatabaseUnreachable,
    ResultIdRefused,
    ResultTooLarge,
    reason_of,
)
from kombu_sqlinbox.history import ResultsMissing
from kombu_sqlinbox.options import TransportOptions
from kombu_sqlinbox.results import ResultStore, check_id, store_for
from kombu_sqlinbox.urls import URL_PREFIX, masked

from .chords import COUNTED, After, ChordBackend, date_done
from .delivery import broker_of, delivered_row

ACKS = "celery_ext.acks:ResultRequest"  # the worker request (named: it imports this module)

logger = logging.getLogger(__name__)

#: the options ``result_backend_transport_options`` takes, and their defaults
#: (``table_prefix``: the broker's ``table_prefix`` when the broker sets one)
OPTIONS: dict[str, Any] = {
    "table_prefix": None,
    "create_tables": True,
    "engine_options": {},
    "max_result_bytes": None,
    "cleanup_batch": 1000,
}


def backend_options(app: Any) -> dict[str, Any]:
    """``result_backend_transport_options`` checked (a misspelt key fails at start-up,
    as the transport's own options do), over the defaults."""
    given = dict(app.conf.get("result_backend_transport_options") or {})
    unknown = sorted(set(given) - set(OPTIONS))
    if unknown:
        raise ConfigurationError(
            f"result_backend_transport_options: unknown key(s) {', '.join(unknown)}; "
            f"the sqlinbox result backend takes {', '.join(sorted(OPTIONS))}")
    options = {**OPTIONS, **given}
    if options["table_prefix"] is None:
        broker = dict(app.conf.get("broker_transport_options") or {})
        options["table_prefix"] = broker.get("table_prefix", TransportOptions.table_prefix)
    return options


#: the first and the longest pause between writes of a result with its message's
#: completion while their database does not answer (seconds)
RETRY_FIRST, RETRY_MOST = 0.1, 5.0
#: a request attribute: its task's result was written in its own transaction
STORED = "sqlinbox_result_stored"
#: a stored row's arguments after its task id: state, meta, task name, worker
Row = tuple[str, bytes, Any, Any]


class NotThisDelivery(Exception):
    """The delivered row is no longer this delivery's: nothing of the write commits."""


def _completing(task: Any, state: str, result: Any) -> bool:
    """Whether the worker acknowledges a task's delivery after this final state: not a
    failure it rejects instead (a ``Reject``, a task not acking failures) nor a lost
    worker's (acknowledged before Celery writes it)."""
    if task is None or not task.acks_late:
        return False
    return state != states.FAILURE or (task.acks_on_failure_or_timeout and not isinstance(
        result, (Reject, WorkerLostError)))


class SqlInboxBackend(ChordBackend):
    """Task states and results, saved groups and chords' counters in three tables of the
    service's database under the table prefix (``<prefix>task_results``,
    ``<prefix>group_results``, ``<prefix>chords``)."""

    #: ``ResultSet.iterate``'s wait between results: each ``get()`` waits woken
    subpolling_interval = 0.05
    #: ``join_native()``: the pending results read in one select per wake-up
    supports_native_join = True

    def __init__(self, app: Any, url: str | None = None, **kwargs: Any) -> None:
        super().__init__(app, url=url, expires_type=float, **kwargs)
        if not url:
            raise ConfigurationError(
                "the sqlinbox result backend needs the database's URL: "
                "result_backend = 'sqlinbox+postgresql://user@host/db' "
                "(or sqlinbox+mysql://..., sqlinbox+sqlite:///jobs.db)")
        if self.expires is not None and not 0 <= self.expires < math.inf:
            raise ConfigurationError(
                f"result_expires={self.expires!r}: results expire after a number of "
                "seconds (or a timedelta) of 0 or more, which backend_cleanup deletes "
                "them after; None or 0 keeps every result")
        self.options = backend_options(app)
        if app.Task.Request == Task.Request:  # the worker's request for results written
            app.Task.Request = ACKS  # with their row (an app's own request class stays)
        self._store: ResultStore | None = None

    @property
    def store(self) -> ResultStore:
        """The process's store for this URL and options (connected on first use). A forked
        child (a prefork pool process) inherits the forking thread's backend: it looks up
        a store of its own, as the parent's lock may be held for ever by a parent's thread."""
        if self._store is None or self._store.pid != os.getpid():
            options = self.options
            self._store = store_for(str(self.url), options["table_prefix"],
                                    options["create_tables"], options["max_result_bytes"],
                                    options["engine_options"])
        return self._store

    def as_uri(self, include_password: bool = False) -> str:
        """The URL as configured (``sqlinbox+...``), its password masked unless asked for:
        the worker's banner shows it."""
        url = str(self.url or "")
        return URL_PREFIX + (url if include_password else masked(url, "**"))

    # -- tasks ---------------------------------------------------------------------------
    def on_task_call(self, producer: Any, task_id: str) -> None:
        """Celery calls it as it sends a task whose result is kept: an id the result
        tables cannot key fails the send, not the result's write in the worker."""
        check_id(task_id)

    def store_result(self, task_id: str, result: Any, state: str, traceback: Any = None,
                     request: Any = None, **kwargs: Any) -> Any:
        """Celery's, deciding first, from the outcome as raised, whether this write
        completes the task's row; nothing for a result its transactional task stored."""
        if request is not None and getattr(request, STORED, False):
            return result
        refused = None if request is None else self._refused(task_id)
        if refused is not None:
            logger.error("sqlinbox: task %.60r: its result is not stored (%s): %s",
                         task_id, state, refused)
            return result
        kwargs.setdefault("completes", self._completes(task_id, result, state, request))
        return super().store_result(task_id, result, state, traceback, request, **kwargs)

    @staticmethod
    def _refused(task_id: str) -> ResultIdRefused | None:
        """Why a delivered task's id keys no result row (a producer that did not check it
        sent it): its result is then not stored, rather than an error stopping the worker
        at each delivery of its row."""
        try:
            check_id(task_id)
        except ResultIdRefused as exc:
            return exc
        return None

    def _completes(self, task_id: str, result: Any, state: str,
                   request: Any) -> dict[str, Any] | None:
        """The delivered row a final state is written with: the task's own late-acked
        delivery from a sqlinbox queue, which the worker acknowledges right after this
        write (see :func:`_completing`)."""
        if state not in states.READY_STATES or getattr(request, "id", None) != task_id:
            return None
        row = delivered_row(request)
        task = self.app.tasks.get(getattr(request, "task", None) or "")
        return row if row is not None and _completing(task, state, result) else None

    def exception_safe_to_retry(self, exc: Exception) -> bool:
        """With Celery's ``result_backend_always_retry``, a write the database did not
        answer (a server restarting, a connection cut) is retried until it does: the
        worker holds the result rather than losing it."""
        return isinstance(exc, (OperationalError, InterfaceError, DatabaseUnreachable))

    def _row(self, task_id: str, result: Any, state: str, traceback: Any, request: Any) -> Row:
        meta = self._get_result_meta(result=result, state=state, traceback=traceback,
                                     request=request, format_date=False)
        meta.pop("date_done", None)  # the database's clock sets it, in its own column
        meta["task_id"] = task_id
        encoded = ensure_bytes(self.encode(meta))
        if meta.get("args") is not None or meta.get("kwargs") is not None:
            try:  # result_extended's arguments: the result comes first
                self.store.check_size(task_id, encoded)
            except ResultTooLarge as exc:
                logger.warning("sqlinbox: task %s: its arguments are left out of its stored "
                               "result (result_extended): %s", task_id, exc)
                meta["args"] = meta["kwargs"] = None
                encoded = ensure_bytes(self.encode(meta))
        self.store.check_size(task_id, encoded)
        return state, encoded, meta.get("name"), meta.get("worker")

    def _store_result(self, task_id: str, result: Any, state: str, traceback: Any = None,
                      request: Any = None, completes: dict[str, Any] | None = None,
                      **kwargs: Any) -> Any:
        def write() -> None:
            row = self._row(task_id, result, state, traceback, request)
            if completes is None or not self._with_ack(task_id, row, completes, request):
                self.store.store(task_id, *row)

        if completes is None:
            write()
        else:
            self._until_answered(task_id, write)
        return result

    def _with_ack(self, task_id: str, row: Row, delivered: dict[str, Any],
                  request: Any) -> bool:
        """Write ``row`` and complete the delivered row in one transaction, fenced by the
        delivery's attempt: a row claimed again meanwhile (its lease lapsed) rolls both
        back, and the delivery that holds it now writes the result. False where the
        queue is in another database, or its claim holds a lock this connection would
        wait for (``row_lock``): the result is then written on its own. A chord's header
        task is counted in the same transaction."""
        broker = broker_of(self.app)
        table = broker.table(delivered["queue"])
        if not self._writes_with(broker, table):
            return False

        counts = bool(request.chord and request.group)

        def work(conn: Connection) -> After:
            self.store.write(task_id, *row, conn)
            if not broker.complete_in(conn, table, delivered["id"], delivered["attempt"]):
                raise NotThisDelivery
            return self._count_part(request, conn) if counts else None

        try:
            after = broker.run(work, repeatable=True)
        except NotThisDelivery:
            logger.warning("sqlinbox: task %s: message %s of queue %r is no longer this "
                           "delivery's; its %s is not stored", task_id, delivered["id"],
                           delivered["queue"], row[0])
            after = None
        else:
            self.store.announce()
        if counts:  # here, or by the delivery holding the row now: not again after
            setattr(request, COUNTED, True)
        if after is not None:
            after()
        return True

    def _writes_with(self, broker: Broker, table: Any) -> bool:
        """Whether a result is written with its row's completion (see :meth:`_with_ack`)."""
        return table.options.claim != "row_lock" and same_database(
            broker.engine, self.store.database.engine)

    def completed_by_success(self, request: Any) -> bool:
        """In the worker's main process: whether a late-acked task's success was written with
        its row's completion (or refused, the row claimed again), leaving its ack nothing to
        do; not a redelivery Celery may deduplicate (its skipped run wrote nothing)."""
        task, info = request.task, request.message.delivery_info
        if (info.get(ROW_KEY) is None or get_actual_ignore_result(task, request)
                or self._refused(request.id) is not None
                or not _completing(task, states.SUCCESS, None) or (info.get("redelivered")
                and self.app.conf.worker_deduplicate_successful_tasks)):
            return False
        broker = broker_of(self.app)
        return self._writes_with(broker, broker.table(info[ROW_KEY]["queue"]))

    def _until_answered(self, task_id: str, write: Callable[[], None]) -> None:
        """Write a late-acked task's final state until the database answers: giving up
        would let the worker's acknowledgement, retried until it lands, complete the row
        without its result. A write with the completion is fenced, so it is never done
        twice; meanwhile the message stays held (its lease, once lapsed, lets another
        worker run it). So is a write whose result tables are missing (``create_tables``
        off and not created yet, or dropped since): held until they are there (created
        again where ``create_tables`` is on)."""
        pause = RETRY_FIRST
        while True:
            try:
                return write()
            except (OperationalError, InterfaceError, ProgrammingError, ResultsMissing) as exc:
                gone = False  # a table dropped (SQLite says so with an OperationalError)
                with contextlib.suppress(DBAPIError):  # the database away: asked next time
                    gone = self.store.tables_gone()
                if isinstance(exc, ProgrammingError) and not gone:
                    raise
                logger.warning("sqlinbox: task %s: writing its result failed (%s); again "
                               "in %.1f s", task_id,
                               reason_of(exc), pause)
            time.sleep(pause)
            pause = min(pause * 2, RETRY_MOST)

    def writes_in(self, task: Any, conn: Connection) -> bool:
        """Whether a transactional task's success is written in its own transaction on
        ``conn`` (which completes its row): not where Celery would store nothing, nor
        where the result tables are in another database."""
        return not get_actual_ignore_result(task, task.request) and same_database(
            conn.engine, self.store.database.engine)

    def store_in(self, conn: Connection, task: Any, result: Any) -> None:
        """Write a transactional task's success in its transaction (see :meth:`writes_in`);
        once that commits, the caller marks the request :data:`STORED`."""
        task_id = task.request.id
        encoded = self.encode_result(result, states.SUCCESS)
        self.store.write(task_id, *self._row(task_id, encoded, states.SUCCESS, None,
                                             task.request), conn)

    def _get_task_meta_for(self, task_id: str) -> dict[str, Any]:
        found = self.store.read(task_id)
        if found is None:
            return {"status": states.PENDING, "result": None}
        return self._meta(found)

    def get_many(self, task_ids: Any, timeout: float | None = None, interval: float = 0.5,
                 no_ack: bool = True, on_message: Any = None, on_interval: Any = None,
                 max_iterations: Any = None, READY_STATES: Any = states.READY_STATES
                 ) -> Iterator[tuple[str, dict[str, Any]]]:
        """``join_native()``'s reads: each ready result once, as it becomes ready; the
        pending ones read in one select after each wake-up for the first of them (or
        ``interval`` seconds); Celery's ``TimeoutError`` after ``timeout`` seconds."""
        self._ensure_not_eager()
        pending = list(dict.fromkeys(str(task_id) for task_id in task_ids))
        deadline = None if timeout is None else time.monotonic() + timeout
        while pending:
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            ready = self.store.wait(pending[0], partial(self._ready_of, pending, READY_STATES),
                                    left, interval, on_interval)
            if ready is None:
                raise CeleryTimeout(f"Operation timed out ({timeout})")
            for task_id in [task_id for task_id in pending if task_id in ready]:
                if on_message is not None:
                    on_message(ready[task_id])
                yield task_id, ready[task_id]
            pending = [task_id for task_id in pending if task_id not in ready]

    def _ready_of(self, task_ids: Sequence[str], ready_states: Any
                  ) -> dict[str, dict[str, Any]] | None:
        found = {task_id: self._meta(stored)
                 for task_id, stored in self.store.read_many(task_ids).items()
                 if stored.status in ready_states}
        return found or None

    def _forget(self, task_id: str) -> None:
        self.store.forget(task_id)

    def task_result_exists(self, task_id: str) -> bool:
        return self.store.read(task_id) is not None

    # -- groups --------------------------------------------------------------------------
    def _save_group(self, group_id: str, result: Any) -> Any:
        self.store.save_group(group_id, ensure_bytes(self.encode(
            {"result": result.as_tuple()})))
        return result

    def _restore_group(self, group_id: str) -> dict[str, Any] | None:
        found = self.store.restore_group(group_id)
        if found is None:
            return None
        meta: dict[str, Any] = self.decode(found[0])
        meta["result"] = result_from_tuple(meta["result"], self.app)
        meta["date_done"] = date_done(found[1])
        return meta

    def _delete_group(self, group_id: str) -> None:
        self.store.delete_group(group_id)

    # -- expiry --------------------------------------------------------------------------
    def cleanup(self) -> None:
        """Celery's ``backend_cleanup`` task: delete results older than
        ``result_expires``, in batches."""
        if self.expires:
            self.store.expire(float(self.expires), int(self.options["cleanup_batch"]))

    # -- waiting -------------------------------------------------------------------------
    def wait_for(self, task_id: str, timeout: float | None = None, interval: float = 0.5,
                 no_ack: bool = True, on_interval: Any = None) -> dict[str, Any]:
        """The task's meta once ready, read again at each wake-up for its result (or
        after at most ``interval`` seconds); Celery's ``TimeoutError`` after
        ``timeout`` seconds."""
        self._ensure_not_eager()

        def ready() -> dict[str, Any] | None:
            meta: dict[str, Any] = self.get_task_meta(task_id)
            return meta if meta["status"] in states.READY_STATES else None

        found = self.store.wait(task_id, ready, timeout, interval, on_interval)
        if found is None:
            raise CeleryTimeout("The operation timed out.")
        return found

    def __reduce__(self, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        return super().__reduce__(args, {**(kwargs or {}), "url": self.url,
                                         "expires": self.expires})
