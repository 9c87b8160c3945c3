"""The process's brokers: one per URL and options, behind every Transport on them.

Celery opens several kombu connections per process (consumer, producer pool,
events); they all share one :class:`~.broker.Broker` per URL and options, so the
process has one engine with a bounded pool, one lease keeper and one view of which
queue lives in which table. A forked child (a prefork pool process) starts with
none of it: it opens its own engine when it first publishes.
"""

from __future__ import annotations

import atexit
import os
import threading
from typing import Any

from .broker import Broker
from .options import TransportOptions

_BROKERS: dict[tuple[str, str], Broker] = {}
_BROKERS_LOCK = threading.Lock()


class _Shutdown:
    """Whether this process's Celery worker has begun to shut down (:func:`stop_waiting`)."""

    begun = False


def stop_waiting(**_: Any) -> None:
    """Celery's ``worker_shutting_down``: the consumers of this process stop waiting for
    work. Celery's blocking loop looks for a shutdown only between drains of up to two
    seconds, and drains once more after it, so an idle worker's warm shutdown would
    otherwise sit out two whole waits. Sent from Celery's signal handler, perhaps in the
    middle of code holding a lock: it takes none."""
    _Shutdown.begun = True
    for broker in list(_BROKERS.values()):
        broker.wakeup.poke()


def shutting_down() -> bool:
    """Whether :func:`stop_waiting` ran in this process."""
    return _Shutdown.begun


def broker_for(url: str, options: TransportOptions) -> Broker:
    """The process's broker for this URL and options."""
    key = (url, repr(options))
    with _BROKERS_LOCK:
        found = _BROKERS.get(key)
        if found is None or found.pid != os.getpid() or found.closed:
            found = _BROKERS[key] = Broker(url, options)
        return found


def close_all() -> None:
    """Write what is pending and close every broker of this process; also run at the
    process's exit, so acks made just before a normal exit are not delivered again."""
    with _BROKERS_LOCK:
        brokers = list(_BROKERS.values())
        _BROKERS.clear()
    for broker in brokers:
        broker.close()


def _forget_after_fork() -> None:
    """A forked child must not use the parent's pooled connections or held rows, and is
    not the worker that shuts down; its copy of the lock may be held for ever by a thread
    of the parent's (the child has none of them)."""
    global _BROKERS_LOCK
    _BROKERS_LOCK = threading.Lock()
    _Shutdown.begun = False
    for broker in _BROKERS.values():
        broker.database.dispose(close=False)
    _BROKERS.clear()


os.register_at_fork(after_in_child=_forget_after_fork)
atexit.register(close_all)
