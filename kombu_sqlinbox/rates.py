"""Global rate limits: a queue's ``rate_limit`` holds across every worker, not per process
as Celery's own ``rate_limit`` does.

Time is cut into windows of about :data:`WINDOW` seconds by the database's clock (this
process's clock plus an offset read from the database every :data:`CLOCK_REFRESH`
seconds), each holding the limit's share of claims (at least one: ``10/m`` has a window of
6 s). A window's budget is split into shards, one row each of the rate budget's table, so
claimers spread over several rows rather than queue on one. Before a claim, a consumer
takes tokens from a random shard by a conditional UPDATE in a short transaction of its
own (nothing is held while the claim runs); when that shard has too few, one more
transaction reads the window's shards and takes what is left, shard by shard in order (so
two claimers never wait on each other's rows in opposite orders). The claim then takes at
most as many rows as it got tokens.

Tokens a claim did not use (it found fewer ready rows) go back to their shards while their
window lasts, so a queue fed slowly still gets its whole rate. Tokens taken by a claim that
failed are lost: the window runs below its limit, never above it. A consumer that found
the window spent claims nothing (and asks nothing of the database) until the next window
begins, and its idle wait ends then (:meth:`RateLimits.idle_wait`).

Queues without a rate limit never come here: their claims and statements are unchanged.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from sqlalchemy import Connection

from .database import Database
from .dialects import RateStatements
from .options import Rate
from .rows import ClaimedRow, QueueTable

#: a claim of up to ``limit`` rows of a table, passing over the keys in ``skip``
Claim = Callable[[QueueTable, int, Sequence[Any]], list[ClaimedRow]]

#: the window's length aimed at (seconds): short, so a burst at a window's start stays
#: small against any longer span; long enough to hold a few claims' worth
WINDOW = 0.2
#: at most this many shards per window (each holds at least two tokens)
MAX_SHARDS = 8
#: the windows before one whose number is a multiple of this are deleted by the claim
#: that makes its first row
PRUNE_EVERY = 16
#: seconds between two reads of the database's clock
CLOCK_REFRESH = 30.0


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
    """Tokens taken from one window: ``(shard, count)`` parts; whether a row was made."""

    window: int
    parts: list[tuple[int, int]] = field(default_factory=list)
    opened: bool = False

    @property
    def total(self) -> int:
        return sum(count for _, count in self.parts)


class RateLimits:
    """The rate-limited queues' budget in the database of one table prefix, for this
    process's consumers."""

    def __init__(self, database: Database, prefix: str, create: bool) -> None:
        self.database = database
        self.sql: RateStatements = database.dialect.rate_statements(prefix)
        self.create = create
        self.table = self.sql.names[0]
        self._ready = False
        #: the database's clock less this process's (seconds), and when it was read
        self._offset = 0.0
        self._offset_read = -float("inf")
        #: queue -> when (monotonic) the window this process found spent ends
        self._spent: dict[str, float] = {}
        self._lock = threading.Lock()

    # -- a claim ------------------------------------------------------------------
    def claim(self, table: QueueTable, limit: int, skip: Sequence[Any],
              claim: Claim) -> list[ClaimedRow]:
        """Claim (with ``claim``: the queue's form, or its concurrency limits') at most as
        many rows of ``table`` as its budget gives tokens now (none while its window is
        spent); give back the tokens the claim did not use."""
        rate = table.options.rate_limit
        assert rate is not None
        taken = self.take(table.queue, Budget.of(rate), limit)
        if not taken.total:
            return []
        rows = claim(table, taken.total, skip)
        if len(rows) < taken.total:
            self.give_back(table.queue, Budget.of(rate), taken, taken.total - len(rows))
        return rows

    def take(self, queue: str, budget: Budget, want: int) -> Taken:
        """Up to ``want`` tokens of the current window; none, without a round trip, while
        the window this process found spent lasts."""
        if self._spent.get(queue, 0.0) > time.monotonic():
            return Taken(-1)
        self.ensure()
        now = self.now()
        window = int(now // budget.width)
        first = random.randrange(budget.shards)
        taken = self.database.run(partial(self._first, queue, budget, window, first, want),
                                  durable=False, repeatable=True)
        if taken.total < want:
            more = self.database.run(
                partial(self._rest, queue, budget, window, want - taken.total),
                durable=False, repeatable=True)
            taken.parts += more.parts
            taken.opened |= more.opened
        if taken.total < want:  # every shard is spent: wait for the next window
            self._spent[queue] = time.monotonic() + (window + 1) * budget.width - now
        if taken.opened and window % PRUNE_EVERY == 0:
            self.database.run(lambda conn: conn.execute(
                self.sql.prune, {"name": queue, "window": window}), durable=False)
        return taken

    def _grab(self, conn: Connection, queue: str, budget: Budget, shard: int, count: int,
              made: bool | None, taken: Taken) -> None:
        """Take ``count`` tokens of ``shard``: from its row (``made``: whether it is there,
        None when not known), else by making it."""
        params = {"name": queue, "window": taken.window, "shard": shard, "k": count,
                  "share": budget.share(shard)}
        if made is not False and conn.execute(self.sql.take, params).rowcount:
            taken.parts.append((shard, count))
        elif made is not True and conn.execute(self.sql.open, params).rowcount:
            taken.parts.append((shard, count))
            taken.opened = True

    def _first(self, queue: str, budget: Budget, window: int, shard: int, want: int,
               conn: Connection) -> Taken:
        """One shard, chosen at random by the caller: the common case, one statement."""
        taken = Taken(window)
        self._grab(conn, queue, budget, shard, min(want, budget.share(shard)), None, taken)
        return taken

    def _rest(self, queue: str, budget: Budget, window: int, want: int,
              conn: Connection) -> Taken:
        """What the window's shards have left, shard by shard in order, up to ``want``."""
        taken = Taken(window)
        used: dict[int, int] = {int(shard): int(count) for shard, count in conn.execute(
            self.sql.shards, {"name": queue, "window": window})}
        for shard in range(budget.shards):
            count = min(want - taken.total, budget.share(shard) - used.get(shard, 0))
            if count > 0:
                self._grab(conn, queue, budget, shard, count, shard in used, taken)
        return taken

    def give_back(self, queue: str, budget: Budget, taken: Taken, unused: int) -> None:
        """Return ``unused`` tokens to the shards they came from, shard by shard in order,
        while their window lasts (after it, they would buy nothing)."""
        if int(self.now() // budget.width) != taken.window:
            return
        self._spent.pop(queue, None)

        def work(conn: Connection) -> None:
            left = unused
            for shard, count in sorted(taken.parts):
                back = min(left, count)
                if back > 0:
                    conn.execute(self.sql.give_back, {"name": queue, "window": taken.window,
                                                      "shard": shard, "k": back})
                left -= back

        self.database.run(work, durable=False)

    # -- waiting --------------------------------------------------------------------
    def idle_wait(self, wait: float, ceiling: float) -> float:
        """An idle consumer's next wait: ``wait``, or, while a queue's window is spent, until
        the next begins (at most ``ceiling``): claiming sooner would find it spent."""
        if not self._spent:
            return wait
        now = time.monotonic()
        ends = [end - now for end in list(self._spent.values()) if end > now]
        return min(max(wait, min(ends)), ceiling) if ends else wait

    def now(self) -> float:
        """The database's clock (epoch seconds), from this process's and the offset."""
        if time.monotonic() - self._offset_read >= CLOCK_REFRESH:
            with self._lock:
                before = time.time()
                database = float(self.database.run(
                    lambda conn: conn.execute(self.sql.now).scalar_one(), read_only=True))
                after = time.time()
                self._offset, self._offset_read = database - (before + after) / 2, \
                    time.monotonic()
        return time.time() + self._offset

    # -- the table ------------------------------------------------------------------
    def missing(self) -> str:
        return (f"table {self.table!r} does not exist (create_tables is off): a queue's "
                f"rate_limit cannot be kept; create it with:\n{';'.join(self.sql.ddl)};")

    def ensure(self) -> None:
        """The table, created where the transport creates tables, else required."""
        if not self._ready:
            self.database.ensure_table(self.table, self.sql.ddl, self.create, self.missing)
            self._ready = True
