"""Claim forms and the lease keeper.

A claim takes a batch of ready rows in one round trip. In the lease form a row
is this process's while its ``locked_until`` lies ahead and its ``attempt``
still equals the value the claim set: that pair is the fencing token every
later statement on the row repeats, so a holder whose lease lapsed (and whose
row was claimed again elsewhere) can neither extend nor settle it.

The :class:`LeaseKeeper` is one thread per process and database. It extends the
lease of every row the process holds (buffered, prefetched, running, settling)
and performs settlements in batches: acks from any thread land in its queue and
one transaction settles all of them (group commit), which is what lets a
consumer go past one commit per message.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

from sqlalchemy import Connection, TextClause

from .dialects import ClaimedRow

if TYPE_CHECKING:
    from .broker import Broker, QueueTable

logger = logging.getLogger(__name__)


class Settlement(Enum):
    """What happens to a held row when it leaves this process."""

    COMPLETE = "complete"  # ack: delete, or mark processed
    RELEASE = "release"  # requeue in place; the delivery counted
    RELEASE_UNCOUNTED = "release_uncounted"  # never delivered: give the attempt back


@dataclass(frozen=True)
class Held:
    """A row this process holds: its queue table and fencing token."""

    table: QueueTable
    id: int
    attempt: int


class LeaseClaims:
    """The lease claim form: ``UPDATE ... SET locked_until, attempt + 1`` on a batch."""

    def __init__(self, broker: Broker) -> None:
        self.broker = broker

    def claim(self, table: QueueTable, limit: int) -> list[ClaimedRow]:
        """Lease up to ``limit`` rows and register them with the keeper before returning."""
        dialect = self.broker.dialect

        def work(conn: Connection) -> list[ClaimedRow]:
            return dialect.claim(conn, table.spec, limit, table.options.visibility_timeout)

        rows = self.broker.run(work)
        self.broker.keeper.hold(Held(table, row.id, row.attempt) for row in rows)
        return rows


class LeaseKeeper:
    """Extends leases of held rows and settles them in batches, on its own thread."""

    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        self._lock = threading.Lock()
        self._held: dict[QueueTable, dict[int, int]] = defaultdict(dict)
        self._pending: list[tuple[Settlement, Held]] = []
        self._wake = threading.Event()
        self._idle = threading.Condition(self._lock)
        self._stopped = False
        self._thread: threading.Thread | None = None
        self._next_extension = 0.0

    # -- called from consumer and pool threads ------------------------------
    def hold(self, rows: Iterable[Held]) -> None:
        with self._lock:
            for held in rows:
                self._held[held.table][held.id] = held.attempt
            self._ensure_thread()

    def settle(self, how: Settlement, held: Held) -> None:
        """Queue a settlement; the keeper thread runs it with whatever else is pending."""
        with self._lock:
            self._pending.append((how, held))
            self._ensure_thread()
        self._wake.set()

    def forget(self, held: Held) -> None:
        """Stop extending a row that left by another path (moved to a dead-letter queue)."""
        with self._lock:
            self._held[held.table].pop(held.id, None)

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued settlement has been written; False on timeout."""
        self._wake.set()
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._pending:
                if self._thread is None or not self._thread.is_alive():
                    self._lock.release()
                    try:
                        self._settle_pending()
                    finally:
                        self._lock.acquire()
                    continue
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._idle.wait(min(remaining, 0.5))
        return True

    def held_count(self) -> int:
        with self._lock:
            return sum(len(rows) for rows in self._held.values())

    def stop(self) -> None:
        self.flush()
        self._stopped = True
        self._wake.set()

    # -- the keeper thread --------------------------------------------------
    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._stopped = False
            self._thread = threading.Thread(
                target=self._run, name="sqlinbox-lease-keeper", daemon=True)
            self._thread.start()

    def _interval(self) -> float:
        """Extend at a third of the shortest lease held: two tries before any lease lapses."""
        with self._lock:
            leases = [t.options.visibility_timeout for t, rows in self._held.items() if rows]
        return min(leases) / 3 if leases else 1.0

    def _run(self) -> None:
        backoff = 0.0
        while not self._stopped:
            wait = max(0.0, self._next_extension - time.monotonic())
            self._wake.wait(max(wait, backoff))
            self._wake.clear()
            try:
                self._settle_pending()
                if time.monotonic() >= self._next_extension:
                    self._extend()
                    self._next_extension = time.monotonic() + self._interval()
                backoff = 0.0
            except Exception as exc:  # the database is away: keep everything, try again
                backoff = min(max(backoff * 2, 0.2), 5.0)
                logger.warning("sqlinbox lease keeper: %s; retrying in %.1fs", exc, backoff)

    def _settle_pending(self) -> None:
        with self._lock:
            batch, self._pending = self._pending, []
        if not batch:
            return
        grouped: dict[tuple[QueueTable, Settlement], dict[int, list[int]]] = defaultdict(
            lambda: defaultdict(list))
        for how, held in batch:
            grouped[(held.table, how)][held.attempt].append(held.id)
        dialect = self.broker.dialect

        def work(conn: Connection) -> int:
            touched = 0
            for (table, how), tokens in grouped.items():
                statement: TextClause = getattr(dialect.statements(table.spec), how.value)
                touched += dialect.settle(conn, statement, tokens)
            return touched

        try:
            touched = self.broker.run(work)
        except Exception:
            with self._lock:
                self._pending[:0] = batch
            raise
        if touched < len(batch):
            logger.warning(
                "sqlinbox: %d of %d settled rows were no longer held by this process "
                "(their lease lapsed and they were claimed again)", len(batch) - touched,
                len(batch))
        with self._lock:
            for _, held in batch:
                rows = self._held.get(held.table)
                if rows is not None and rows.get(held.id) == held.attempt:
                    del rows[held.id]
            self._idle.notify_all()

    def _extend(self) -> None:
        with self._lock:
            snapshot = {table: dict(rows) for table, rows in self._held.items() if rows}
        if not snapshot:
            return
        dialect = self.broker.dialect

        def work(conn: Connection) -> None:
            for table, rows in snapshot.items():
                tokens: dict[int, list[int]] = defaultdict(list)
                for row_id, attempt in rows.items():
                    tokens[attempt].append(row_id)
                kept = dialect.extend(conn, table.spec, tokens, table.options.visibility_timeout)
                if kept < len(rows):
                    logger.warning(
                        "sqlinbox: %d rows of queue %r lost their lease before it was extended",
                        len(rows) - kept, table.queue)

        self.broker.run(work)

