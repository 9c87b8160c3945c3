"""The thread that keeps consumed queues from expiring.

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


class Renewer:
    """Runs ``renew`` (which returns the seconds until it is due again, None when nothing
    is to renew) on a daemon thread from :meth:`start` until :meth:`stop`."""

    def __init__(self, renew: Callable[[], float | None]) -> None:
        self.renew = renew
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
        self._stopped = True
        self._wake.set()

    def _run(self) -> None:
        while not self._stopped:
            self._wake.clear()
            try:
                wait = self.renew()
            except Exception:
                # the database out of reach, or anything else: the queues must stay
                # renewed once it is back, so the thread goes on
                logger.warning("sqlinbox: renewing the expiry of consumed queues failed; "
                               "retrying in %gs", RETRY, exc_info=True)
                wait = RETRY
            self._wake.wait(wait)
