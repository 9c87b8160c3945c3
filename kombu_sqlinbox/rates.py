"""Global rate limits: a queue's ``rate_limit`` holds across every worker, not per process
as Celery's own ``rate_limit`` does (a task's, within a queue: :mod:`.task_rates`).

Time is cut into windows of about :data:`WINDOW` seconds by the database's clock (read
once, then carried on by this process's monotonic clock: see :meth:`RateLimits.now`; a
take counts only while the database's own clock is inside its window), each holding
the limit's share of claims (at least one: ``10/m`` has a window of 6 s). A window's
budget is split into shards, one row each of the rate budget's table, so claimers
spread over several rows rather than queue on one. Before a claim, a consumer takes
tokens from a random shard by a conditional UPDATE in a short transaction of its own
(nothing is held while the claim runs); when that shard has too few, one more
transaction reads the window's shards and takes what is left, shard by shard in order (so
two claimers never wait on each other's rows in opposite orders). The claim then takes at
most as many rows as it got tokens.

Tokens a claim did not use (it found fewer ready rows) go back to their shards while their
window lasts, so a queue fed slowly still gets its whole rate. Tokens taken by a claim that
failed, or whose give-back failed, are lost: the window runs below its limit, never above
it. A consumer that found the window spent claims nothing (and asks the database nothing)
until the next window begins, and its idle wait ends then (:meth:`RateLimits.idle_wait`).
After a claim that took nothing, the next one first reads whether any row is ready: an
idle limited queue costs that one read per poll, and no budget statement.

Queues without a rate limit never come here: their claims and statements are unchanged.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

from sqlalchemy import Connection
from sqlalchemy.exc import DBAPIError

from .database import Database
from .dialects import RateStatements
from .options import QueueOptions, Rate
from .rows import ClaimedRow, QueueTable

logger = logging.getLogger(__name__)

#: the window's length aimed at (seconds): short, so a burst at a window's start stays
#: small against any longer span; long enough to hold a few claims' worth
WINDOW = 0.2
#: at most this many shards per window (each holds at least two tokens)
MAX_SHARDS = 8
#: the windows before one whose number is a multiple of this are pruned after the claim
#: that made its first row
PRUNE_EVERY = 16
#: at most this many rows deleted by one prune (a later one deletes the rest)
PRUNE_ROWS = 500
#: seconds between two reads of the database's clock
CLOCK_REFRESH = 30.0

#: per task name seen ready (None: a row naming none), how many rows a claim may take
Demand = Mapping[str | None, int]


class Claimer(Protocol):
    """What claims a rate-limited queue's rows once it has tokens: its claim form, or its
    concurrency limits' :class:`~.limits.Limiter`."""

    def claim(self, table: QueueTable, limit: int,
              skip: Sequence[Any] = ()) -> list[ClaimedRow]: ...


