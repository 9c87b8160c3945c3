"""Throughput counts: how many rows each queue settled per minute, for the dashboard.

A consumer counts each row it acks (or its task's own transaction completes) in memory,
by queue and second of this process's monotonic clock: a dict entry under a lock,
nothing written on the consume path. A thread of the process adds the counts to the
throughput table every :data:`FLUSH_INTERVAL` seconds, and the broker once more as it
closes: one upsert per queue and minute into the rows of this process
(:mod:`.dialects.throughput`), so the workers never write the same row. The minutes are
the database's, as every time the project compares (:mod:`.clock`): the flush reads the
database's clock in its transaction and places each count that many seconds before it,
so a host clock minutes off neither files counts in the wrong minute nor prunes fresh
minutes (or keeps old ones). A flush that fails (the database down, the table dropped)
keeps its counts for the next one and logs one warning until a flush works again; counts
older than :data:`KEPT_MINUTES` are dropped, so a database that stays away costs a
bounded amount of memory. Every :data:`PRUNE_INTERVAL` seconds a process deletes the
minutes older than that in a flush's commit, a range of the table's primary key.

The ``count_throughput`` transport option turns counting off: nothing is counted, no
thread starts and the table is never touched.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import weakref
from collections import defaultdict

from sqlalchemy import Connection, inspect

from .database import Database
from .dialects import ThroughputStatements
from .options import TransportOptions

logger = logging.getLogger(__name__)

#: seconds between two flushes of a process's counts
FLUSH_INTERVAL = 15.0
#: minutes of counts kept: in memory while flushes fail, and in the table
KEPT_MINUTES = 120
#: seconds between two prunes of the table by one process
PRUNE_INTERVAL = 600.0
#: minutes the dashboard charts
HOUR = 60
#: how long closing waits for the flushing thread
STOP_LIMIT = 5.0

#: settled rows by (second of this process's monotonic clock, queue)
Counts = dict[tuple[int, str], int]


def second_now() -> int:
    """The second a row is counted in: this process's monotonic clock, which neither the
    host's clock stepping nor its being off moves."""
    return int(time.monotonic())


def minute_of(epoch: float) -> int:
    """A minute's number: epoch seconds over 60."""
    return int(epoch) // 60


class Throughput:
    """This process's settled rows per (minute, queue), added to the table by a thread."""

    def __init__(self, database: Database, options: TransportOptions,
                 interval: float = FLUSH_INTERVAL) -> None:
        self.database = database
        self.sql: ThroughputStatements = database.dialect.throughput_statements(
            options.table_prefix)
        self.create = options.create_tables
        self.enabled = options.count_throughput
        self.interval = interval
        self._lock = threading.Lock()
        self._begin()
        _COUNTERS.add(self)

    def _begin(self) -> None:
        """Fresh state: at start, and in a forked child (its parent writes its own)."""
        self._counts: Counts = defaultdict(int)
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()
        self._stopped = False
        self._ensured = False
        self._failing = False
        self._pruned = -PRUNE_INTERVAL  # the first flush prunes

    def count(self, queue: str) -> None:
        """One row of ``queue`` settled (any thread)."""
        if not self.enabled:
            return
        key = (second_now(), queue)
        with self._lock:
            self._counts[key] += 1
            if self._thread is None and not self._stopped:
                self._thread = threading.Thread(target=self._loop, daemon=True,
                                                name="sqlinbox-throughput")
                self._thread.start()

    def pending(self) -> int:
        """How many settled rows are counted and not written yet."""
        with self._lock:
            return sum(self._counts.values())

    def _loop(self) -> None:
        while not self._wake.wait(self.interval):
            self.flush()

    def flush(self) -> bool:
        """Add the counts so far to the table; False (counts kept) when that failed."""
        with self._lock:
            counts, self._counts = self._counts, defaultdict(int)
        if not counts:
            return True
        process = f"{socket.gethostname()}.{os.getpid()}"
        # every PRUNE_INTERVAL, the minutes older than KEPT_MINUTES go in the same commit
        prune = time.monotonic() - self._pruned >= PRUNE_INTERVAL

        def add(conn: Connection) -> None:
            now = float(conn.execute(self.sql.now).scalar_one())
            read_at = time.monotonic()
            minutes: Counts = defaultdict(int)
            for (second, queue), settled in counts.items():
                minutes[(minute_of(now - (read_at - second)), queue)] += settled
            conn.execute(self.sql.add, [
                {"minute": minute, "queue": queue, "process": process, "settled": settled}
                for (minute, queue), settled in sorted(minutes.items())])
            if prune:
                conn.execute(self.sql.prune, {"before": minute_of(now) - KEPT_MINUTES})

        try:
            if not self._ensured:  # at first, and after a failure: the table may be gone
                if not self.database.run(self._there, attempts=1, read_only=True):
                    self.database.ensure_table(self.sql.names[0], self.sql.ddl, self.create,
                                               self._missing)
                self._ensured = True
            self.database.run(add, attempts=1, durable=False)
        except Exception as exc:  # the worker goes on: the counts wait for the next flush
            self._keep(counts)
            self._ensured = False
            if not self._failing:
                logger.warning("sqlinbox: throughput counts of %d settled rows not written "
                               "(%s); kept for the next flush", sum(counts.values()), exc)
            self._failing = True
            return False
        if self._failing:
            logger.info("sqlinbox: throughput counts written again")
        self._failing = False
        if prune:
            self._pruned = time.monotonic()
        return True

    def _keep(self, counts: Counts) -> None:
        """Put back counts a flush could not write, but none older than KEPT_MINUTES."""
        oldest = second_now() - KEPT_MINUTES * 60
        with self._lock:
            for (second, queue), settled in counts.items():
                if second >= oldest:
                    self._counts[(second, queue)] += settled

    def _there(self, conn: Connection) -> bool:
        return inspect(conn).has_table(self.sql.names[0])

    def _missing(self) -> str:
        return (f"table {self.sql.names[0]!r} does not exist (create_tables is off): "
                "throughput is not counted; create it with:\n"
                + ";\n".join(self.sql.ddl) + ";")

    def stop(self, timeout: float = STOP_LIMIT) -> None:
        """Stop the thread and write what is counted (the broker closes)."""
        with self._lock:
            self._stopped = True
            thread = self._thread
        self._wake.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        self.flush()


def last_hour(database: Database, prefix: str, minutes: int = HOUR) -> dict[str, list[int]]:
    """Rows settled per queue in each of the last ``minutes`` minutes (oldest first, the
    database's current minute last), summed over the processes; a queue without any is
    absent, and so is everything when the table does not exist yet."""
    sql = database.dialect.throughput_statements(prefix)

    def read(conn: Connection) -> tuple[int, list[tuple[str, int, int]]]:
        now = minute_of(float(conn.execute(sql.now).scalar_one()))
        if not inspect(conn).has_table(sql.names[0]):
            return now, []
        return now, [(str(queue), int(minute), int(settled)) for queue, minute, settled
                     in conn.execute(sql.read, {"since": now - minutes + 1})]

    now, counted = database.run(read, read_only=True)
    since = now - minutes + 1
    found: dict[str, list[int]] = {}
    for queue, minute, settled in counted:
        if since <= minute <= now:
            found.setdefault(queue, [0] * minutes)[minute - since] += settled
    return found


#: every counter of this process, begun again in a forked child
_COUNTERS: weakref.WeakSet[Throughput] = weakref.WeakSet()


def _begin_after_fork() -> None:
    for counter in list(_COUNTERS):
        counter._lock = threading.Lock()
        counter._begin()


os.register_at_fork(after_in_child=_begin_after_fork)
