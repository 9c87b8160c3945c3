"""The transactional outbox for Celery, with any broker (RabbitMQ, Redis, sqlinbox).

Each tracked task is written to an outbox table of the service's database
*before* the broker sees it; the record id travels in the message header
``outbox_id``. The consumer marks the record processed when the task finishes
(and its message is acked); records left unprocessed longer than a grace period
are sent again, byte for byte, with the same task id and record id.

:class:`Outbox` composes four parts: the record store (:mod:`.store`: the table and
every read and write of it), the publish hook (:mod:`.hook`: the wrapped sender that
records tracked tasks, and republish), the consumer guard (:mod:`.guard`: the worker's
duplicate check and mark) and the installation (:mod:`.install`: hooking those into
the app and undoing it).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from contextlib import AbstractContextManager
from typing import Any, cast

from celery import Celery, Task
from sqlalchemy import Connection
from sqlalchemy.engine import Engine

from ..declaration import DEFAULT_TABLE, Declaration, OutboxSpec, as_outbox_spec
from .guard import ConsumerGuard, duplicate
from .hook import HEADER, TRANSIENT, PublishHook, RecordingProducer, Republished, TaskFilter
from .install import (
    DISABLED_ENV,
    PRUNE_TASK,
    REPUBLISH_TASK,
    Installation,
    beat_schedule,
    disabled_by_env,
    installed,
    mark_processed,
)
from .store import (
    Message,
    OutboxError,
    OutboxNotReady,
    OutboxStatus,
    Prepared,
    RecordFailed,
    RecordStore,
    WriteLockHeld,
    engine_from_url,
)

__all__ = [
    "DISABLED_ENV", "HEADER", "PRUNE_TASK", "REPUBLISH_TASK", "TRANSIENT", "Message", "Outbox",
    "OutboxError", "OutboxNotReady", "OutboxStatus", "Prepared", "RecordFailed",
    "RecordingProducer", "Republished", "TaskFilter", "WriteLockHeld", "disabled_by_env",
    "duplicate", "engine_from_url", "install", "mark_processed", "outbox_of",
]


class Outbox:
    """The outbox of one Celery app. :func:`install` creates one and hooks it in.

    ``engine_or_url`` may come later (:meth:`bind_engine`, e.g. from ``worker_init``) or
    from ``app.conf.outbox_url``. ``tasks`` is None (all), a collection of task names or
    a predicate on the name; ``queues`` a collection of queue names; with both, a task
    matching either is tracked. ``grace`` (seconds) is how long a record may stay
    unprocessed before republish sends it again; ``retention`` how long processed
    records are kept before :meth:`prune` deletes them.
    """

    def __init__(
        self,
        app: Celery,
        engine_or_url: Engine | str | None = None,
        *,
        table: Declaration = DEFAULT_TABLE,
        tasks: TaskFilter = None,
        queues: Collection[str] | None = None,
        grace: float = 300.0,
        retention: float = 7 * 86400.0,
        create_table: bool = True,
        republish_on_start: bool = True,
        batch: int = 500,
        sqlite_task_busy_timeout: float = 1.0,
    ) -> None:
        self.app = app
        self.spec: OutboxSpec = as_outbox_spec(table)
        self.store = RecordStore(app, self.spec, create_table=create_table,
                                 retention=retention, batch=batch,
                                 task_write_wait=sqlite_task_busy_timeout)
        self.hook = PublishHook(app, self.store, tasks=tasks, queues=queues,
                                untracked=(PRUNE_TASK, REPUBLISH_TASK), grace=grace,
                                batch=batch)
        self.guard = ConsumerGuard(app, self.store)
        self.installation = Installation(self, republish_on_start)
        if engine_or_url is not None:
            self.bind_engine(engine_or_url)

    @property
    def enabled(self) -> bool:
        """Whether the outbox is installed (not while CELERY_OUTBOX_DISABLED is set)."""
        return self.installation.installed

    @property
    def grace(self) -> float:
        return self.hook.grace

    # -- the database ------------------------------------------------------------
    def bind_engine(self, engine_or_url: Engine | str) -> Engine:
        """Give the outbox its database: an Engine of the service, or a URL."""
        return self.store.bind_engine(engine_or_url)

    @property
    def engine(self) -> Engine:
        return self.store.engine

    def use_table(self, table: Declaration) -> OutboxSpec:
        """Record in another table from now on (the test fixtures give each test one of
        its own); returns the declaration used before."""
        previous = self.spec
        self.spec = as_outbox_spec(table)
        self.store.use_spec(self.spec)
        return previous

    def create(self) -> None:
        """Create (or check) the table now, e.g. at start-up, instead of on first use."""
        self.store.create()

    def drop(self) -> None:
        """Drop the outbox table (tests and tear-downs)."""
        self.store.drop()

    def close(self) -> None:
        """Dispose the engine the outbox created from a URL."""
        self.store.close()

    # -- records -------------------------------------------------------------------
    def record(self, message: Message, task_id: str | None, task_name: str,
               bound: Connection | None = None) -> Any:
        """Write the record of ``message`` and return its id (see :meth:`RecordStore.record`)."""
        return self.store.record(message, task_id, task_name, bound)

    def tracked_id(self, record_id: Any) -> bool:
        return self.store.tracked_id(record_id)

    def is_processed(self, record_id: Any) -> bool:
        return self.store.is_processed(record_id)

    def mark_processed(self, conn: Connection, record_id: Any) -> bool:
        """Mark a record processed in ``conn``'s transaction (e.g. a transactional task's);
        True when this call marked it, False when it was already processed or is gone."""
        return self.store.mark_processed(conn, record_id)

    def mark_for_task(self, conn: Connection, task: Task, record_id: Any) -> None:
        """Mark ``task``'s record processed in ``conn``; Ignore when it was already."""
        self.guard.mark_for_task(conn, task, record_id)

    def transaction(self) -> AbstractContextManager[Connection]:
        """The running task's transaction with its record marked processed inside it (see
        :meth:`ConsumerGuard.transaction`)."""
        return self.guard.transaction()

    # -- maintenance -----------------------------------------------------------------
    def republish(self, older_than: float | None = None, limit: int | None = None,
                  progress: Callable[[int], None] | None = None) -> Republished:
        """Send again the records unprocessed for ``older_than`` seconds (default: the grace
        period); see :meth:`PublishHook.republish`."""
        return self.hook.republish(older_than, limit, progress)

    def prune(self, older_than: float | None = None,
              progress: Callable[[int], None] | None = None) -> int:
        """Delete records processed more than ``older_than`` seconds ago (default: the
        retention), in batches (``progress`` is told each one's count); returns how many."""
        return self.store.prune(older_than, progress)

    def status(self, exact_upto: int | None = None) -> OutboxStatus:
        """The outbox table's counts (see :meth:`.RecordStore.status`)."""
        return self.store.status(exact_upto)

    def beat_schedule(self, prune_every: float = 3600.0,
                      republish_every: float | None = None) -> dict[str, dict[str, Any]]:
        """Entries for ``app.conf.beat_schedule``: pruning, and optionally republish."""
        return beat_schedule(prune_every, republish_every)

    # -- installing -----------------------------------------------------------------
    def install(self) -> Outbox:
        """Hook the outbox into its app; does nothing when CELERY_OUTBOX_DISABLED is set."""
        self.installation.install()
        return self

    def uninstall(self) -> None:
        """Undo :meth:`install`: the app sends as before, its workers neither skip nor mark."""
        self.installation.uninstall()


def outbox_of(app: Celery) -> Outbox:
    """The outbox installed on ``app``; :class:`OutboxError` when it has none."""
    return cast(Outbox, installed(app))  # only an Outbox installs itself


def install(app: Celery, engine_or_url: Engine | str | None = None, **options: Any) -> Outbox:
    """Create the app's :class:`Outbox` and hook it in, in one call."""
    return Outbox(app, engine_or_url, **options).install()
