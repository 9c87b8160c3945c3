"""When an idle consumer claims again, where no wake-up comes first; and its rounds in
kombu's event loop."""

from __future__ import annotations

import logging
from typing import Any, Protocol

from .broker import Broker
from .retries import Cadence, next_backoff

logger = logging.getLogger(__name__)


class Polled(Protocol):
    """The transport, as its rounds in an event loop see it (:mod:`.transport` imports
    this module, not the other way round)."""

    cadence: Cadence
    polling_interval: float
    connection_errors: tuple[type[BaseException], ...]

    @property
    def broker(self) -> Broker: ...

    def consume_ready(self) -> bool: ...


class EventLoop:
    """A transport's rounds in kombu's event loop (Celery's, with :confval:`event_loop`):
    the wake-up's sources (the in-process pipe, the LISTEN socket, the same-host signal)
    are the hub's readers, and a timer claims after the :class:`Cadence`'s wait, as the
    blocking loop's wait would."""

    def __init__(self, transport: Polled) -> None:
        self.transport = transport
        self._loop: Any = None  # the kombu hub consumed from, if any
        self._readers: dict[int, Any] = {}
        self._poll_timer: Any = None
        #: the wait after the last polling round of the event loop, when it failed
        self._round_backoff = 0.0

    def register(self, loop: Any) -> None:
        """Start the rounds in ``loop``."""
        self.leave()  # registered again (a reconnect): one timer, one set of readers
        self._loop, self._readers = loop, {}
        self._on_timer(loop)

    def _on_timer(self, loop: Any) -> None:
        """Claim, delete what expired (as the blocking loop's idle rounds do; at most every
        :confval:`sweep_interval`), then set the timer for the next round."""
        if self._round(loop, sweep=True) is not None:
            self._schedule(loop)

    def _round(self, loop: Any, sweep: bool = False) -> bool | None:
        """A round of the event loop: whether it delivered; None when it failed, and the
        next round is set after a back-off. The hub would log a timer's error and never
        set the next (due countdowns and retries would wait for ever), and end the worker
        on a reader's. A connection error propagates: Celery connects again and
        registers the transport with its loop anew."""
        try:
            delivered = self._on_poll(loop)
            if sweep:
                self.transport.broker.sweep()
        except self.transport.connection_errors:
            raise
        except Exception as exc:
            if self._round_backoff and not sweep:
                # a wake-up's round while the back-off's timer is set: that round reports
                # (here each published message would log a traceback); the other queues
                # are still served at once
                logger.debug("sqlinbox: a polling round failed (%s)", exc, exc_info=True)
                return None
            self._round_backoff = next_backoff(self._round_backoff)
            logger.error("sqlinbox: a polling round failed (%s); the next in %.1fs", exc,
                         self._round_backoff, exc_info=True)
            self._schedule(loop, self._round_backoff)
            return None
        self._round_backoff = 0.0
        return delivered

    def _schedule(self, loop: Any, wait: float | None = None) -> None:
        """The timer of the next round (one at a time), after ``wait`` or the cadence's."""
        if self._poll_timer is not None:
            self._poll_timer.cancel()
        if wait is None:
            ceiling = self.transport.polling_interval
            wait = self.transport.broker.rates.idle_wait(
                self.transport.cadence.idle(ceiling), ceiling)
        self._poll_timer = loop.call_later(wait, self._on_timer, loop)

    def leave(self) -> None:
        """Cancel the timer and drop the readers: a closed connection must not go on
        claiming from the hub."""
        if self._loop is not None:
            if self._poll_timer is not None:
                self._poll_timer.cancel()
            for fd in self._readers:
                self._loop.remove_reader(fd)
        self._loop, self._readers, self._poll_timer = None, {}, None

    def _on_poll(self, loop: Any) -> bool:
        """A turn of the loop that may deliver: the polling timer, or a reader woke.
        Whether it delivered (the cadence's next wait is then its shortest)."""
        self._watch(loop)
        if self.transport.consume_ready():
            self.transport.cadence.active()
            return True
        return False

    def _watch(self, loop: Any) -> None:
        """Keep the hub's readers the wake-up's current sources (the LISTEN connection
        comes with the first consumed queue, and is new after it died)."""
        sources = {source if isinstance(source, int) else source.fileno(): source
                   for source in self.transport.broker.wakeup.sources()}
        for fd in self._readers.keys() - sources.keys():
            loop.remove_reader(fd)
        for fd in sources.keys() - self._readers.keys():
            loop.add_reader(fd, self._on_readable, loop, sources[fd])
        self._readers = sources

    def _on_readable(self, loop: Any, source: Any) -> None:
        self.transport.broker.wakeup.take([source])
        if self._round(loop):
            self._schedule(loop)  # the next round comes soon now
