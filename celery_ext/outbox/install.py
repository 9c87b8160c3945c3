"""Installing an outbox into its app, and undoing it.

:class:`Installation` hooks the publish side and the consumer guard in, registers
the maintenance tasks, creates the table at worker start, republishes once the worker
is ready, and keeps forked pool processes off the parent's pooled connections;
:meth:`Installation.uninstall` undoes every one of those.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Protocol
from weakref import WeakKeyDictionary

from celery import Celery, signals
from sqlalchemy import Connection

from ..declaration import OutboxSpec
from .guard import ConsumerGuard
from .hook import PublishHook, Republished
from .store import OutboxError, OutboxNotReady, RecordStore

__all__ = [
    "DISABLED_ENV", "PRUNE_TASK", "REPUBLISH_TASK", "Installable", "Installation",
    "beat_schedule", "disabled_by_env", "installed", "mark_processed",
]

logger = logging.getLogger(__name__)

#: set to 1 (or true/yes/on) to install nothing, e.g. for tests with task_always_eager
DISABLED_ENV = "CELERY_OUTBOX_DISABLED"
PRUNE_TASK = "celery_ext.outbox.prune"
REPUBLISH_TASK = "celery_ext.outbox.republish"



class Installable(Protocol):
    """The outbox as installing it sees it (:class:`celery_ext.outbox.Outbox`, which
    composes an :class:`Installation`): declared here, so that this module imports nothing
    of the package that builds on it."""

    app: Celery
    spec: OutboxSpec
    store: RecordStore
    hook: PublishHook
    guard: ConsumerGuard

    def create(self) -> None: ...

    def republish(self) -> Republished: ...

    def prune(self) -> int: ...

    def mark_processed(self, conn: Connection, record_id: Any) -> bool: ...


_INSTALLED: WeakKeyDictionary[Celery, Installable] = WeakKeyDictionary()


def disabled_by_env() -> bool:
    return os.environ.get(DISABLED_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def installed(app: Celery) -> Installable:
    """The outbox installed on ``app`` (:func:`celery_ext.outbox.outbox_of` says it is an
    :class:`~celery_ext.outbox.Outbox`)."""
    try:
        return _INSTALLED[app]
    except KeyError:
        raise OutboxError(f"no outbox is installed on {app!r}") from None


def mark_processed(conn: Connection, record_id: Any, app: Celery | None = None) -> bool:
    """Mark ``record_id`` processed in ``conn``'s transaction, with the outbox of ``app``
    (default: the current app); see :meth:`Outbox.mark_processed`."""
    from celery import current_app

    return installed(app or current_app._get_current_object()).mark_processed(conn, record_id)


def beat_schedule(prune_every: float = 3600.0,
                  republish_every: float | None = None) -> dict[str, dict[str, Any]]:
    """Entries for ``app.conf.beat_schedule``: pruning, and optionally republish."""
    entries: dict[str, dict[str, Any]] = {
        "outbox-prune": {"task": PRUNE_TASK, "schedule": prune_every}}
    if republish_every is not None:
        entries["outbox-republish"] = {"task": REPUBLISH_TASK, "schedule": republish_every}
    return entries


def _forget_connections_after_fork() -> None:
    """A forked pool process must not share the parent's pooled connections or locks."""
    for outbox in list(_INSTALLED.values()):
        outbox.store.forget_connections()


os.register_at_fork(after_in_child=_forget_connections_after_fork)


class Installation:
    """Whether, and how, one outbox is hooked into its app."""

    def __init__(self, outbox: Installable, republish_on_start: bool) -> None:
        self.outbox = outbox
        self.republish_on_start = republish_on_start
        self.installed = False

    def install(self) -> None:
        """Hook the outbox into its app; does nothing when CELERY_OUTBOX_DISABLED is set."""
        if disabled_by_env():
            logger.info("outbox: disabled by %s", DISABLED_ENV)
            return
        outbox = self.outbox
        app = outbox.app
        if app in _INSTALLED:
            raise OutboxError(f"an outbox is already installed on {app!r}")
        _INSTALLED[app] = outbox
        self.installed = True
        outbox.hook.hook()
        register_maintenance_tasks(app)
        outbox.guard.connect()
        signals.worker_init.connect(self.on_worker_init, weak=False)
        signals.worker_ready.connect(self.on_worker_ready, weak=False)

    def uninstall(self) -> None:
        """Undo :meth:`install`: the app sends untracked, as before, its workers neither
        skip nor mark, and the signals have their receivers of before."""
        if not self.installed:
            return
        outbox = self.outbox
        del _INSTALLED[outbox.app]
        self.installed = False
        outbox.hook.unhook()
        outbox.guard.disconnect()
        signals.worker_init.disconnect(self.on_worker_init)
        signals.worker_ready.disconnect(self.on_worker_ready)
        for name in (PRUNE_TASK, REPUBLISH_TASK):
            outbox.app._tasks.pop(name, None)

    def on_worker_init(self, sender: Any = None, **_: Any) -> None:
        """Create or check the table at worker start, before any task runs: a mismatch shows
        up at once, and no task's first tracked publish waits on DDL."""
        outbox = self.outbox
        if getattr(sender, "app", None) is not outbox.app:
            return
        try:
            outbox.create()
        except OutboxNotReady:
            logger.debug("outbox: no database at worker_init; the table is checked on first use")
        except Exception:
            logger.exception("outbox: table %r is not usable", outbox.spec.table)

    def on_worker_ready(self, sender: Any = None, **_: Any) -> None:
        if getattr(sender, "app", None) is not self.outbox.app or not self.republish_on_start:
            return
        threading.Thread(target=self._republish_logged, name="outbox-republish",
                         daemon=True).start()

    def _republish_logged(self) -> None:
        try:
            self.outbox.republish()
        except Exception:
            logger.exception("outbox: republish at worker start failed")


def register_maintenance_tasks(app: Celery) -> None:
    """The prune and republish tasks, run by whichever outbox the app has when they run
    (one installed again after an uninstall takes them over)."""

    def prune_outbox() -> int:
        return installed(app).prune()

    def republish_outbox() -> dict[str, Any]:
        done = installed(app).republish()
        return {"sent": done.sent, "failed": list(done.failed), "held": done.held}

    app.task(name=PRUNE_TASK, shared=False, ignore_result=True)(prune_outbox)
    app.task(name=REPUBLISH_TASK, shared=False, ignore_result=True)(republish_outbox)
