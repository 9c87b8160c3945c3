"""The consumer guard: the worker side of the outbox.

A delivery whose record is already processed must not run its body again. Signal
receivers cannot stop a task, so the guard wraps each task's ``run`` on the task
instance (before Celery builds its tracer): such a delivery raises
:class:`~celery.exceptions.Ignore` and its body does not run. A finished task's record
is marked processed from ``task_postrun``, or inside the task's own transaction
(:meth:`ConsumerGuard.transaction`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from celery import Celery, Task, signals
from celery.exceptions import Ignore, Reject
from celery.states import FAILURE, REJECTED
from sqlalchemy import Connection
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError

from .. import binding
from .hook import HEADER
from .store import RecordStore

__all__ = ["ConsumerGuard", "duplicate"]

logger = logging.getLogger(__name__)


def duplicate(task: Task, record_id: Any) -> Ignore:
    """The Ignore that skips a delivery whose record is already processed (logged, since
    Celery logs an ignored task without its reason)."""
    logger.info("outbox: record %s already processed: duplicate delivery of %s[%s] skipped",
                record_id, task.name, task.request.id)
    return Ignore(f"outbox record {record_id} is already processed")


class ConsumerGuard:
    """The worker side of one outbox (see the module doc): :meth:`connect` guards the
    app's tasks and marks finished ones, :meth:`disconnect` undoes it."""

    def __init__(self, app: Celery, store: RecordStore) -> None:
        self.app = app
        self.store = store
        #: each guarded task -> the ``run`` its instance had of its own before (None: it
        #: had none, its class's ``run`` served)
        self._guarded: dict[Task, Callable[..., Any] | None] = {}
        #: the app's task registry class before :meth:`connect` replaced it
        self._registry_class: type | None = None

    # -- hooking in -------------------------------------------------------------------
    def connect(self) -> None:
        """Guard every task of the app, now and whenever one is registered later, and
        mark records from ``task_postrun``.

        Celery has no signal for a task registered after the app is finalized (a late
        import), so the registry becomes a subclass of its own class that guards each
        task put into it.
        """
        registry = self.app._tasks
        guard = self

        class GuardingRegistry(type(registry)):  # type: ignore[misc]
            def __setitem__(self, name: str, task: Task) -> None:
                super().__setitem__(name, task)
                guard.guard(task)

        self._registry_class = type(registry)
        registry.__class__ = GuardingRegistry
        for task in list(registry.values()):
            self.guard(task)
        signals.task_postrun.connect(self.on_postrun, weak=False)

    def disconnect(self) -> None:
        """Give the tasks and the registry back what they had before :meth:`connect`."""
        signals.task_postrun.disconnect(self.on_postrun)
        if self._registry_class is not None:
            self.app._tasks.__class__ = self._registry_class
            self._registry_class = None
        for task, own_run in self._guarded.items():
            if own_run is None:
                del task.run
            else:
                task.run = own_run
        self._guarded.clear()

    def guard(self, task: Task) -> None:
        """Skip a delivery of ``task`` whose record is already processed (see module doc).

        A record id this outbox cannot have written runs the task untracked (logged). A
        lookup that fails on the connection (the database down, a deadlock) requeues the
        delivery: the record stays unprocessed, nothing is lost and the body has not run.
        """
        if task in self._guarded:
            return
        run = task.run
        store = self.store

        @functools.wraps(run)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            request = task.request
            record_id = getattr(request, HEADER, None)
            if record_id is None or request.called_directly or request.is_eager:
                return run(*args, **kwargs)
            if not store.tracked_id(record_id):
                logger.warning("outbox: task %s[%s] runs untracked: its %s %r cannot name a "
                               "record of %s", task.name, request.id, HEADER, record_id,
                               store.spec.table)
            elif self._processed_or_requeue(task, record_id):
                raise duplicate(task, record_id)
            return run(*args, **kwargs)

        self._guarded[task] = vars(task).get("run")
        task.run = guarded

    def _processed_or_requeue(self, task: Task, record_id: Any) -> bool:
        """Whether the record is processed; a lookup that failed on the connection raises
        the Reject that requeues the delivery."""
        try:
            return self.store.is_processed(record_id)
        except DBAPIError as exc:
            if not (exc.connection_invalidated
                    or isinstance(exc, (OperationalError, InterfaceError))):
                raise
            logger.warning("outbox: could not look up record %s of %s[%s], delivery "
                           "requeued: %s", record_id, task.name, task.request.id, exc.orig)
            raise Reject(f"outbox record {record_id} could not be looked up: {exc.orig}",
                         requeue=True) from exc

    # -- marking ---------------------------------------------------------------------
    def on_postrun(self, sender: Task | None = None, state: str | None = None,
                   **_: Any) -> None:
        """Mark the record once the task finished in a state whose message is acked."""
        if sender is None or sender.app is not self.app:
            return
        request = sender.request
        record_id = getattr(request, HEADER, None)
        if (record_id is None or request.called_directly or request.is_eager
                or getattr(request, "outbox_marked", False) or state == REJECTED
                or not self.store.tracked_id(record_id)):
            return
        acks_late = getattr(request, "acks_late", None) or sender.acks_late
        if state == FAILURE and acks_late and not (
                sender.acks_on_failure_or_timeout):
            return
        try:
            with self.store.engine.begin() as conn:
                self.store.mark_processed(conn, record_id)
        except Exception:
            logger.exception("outbox: could not mark record %s processed; it will be sent "
                             "again after the grace period", record_id)

    def mark_for_task(self, conn: Connection, task: Task, record_id: Any) -> None:
        """Mark ``task``'s record processed in ``conn``'s transaction; raise Ignore when it
        was processed already. A record this outbox does not hold (another service's, or
        pruned) is no duplicate: the task runs, untracked."""
        if not self.store.mark_processed(conn, record_id) and self.store.processed_in(
                conn, record_id):
            raise duplicate(task, record_id)

    @contextmanager
    def transaction(self) -> Iterator[Connection]:
        """The running task's transaction on the outbox database, with its record marked
        processed inside it: the task's writes and the mark commit together, so a duplicate
        delivery finds the record processed and is skipped (raises Ignore). Tracked tasks
        sent inside are recorded in this transaction and sent after it commits."""
        task = self.app.current_worker_task
        record_id = getattr(task.request, HEADER, None) if task is not None else None
        if not self.store.tracked_id(record_id):  # none, or not ours: the task runs untracked
            record_id = None
        with self.store.engine.begin() as conn:
            if record_id is not None:
                self.mark_for_task(conn, task, record_id)
            with binding.bind(conn):
                yield conn
        if record_id is not None:  # committed: the worker need not mark it again
            task.request.outbox_marked = True
