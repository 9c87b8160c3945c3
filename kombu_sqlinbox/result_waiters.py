"""Waiting for a task's result: one thread's LISTEN connection (PostgreSQL) or same-host
signal socket and polling cadence, lent by :class:`kombu_sqlinbox.results.ResultStore`
for each wait (see there).
"""

from __future__ import annotations

import contextlib
import logging
import select
import time
from collections.abc import Iterator
from typing import Any

from .database import Database
from .own_session import OwnSession
from .retries import Cadence
from .wakeups import LocalSignal

logger = logging.getLogger(__name__)
#: a polling waiter's first wait, and how much longer each next one is
POLL_FIRST = 0.005
POLL_BACKOFF = 1.25


class Waiter:
    """One thread's wait for results: LISTEN on a connection of its own (PostgreSQL),
    else the same-host signal's socket (SQLite, MariaDB/MySQL) and polling at a
    :class:`Cadence`."""

    def __init__(self, database: Database, prefix: str, signal_directory: str | None) -> None:
        self.dialect = dialect = database.dialect
        self.prefix = prefix
        listens = dialect.capabilities.wakeups and dialect.notify
        self._own = OwnSession(database) if listens else None
        self.signal = LocalSignal(signal_directory) if signal_directory is not None else None
        self.cadence = Cadence(POLL_FIRST, POLL_BACKOFF)
        self._channel: str | None = None

    @contextlib.contextmanager
    def watching(self, task_id: str) -> Iterator[None]:
        """LISTEN on the task's channel (or bind the same-host signal's socket) for the
        wait, before its first read, so that no announcement falls between the two;
        UNLISTEN after."""
        self.cadence.active()
        if self.signal is not None:
            self.signal.bind()
        channel = self.dialect.result_channel(self.prefix, task_id)
        self._channel = channel if self._listen(f"LISTEN {self._quoted(channel)}") else None
        try:
            yield
        finally:
            if self._channel is not None:
                self._listen(f"UNLISTEN {self._quoted(channel)}")
                self._channel = None

    def _quoted(self, channel: str) -> str:
        return self.dialect.quote(channel)

    def _listen(self, statement: str) -> bool:
        """Run (UN)LISTEN on the connection of this waiter, connected on first need;
        False where there is none (no NOTIFY here, or the database is away: it polls)."""
        if self._own is None:
            return False
        try:
            session = self._own.session or self._own.connect()
            session.exec_driver_sql(statement)
            session.commit()
            return True
        except Exception as exc:  # polled until the next wait connects again
            logger.warning("sqlinbox: the result waiter's LISTEN failed (%s); polling", exc)
            self._own.drop()
            return False

    def wait(self, seconds: float) -> None:
        """Return after a wake-up or ``seconds`` (LISTEN: every writer announces); a
        waiter that may miss writers (the same-host signal reaches this host's only, and
        polling none) reads again at a :class:`Cadence`, soon at first."""
        listening = self._channel is not None and self._own is not None and self._own.driver
        sources: list[Any] = [self._own.driver] if listening and self._own else []
        if self.signal is not None and self.signal.socket is not None:
            sources.append(self.signal.socket)
        wait = seconds if listening else self.cadence.idle(seconds)
        if not sources:
            time.sleep(wait)
            return
        try:
            ready, _, _ = select.select(sources, [], [], wait)
        except (OSError, ValueError):  # the listener's socket died: connect again next time
            self._drop()
            return
        if self.signal is not None and self.signal.socket in ready:
            self.signal.take()
        if self._own is not None and self._own.driver in ready:
            try:
                self.dialect.take_notifications(self._own.driver)
            except Exception:
                self._drop()

    def _drop(self) -> None:
        if self._own is not None:
            self._own.drop()
        self._channel = None

    def close(self, mine: bool) -> None:
        if self._own is not None and mine:
            self._own.drop()
        if self.signal is not None and mine:
            self.signal.close()