@dataclass(frozen=True)
class Budget:
    """How a rate is cut: windows of ``width`` seconds holding ``tokens`` claims, spread
    over ``shards`` rows."""

    width: float
    tokens: int
    shards: int

    @classmethod
    def of(cls, rate: Rate) -> Budget:
        tokens = max(1, round(rate.per_second * WINDOW))
        return cls(tokens / rate.per_second, tokens, max(1, min(MAX_SHARDS, tokens // 2)))

    def share(self, shard: int) -> int:
        """The tokens of one shard (the first ones hold the remainder)."""
        return self.tokens // self.shards + (shard < self.tokens % self.shards)


@dataclass
class Taken:
    """Tokens taken from one window: ``(shard, count)`` parts; whether a prune is due."""

    window: int
    parts: list[tuple[int, int]] = field(default_factory=list)
    #: whether the take (any of its attempts) made the first row of a window whose number
    #: is a multiple of :data:`PRUNE_EVERY`
    prune: bool = False
    #: the database's clock, when it was found outside the window
    current: float | None = None

    @property
    def total(self) -> int:
        return sum(count for _, count in self.parts)


def rated(options: QueueOptions) -> bool:
    return options.rate_limit is not None or bool(options.task_rate_limits)


class RateLimits:
    """The rate-limited queues' budget in the database of one table prefix, for this
    process's consumers."""

    def __init__(self, database: Database, prefix: str, create: bool) -> None:
        self.database = database
        self.dialect = database.dialect
        self.sql: RateStatements = database.dialect.rate_statements(prefix)
        self.create = create
        self.table = self.sql.names[0]
        self._ready = False
        #: the database's clock (epoch seconds) when last read, this process's monotonic
        #: clock then, and the latest time given out (never less)
        self._base = 0.0
        self._read_at = -float("inf")
        self._latest = -float("inf")
        #: budget -> when (monotonic) the window this process found spent ends
        self._spent: dict[str, float] = {}
        #: tables whose last claim took rows: the next claims without a read first
        self._busy: set[QueueTable] = set()
        self._lock = threading.Lock()

    # -- a claim ------------------------------------------------------------------
    def applies(self, table: QueueTable) -> bool:
        """Whether ``table``'s claims go through :meth:`claim`: a rate limit of its own or
        of its tasks; never a transient queue (replies, remote control), whatever every
        queue's defaults say."""
        return not table.transient and rated(table.options)

    def claim(self, table: QueueTable, limit: int, skip: Sequence[Any],
              claims: Claimer) -> list[ClaimedRow]:
        """Claim (with ``claims``: the queue's form, or its concurrency limits') at most as
        many rows of ``table`` as its budget gives tokens now (none while its window is
        spent); give back the tokens the claim did not use."""
        rate = table.options.rate_limit
        if rate is not None and self.spent(table.queue):
            return []
        demand = self.ready(table, limit)
        if not demand:
            return []
        want = min(limit, sum(demand.values()))
        if rate is None:
            return self.claim_ready(table, want, skip, claims, demand)
        budget = Budget.of(rate)
        taken = self.take(table.queue, budget, want)
        if not taken.total:
            return []
        rows = self.claim_ready(table, taken.total, skip, claims, demand)
        self.finish(table.queue, budget, taken, len(rows))
        return rows

    def ready(self, table: QueueTable, limit: int) -> Demand:
        """What may be claimed: up to ``limit`` rows, or nothing when, after a claim that
        took nothing, one read finds no ready row (a row ready from now on is found by
        the next poll)."""
        if table in self._busy:
            return {None: limit}
        reads = self.dialect.rated_reads(table.spec)

        def read(conn: Connection) -> bool:
            return conn.execute(reads.ready, {"limit": 1, "floor": self.dialect.claim_floor(
                conn, table.spec)}).first() is not None

        return {None: limit} if self.database.run(read, read_only=True) else {}

    def claim_ready(self, table: QueueTable, limit: int, skip: Sequence[Any],
                    claims: Claimer, demand: Demand) -> list[ClaimedRow]:
        """The claim of up to ``limit`` rows, within the tokens taken."""
        rows = claims.claim(table, limit, skip)
        self.claimed(table, rows)
        return rows

    def claimed(self, table: QueueTable, rows: Sequence[ClaimedRow]) -> None:
        if rows:
            self._busy.add(table)
        else:
            self._busy.discard(table)

    def take(self, name: str, budget: Budget, want: int) -> Taken:
        """Up to ``want`` tokens of the current window of budget ``name``; none, without a
        round trip, while the window this process found spent lasts. A window that the
        database's clock has left (or not reached) gives none: the clock is read again
        and the take tried once more, in the window that is current."""
        if self.spent(name):
            return Taken(-1)
        self.ensure()
        prune = False
        for _ in range(2):
            now = self.now()
            window = int(now // budget.width)
            first = random.randrange(budget.shards)
            taken = self.database.run(
                partial(self._first, name, budget, window, first, want),
                durable=False, repeatable=True)
            taken.prune |= prune  # a row an attempt before made is due its prune too
            if taken.total < want:
                more = self.database.run(
                    partial(self._rest, name, budget, window, want - taken.total),
                    durable=False, repeatable=True)
                taken.parts += more.parts
                taken.prune |= more.prune
                if more.current is not None:
                    self.reset_clock(more.current)
                    if not taken.total:
                        prune = taken.prune
                        continue
            if taken.total < want:  # every shard is spent: wait for the next window
                self._spent[name] = time.monotonic() + (window + 1) * budget.width - now
            return taken
        return taken

    def spent(self, name: str) -> bool:
        """Whether this process found the window of budget ``name`` spent, and it lasts."""
        return self._spent.get(name, 0.0) > time.monotonic()

    def finish(self, name: str, budget: Budget, taken: Taken, used: int) -> None:
        """After a claim: give back the tokens it did not use, and prune the old windows
        when its take made the first row of every :data:`PRUNE_EVERY` th window (the
        windows before the one it took from: at least those before the one it made). Neither
        fails the claim: the rows it took are delivered, and a failure lets the tokens go
        (the window runs below its limit) or leaves the old rows to the next prune."""
        try:
            if used < taken.total:
                self.give_back(name, budget, taken, taken.total - used)
            if taken.prune:
                self.prune(name, taken.window)
        except DBAPIError as exc:
            logger.warning("sqlinbox: rate budget %r: giving back or pruning failed (%s); "
                           "its unused tokens are let go", name, exc.orig)

    def _grab(self, conn: Connection, name: str, budget: Budget, shard: int, count: int,
              made: bool | None, taken: Taken) -> None:
        """Take ``count`` tokens of ``shard``: from its row (``made``: whether it is there,
        None when not known), else by making it."""
        params = {"name": name, "window": taken.window, "shard": shard, "k": count,
                  "share": budget.share(shard), "start": taken.window * budget.width,
                  "end": (taken.window + 1) * budget.width}
        if made is not False and conn.execute(self.sql.take, params).rowcount:
            taken.parts.append((shard, count))
        elif made is not True and conn.execute(self.sql.open, params).rowcount:
            taken.prune |= taken.window % PRUNE_EVERY == 0
            # counted only while the window lasts: the open may have waited for a
            # rival's row of that shard, past the window's end, before that rolled back
            if int(self.clock(conn) // budget.width) == taken.window:
                taken.parts.append((shard, count))

    def clock(self, conn: Connection) -> float:
        """The database's clock as the statement runs (epoch seconds)."""
        return float(conn.execute(self.sql.now).scalar_one())

    def _first(self, name: str, budget: Budget, window: int, shard: int, want: int,
               conn: Connection) -> Taken:
        """One shard, chosen at random by the caller: the common case, one statement."""
        taken = Taken(window)
        self._grab(conn, name, budget, shard, min(want, budget.share(shard)), None, taken)
        return taken

    def _rest(self, name: str, budget: Budget, window: int, want: int,
              conn: Connection) -> Taken:
        """What the window's shards have left, shard by shard in order, up to ``want``;
        nothing, and the database's clock, when that is outside the window."""
        taken = Taken(window)
        current = self.clock(conn)
        if int(current // budget.width) != window:
            taken.current = current
            return taken
        used: dict[int, int] = {int(shard): int(count) for shard, count in conn.execute(
            self.sql.shards, {"name": name, "window": window})}
        for shard in range(budget.shards):
            count = min(want - taken.total, budget.share(shard) - used.get(shard, 0))
            if count > 0:
                self._grab(conn, name, budget, shard, count, shard in used, taken)
        return taken

    def give_back(self, name: str, budget: Budget, taken: Taken, unused: int) -> None:
        """Return ``unused`` tokens to the shards they came from, shard by shard in order,
        while their window lasts (after it, they would buy nothing). Run once: after a
        commit whose reply was lost it may have landed, and twice would give more than
        was taken."""
        if int(self.now() // budget.width) != taken.window:
            return
        self._spent.pop(name, None)

        def work(conn: Connection) -> None:
            left = unused
            for shard, count in sorted(taken.parts):
                back = min(left, count)
                if back > 0:
                    conn.execute(self.sql.give_back, {"name": name, "window": taken.window,
                                                      "shard": shard, "k": back})
                left -= back

        self.database.run(work, durable=False)

    def prune(self, name: str, window: int) -> int:
        """Delete at most :data:`PRUNE_ROWS` rows of the windows of ``name`` before
        ``window``; how many went. Repeatable (run again after a lost commit reply, it
        finds what is left), and prunes at once pass over each other's rows where the
        database can skip locked rows."""
        return int(self.database.run(lambda conn: conn.execute(self.sql.prune, {
            "name": name, "window": window, "limit": PRUNE_ROWS}).rowcount,
            durable=False, repeatable=True))

    # -- waiting --------------------------------------------------------------------
    def idle_wait(self, wait: float, ceiling: float) -> float:
        """An idle consumer's next wait: ``wait``, or, while a budget's window is spent,
        until the next begins (at most ``ceiling``): claiming sooner would find it spent."""
        if not self._spent:
            return wait
        now = time.monotonic()
        ends = [end - now for end in list(self._spent.values()) if end > now]
        return min(max(wait, min(ends)), ceiling) if ends else wait

    def now(self) -> float:
        """The database's clock (epoch seconds): read every :data:`CLOCK_REFRESH` seconds
        and carried on by this process's monotonic clock in between, never going back (a
        host clock stepped back, a reading behind the last estimate) but to the
        database's own reading (:meth:`reset_clock`). Only an estimate: a take counts
        only while the database's clock is inside its window."""
        with self._lock:
            if time.monotonic() - self._read_at >= CLOCK_REFRESH:
                before = time.monotonic()
                database = self.database.run(self.clock, read_only=True)
                self._base, self._read_at = database, (before + time.monotonic()) / 2
            self._latest = max(self._latest, self._base + time.monotonic() - self._read_at)
            return self._latest

    def reset_clock(self, database: float) -> None:
        """Carry on from ``database``, the database's clock just read: this process's
        estimate had drifted out of the window the database is in (a slow first reading,
        a process paused)."""
        with self._lock:
            self._base, self._read_at = database, time.monotonic()
            self._latest = database

    # -- the table ------------------------------------------------------------------
    def missing(self) -> str:
        return (f"table {self.table!r} does not exist (create_tables is off): a queue's "
                f"rate_limit cannot be kept; create it with:\n{';'.join(self.sql.ddl)};")

    def ensure(self) -> None:
        """The table, created where the transport creates tables, else required."""
        if not self._ready:
            self.database.ensure_table(self.table, self.sql.ddl, self.create, self.missing)
            self._ready = True
