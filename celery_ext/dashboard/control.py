"""The dashboard's pages of what runs the queues: the workers (remote control and their
heartbeats), the paused queues (pause, resume) and the limits (configured, and the rows
in work per limit key)."""

from __future__ import annotations

import time
from typing import Any, Protocol

from kombu.exceptions import OperationalError as BrokerFailed
from werkzeug.exceptions import BadRequest, NotFound
from werkzeug.wrappers import Request, Response

from kombu_sqlinbox.limit_figures import queue_limits
from kombu_sqlinbox.pause_operations import unknown_queue

from .pages import Site
from .workers import Heartbeats, Worker, ask

__all__ = ["Control"]

class Host(Site, Protocol):
    """What these pages need of the application beyond :class:`~.pages.Site`."""

    def who(self, identity: str) -> str: ...


#: the most limit keys the limits page lists per queue (the busiest)
KEYS = 50


class Control:
    """The workers, pauses and limits pages over the dashboard's operations and app
    (None: the workers page says it needs one). ``timeout``: how long the workers page
    waits for the workers' answers (seconds)."""

    def __init__(self, dashboard: Host, app: Any, timeout: float) -> None:
        self.dashboard = dashboard
        self.ops = dashboard.ops
        self.app = app
        self.timeout = timeout
        self.heartbeats = None if app is None else Heartbeats(app)

    def close(self) -> None:
        if self.heartbeats is not None:
            self.heartbeats.stop()

    # -- workers -----------------------------------------------------------------------
    def workers(self, request: Request, identity: str) -> Response:
        """Every worker that answered within the timeout or sent a heartbeat: its tasks in
        work, its stats, its last heartbeat's age."""
        found: dict[str, Worker] = {}
        failed = None
        if self.heartbeats is not None:
            self.heartbeats.start()
            try:
                found = ask(self.app, self.timeout)
            except BrokerFailed as exc:
                failed = str(exc)
            for name, beat in self.heartbeats.last().items():
                found.setdefault(name, Worker(name)).heartbeat = beat
        return self.dashboard.render(
            request, "workers.html", identity, live=True, missing=self.app is None,
            workers=sorted(found.values(), key=lambda each: each.name),
            timeout=self.timeout, failed=failed, clock=time.time(),
            events=None if self.heartbeats is None else self.heartbeats.error)

    # -- pauses ------------------------------------------------------------------------
    def pauses(self, request: Request, identity: str) -> Response:
        """Every queue, paused or not, with who paused it, when and why."""
        paused = {each.queue: each for each in self.ops.paused()}
        names = [name for name, _ in self.ops.queues()]
        return self.dashboard.render(
            request, "pauses.html", identity, live=True, paused=paused, clock=time.time(),
            queues=names + sorted(set(paused) - set(names)))

    def pause_queue(self, request: Request, identity: str) -> Response:
        """Pause a queue this app or database knows (as ``sqlinbox pause``), by whoever is
        signed in (mounted) or by ``dashboard``."""
        queue = self._queue(request)
        kept, made = self.ops.pause(queue, request.form.get("reason", "").strip() or None,
                                    self.dashboard.who(identity))
        done = f"paused {queue}" if made else f"{queue} was paused already" + (
            f" by {kept.by}" if kept.by else "")
        return self.dashboard.told(request, identity, "pauses", done)

    def resume_queue(self, request: Request, identity: str) -> Response:
        queue = self._queue(request)
        if not self.ops.resume(queue):
            raise NotFound(str(unknown_queue(queue, [each.queue for each in self.ops.paused()],
                                             "paused")))
        return self.dashboard.told(request, identity, "pauses", f"resumed {queue}")

    @staticmethod
    def _queue(request: Request) -> str:
        queue = request.form.get("queue", "").strip()
        if not queue:
            raise BadRequest("which queue: queue is missing")
        return queue

    # -- limits ------------------------------------------------------------------------
    def limits(self, request: Request, identity: str) -> Response:
        """The queues with limits: concurrency limits per key prefix, ``max_in_work``,
        rate limits, and the busiest keys' rows in work against their limits."""
        return self.dashboard.render(request, "limits.html", identity, live=True,
                                     found=queue_limits(self.ops, KEYS), keys=KEYS)
