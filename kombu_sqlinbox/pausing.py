"""Paused queues: held in one table, so every worker honours a pause, and a restarted
worker too.

A consumer does not ask the database per claim: it keeps the set of paused queues and
reads it again when a wake-up says it changed (a NOTIFY on the table's channel, the
same-host signal's stamp, a LISTEN connection made anew), and, after a claim that took
rows (or before one of a queue it holds paused), when the set is older than
``pause_check_interval``. Rows a claim took of a queue found paused then go back. So
nothing is delivered once a wake-up told the consumer, and within ``pause_check_interval``
(plus the claim in flight) where it was missed or there is none (another host, on
MariaDB/MySQL).
"""

from __future__ import annotations

import getpass
import logging
import socket
import threading
import time
from dataclasses import dataclass

from sqlalchemy import Connection, inspect

from .database import Database
from .dialects import PauseStatements
from .errors import ConfigurationError, SchemaMismatch
from .tables import check_name
from .wakeups import Wakeup

logger = logging.getLogger(__name__)

#: the longest reason and "paused by" a pause keeps (characters)
REASON_LIMIT = 500
BY_LIMIT = 255


@dataclass(frozen=True)
class Paused:
    """A paused queue: who paused it (``by``), when (``at``, epoch seconds by the
    database's clock) and why."""

    queue: str
    reason: str | None
    by: str | None
    at: float


def operator() -> str:
    """Who pauses, when the caller does not say: ``user@host``."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no name for this uid (a container)
        user = "?"
    return f"{user}@{socket.gethostname()}"


class Pauses:
    """The paused queues of one table prefix, for this process: what its consumers honour
    (:meth:`paused`) and what the operations write (:meth:`pause`, :meth:`resume`)."""

    def __init__(self, database: Database, wakeup: Wakeup, prefix: str, create: bool,
                 interval: float) -> None:
        self.database = database
        self.dialect = database.dialect
        self.wakeup = wakeup
        self.sql: PauseStatements = self.dialect.pause_statements(prefix)
        self.create = create
        self.interval = interval
        #: the table's name, which is also its wake-up channel
        self.channel = self.sql.names[0]
        self._ready = False
        self._paused: frozenset[str] = frozenset()
        self._read_at = -float("inf")
        self._stale = True
        self._warned = False
        self._lock = threading.Lock()

    # -- what consumers honour -------------------------------------------------
    def changed(self) -> None:
        """A wake-up said the paused queues changed (any thread): read them again before
        the next claim, and wake this process's consumers (a resumed queue's rows wait)."""
        self._stale = True
        self.wakeup.poke()

    def consuming(self) -> None:
        """A consumer of this process claims from a queue table: be told when the paused
        queues change."""
        self.wakeup.watch(self.channel if self.dialect.notify else None, self.changed)

    def paused(self, queue: str) -> bool:
        """Before a claim: whether ``queue`` is paused, as last read; read again first
        when a wake-up said the paused queues changed, and, while ``queue`` is paused,
        when the read is ``pause_check_interval`` old (a resume nobody was told of).
        Nothing is read for a queue taken to be free: an idle consumer's empty claims
        cost no more; the claim that takes rows looks (:meth:`paused_after_claim`)."""
        if self._stale or (queue in self._paused and self._old()):
            self._refresh()
        return queue in self._paused

    def paused_after_claim(self, queue: str) -> bool:
        """After a claim took rows of ``queue``: whether they must go back, the queue
        paused as the wake-ups that arrived meanwhile tell (no round trip), or, where
        none did, as read again when the last read is ``pause_check_interval`` old."""
        self.wakeup.check()
        if self._stale or self._old():
            self._refresh()
        return queue in self._paused

    def _old(self) -> bool:
        return time.monotonic() - self._read_at >= self.interval

    def seen_paused(self, queue: str) -> bool:
        """Whether ``queue`` was paused when last read (no look at the database, nor at the
        wake-ups: for each row about to go out)."""
        return queue in self._paused

    def _refresh(self) -> None:
        with self._lock:
            # a change told from now on is read next time; a read that fails is tried again
            self._stale, self._read_at = False, -float("inf")
            started = time.monotonic()
            found: list[str] = []
            if self._usable():
                found = self.database.run(
                    lambda conn: [row[0] for row in conn.execute(self.sql.listed)],
                    read_only=True)
            self._paused, self._read_at = frozenset(found), started

    def _usable(self) -> bool:
        """Whether the table is there (created where the transport creates tables; else
        looked for at each read until found). Without it nothing is paused, and consumers
        say so once: an installation that predates pausing and creates no tables."""
        try:
            self.ensure()
        except SchemaMismatch as exc:
            if not self._warned:
                self._warned = True
                logger.warning("sqlinbox: %s", exc)
            return False
        return True

    def missing(self) -> str:
        return (f"table {self.channel!r} does not exist (create_tables is off): queues "
                f"cannot be paused; create it with:\n{';'.join(self.sql.ddl)};")

    def ensure(self) -> None:
        """The table, created where the transport creates tables, else required."""
        if not self._ready:
            self.database.ensure_table(self.channel, self.sql.ddl, self.create, self.missing)
            self._ready = True

    # -- what the operations write ------------------------------------------------
    def records(self, conn: Connection | None = None) -> list[Paused]:
        """Every paused queue, by name (in ``conn``'s transaction when given)."""
        def read(conn: Connection) -> list[Paused]:
            if not self._ready and not inspect(conn).has_table(self.channel):
                return []
            return [Paused(row[0], row[1], row[2], float(row[3]))
                    for row in conn.execute(self.sql.listed)]

        return read(conn) if conn is not None else self.database.run(read, read_only=True)

    def pause(self, queue: str, reason: str | None = None,
              by: str | None = None) -> tuple[Paused, bool]:
        """Pause ``queue``: the record kept, and whether this call paused it (False: it
        was paused already, and keeps its first record). Every consumer is told at the
        commit."""
        check_name(queue)
        by = operator() if by is None else by
        for value, what, limit in ((reason, "reason", REASON_LIMIT),
                                   (by, "paused by", BY_LIMIT)):
            if value is not None and len(value) > limit:
                raise ConfigurationError(f"the {what} is {len(value)} characters long; at "
                                         f"most {limit} are kept")
        self.ensure()

        def write(conn: Connection) -> tuple[Paused, bool]:
            made = conn.execute(self.sql.pause, {"name": queue, "reason": reason,
                                                 "paused_by": by}).rowcount
            self.dialect.notify_channel(conn, self.channel)
            kept = next(found for found in self.records(conn) if found.queue == queue)
            return kept, made == 1

        done = self.database.run(write)
        self._told()
        return done

    def resume(self, queue: str) -> bool:
        """Resume ``queue``; False when it was not paused. Its consumers are woken at the
        commit."""
        self.ensure()

        def write(conn: Connection) -> bool:
            gone = conn.execute(self.sql.resume, {"name": queue}).rowcount
            self.dialect.notify_channel(conn, self.channel)
            return bool(gone)

        done = self.database.run(write)
        self._told()
        return done

    def _told(self) -> None:
        """After a commit: the consumers of this host that the same-host signal reaches,
        and this process's own."""
        self._stale = True
        if self.wakeup.signal is not None:
            self.wakeup.signal.mark()
            self.wakeup.signal.send()
