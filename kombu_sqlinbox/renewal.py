"""The thread that keeps consumed queues from expiring (and deletes the rows of the
auto-delete queues left to it: :meth:`.Routes.forget`).

A queue with a consumer never expires, as on RabbitMQ, whatever the consumer is doing: a
Celery worker running a long task with every prefetch slot taken claims nothing (a solo
worker runs nothing else at all), so the renewal cannot ride on its claims. One thread
per process pushes back the expiry of every queue a consumer of the process is on.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)

#: seconds before a renewal that failed (the database out of reach) is tried again
RETRY = 1.0
#: seconds a broker's close waits for a round of the thread under way
STOP_WAIT = 5.0


class Renewer:
    """Runs ``renew`` (which returns the seconds until it is due again, None when nothing
    is to renew) on a daemon thread from :meth:`start` until :meth:`stop`, then ``last``
    (the work a round would have done before the process goes)."""

    def __init__(self, renew: Callable[[], float | None],
                 last: Callable[[], object] = lambda: None) -> None:
        self.renew, self.last = renew, last
        self._wake = threading.Event()
        self._stopped = False
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        """Start the thread unless it runs; wake it when it does (a queue more to renew)."""
        with self._lock:
            if self._thread is None and not self._stopped:
                self._thread = threading.Thread(target=self._run, name="sqlinbox-renewal",
                                                daemon=True)
                self._thread.start()
        self._wake.set()

    def stop(self) -> None:
        """Stop the thread, waiting (at most :data:`STOP_WAIT`) for a round under way: its
        deletes are done, or not begun, when the broker closes."""
        self._stopped = True
        self._wake.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(STOP_WAIT)
            if thread.is_alive():
                return  # a round still under way holds what ``last`` would do
        try:
            self.last()
        except Exception:
            # the process is going: what is left expires, as after a crash
            logger.warning("sqlinbox: deleting auto-deleted queues as the broker closes "
                           "failed; they are left to expire", exc_info=True)

    def _run(self) -> None:
        while not self._stopped:
            self._wake.clear()
            try:
                wait = self.renew()
            except Exception:
                # the database out of reach, or anything else: the queues must stay
                # renewed once it is back, so the thread goes on
                logger.warning("sqlinbox: deleting auto-deleted queues or renewing the "
                               "expiry of consumed queues failed; retrying in %gs", RETRY,
                               exc_info=True)
                wait = RETRY
            self._wake.wait(wait)


class Doomed:
    """Queues deleted in this process whose rows the renewal thread deletes (``rows_of``);
    one declared or bound again meanwhile is spared (a delete under way is done first)."""

    def __init__(self, rows_of: Callable[[list[str]], object]) -> None:
        self.rows_of = rows_of
        self._queues: set[str] = set()
        self._lock = threading.Lock()

    def add(self, queue: str) -> None:
        with self._lock:
            self._queues.add(queue)

    def spare(self, queue: str) -> None:
        with self._lock:
            self._queues.discard(queue)

    def delete(self) -> None:
        """Run ``rows_of`` on every doomed queue, which are forgotten once it returned
        (kept for the next round when it raised)."""
        with self._lock:
            queues = sorted(self._queues)
            if queues:
                self.rows_of(queues)
                self._queues.difference_update(queues)
