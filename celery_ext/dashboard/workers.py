"""The workers page's reads: who answers Celery's remote control now, and the heartbeats
the workers' events brought.

Each request of the page broadcasts ``inspect active`` and waits ``timeout`` seconds for
the replies (every worker consuming the broker answers, busy or not), then asks the
workers that answered for their ``stats``, returning as soon as each did; so a page
waits about ``timeout`` seconds, at most twice that, however many workers there are or
whether any answers. Workers started with ``-E`` also send a ``worker-heartbeat`` event
every two seconds: a thread of the dashboard's process, started at the first request of
the page, receives them into memory (the last one of each worker), as ``celery events``
does.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["Heartbeat", "Heartbeats", "Worker", "ask"]

#: seconds before the event receiver connects again after its connection failed
RECONNECT = 2.0
#: a worker is taken to be alive while its last heartbeat is this many periods old at
#: most (Celery's own monitors: twice the period)
EXPIRES = 2.0


@dataclass(frozen=True)
class Heartbeat:
    """A worker's last heartbeat (or online/offline event): when it came (this process's
    clock), its tasks in work and processed then, its period; ``offline``: the worker
    said it is going away."""

    at: float
    active: int | None
    processed: int | None
    freq: float
    offline: bool = False

    def alive(self, now: float) -> bool:
        return not self.offline and now - self.at <= self.freq * EXPIRES


@dataclass
class Worker:
    """What the page shows of one worker: its answer to the broadcast (``answered``,
    its tasks in work, its stats) and its last heartbeat."""

    name: str
    answered: bool = False
    active: list[dict[str, Any]] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)
    heartbeat: Heartbeat | None = None

    @property
    def processed(self) -> int | None:
        total = self.stats.get("total")
        return sum(total.values()) if isinstance(total, dict) else None


def ask(app: Any, timeout: float) -> dict[str, Worker]:
    """The workers that answer ``inspect active`` within ``timeout`` seconds, with their
    tasks in work and their stats (asked of those workers only: back as soon as each
    answered, within ``timeout`` again)."""
    active = app.control.inspect(timeout=timeout).active() or {}
    found = {name: Worker(name, True, list(tasks or [])) for name, tasks in active.items()}
    if found:
        stats = app.control.inspect(timeout=timeout, destination=list(found),
                                    limit=len(found)).stats() or {}
        for name, given in stats.items():
            if name in found and isinstance(given, dict):
                found[name].stats = given
    return found


class Heartbeats:
    """The workers' last heartbeats, received by a daemon thread from the app's event
    exchange: started by :meth:`start` (again after :meth:`stop`), stopped within a
    second by :meth:`stop`. ``error`` says why it is not connected, while it is not."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.seen: dict[str, Heartbeat] = {}
        self.error: str | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._receiver: Any = None

    def start(self) -> None:
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, daemon=True,
                                            name="sqlinbox-dashboard-heartbeats")
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        receiver, thread = self._receiver, self._thread
        if receiver is not None:
            receiver.should_stop = True
        if thread is not None:
            thread.join(RECONNECT + 5.0)

    def last(self) -> dict[str, Heartbeat]:
        with self._lock:
            return dict(self.seen)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                with self.app.connection_for_read() as conn:
                    self._receiver = self.app.events.Receiver(conn, handlers={
                        "worker-heartbeat": self._beat, "worker-online": self._beat,
                        "worker-offline": self._beat})
                    self._receiver.should_stop = self._stop.is_set()
                    self.error = None
                    self._receiver.capture(limit=None, timeout=None, wakeup=False)
            except Exception as exc:  # any failure: shown on the page, connected again
                self.error = f"{type(exc).__name__}: {exc}"
                logger.warning("sqlinbox dashboard: the workers' events: %s", self.error)
                self._stop.wait(RECONNECT)

    def _beat(self, event: dict[str, Any]) -> None:
        name = event.get("hostname")
        if not isinstance(name, str):
            return
        beat = Heartbeat(time.time(), event.get("active"), event.get("processed"),
                         float(event.get("freq") or 2.0),
                         event.get("type") == "worker-offline")
        with self._lock:
            self.seen[name] = beat
