"""Claim forms, the lease keeper and the wake-up.

A claim takes a batch of ready rows in one round trip and bumps their
``attempt``. The attempt is the fencing token: every later statement on a held
row repeats it, so a holder whose row was claimed again elsewhere (its lease
lapsed) can neither extend nor settle it.

* :class:`LeaseClaims` — ``locked_until`` marks the row in work; the
  :class:`LeaseKeeper` (one thread per process and database) extends the lease
  of every held row and settles rows in batches: acks from any thread land in
  its queue and one transaction settles all of them (group commit).
* :class:`RowLockClaims` — the row stays locked by an open transaction on a
  connection of its own until it settles; a crash frees it at once.
* :class:`AdvisoryClaims` — a lease plus a session-level advisory lock on the
  row's key (partition key, else id), so rows of one key go into work one at a
  time across every process on the server.

:class:`Wakeup` replaces the polling sleep: it returns early on a PostgreSQL
NOTIFY for a consumed table or an in-process poke (a local publish, a
partition key freed).
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import threading
import time
import zlib
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, TypeVar

from sqlalchemy import Connection
from sqlalchemy.exc import DBAPIError

from .dialects import ClaimedRow
from .errors import ConfigurationError
from .tables import Role

if TYPE_CHECKING:
    from .broker import Broker, QueueTable

logger = logging.getLogger(__name__)
T = TypeVar("T")


class Settlement(Enum):
    """What happens to a held row when it leaves this process (the statement's name)."""

    COMPLETE = "complete"  # ack: delete, or mark processed
    RELEASE = "release"  # requeue in place; the delivery counted
    RELEASE_UNCOUNTED = "release_uncounted"  # never delivered: give the attempt back
    RETRY = "retry"  # in place, hidden for a delay


@dataclass(frozen=True)
class Held:
    """A row this process holds: its queue table and fencing token (plus its key)."""

    table: QueueTable
    id: int
    attempt: int
    key: str | None = None


class ClaimForm:
    """How a queue's rows are taken into work and given back."""

    name = ""

    def __init__(self, broker: Broker) -> None:
        self.broker = broker

    def check(self, queue: str) -> None:
        """Refuse at start-up what this database cannot do."""

    def capacity(self) -> int | None:
        """How many more rows this form may hold now (None: no limit of its own)."""
        return None

    def claim(self, table: QueueTable, limit: int, skip: Sequence[Any] = ()) -> list[ClaimedRow]:
        """Take up to ``limit`` ready rows, passing over rows of the partition keys in
        ``skip`` (keys the consumer has in work: their rows would only wait in its buffer)."""
        raise NotImplementedError

    def held_for(self, table: QueueTable, row: ClaimedRow) -> Held:
        """How this form remembers a row it claimed."""
        return Held(table, row.id, row.attempt)

    def settle(self, how: Settlement, held: Held, delay: float = 0.0) -> None:
        raise NotImplementedError

    def run_held(self, held: Held, work: Callable[[Connection], T]) -> T:
        """Run ``work`` in the transaction that may change the held row, and let go of it."""
        raise NotImplementedError

    def settled(self, rows: Iterable[Held]) -> None:
        """Called by the keeper once a batch of this form's settlements committed."""

    def refuse_without_locks(self, queue: str) -> None:
        if not self.broker.dialect.lock_clause:
            raise ConfigurationError(
                f"queue {queue!r}: claim={self.name!r} needs row or advisory locks, which "
                f"{self.broker.engine.dialect.name} does not have; use claim='lease'"
            )


class LeaseClaims(ClaimForm):
    """The lease form: ``UPDATE ... SET locked_until, attempt + 1`` on a batch."""

    name = "lease"

    def claim(self, table: QueueTable, limit: int, skip: Sequence[Any] = ()) -> list[ClaimedRow]:
        """Lease up to ``limit`` rows and register them with the keeper before returning."""
        dialect = self.broker.dialect
        lease = table.options.visibility_timeout
        # a claim repeated after a lost commit reply takes other rows; the rows of the
        # first come back after one lease, their attempt counted, as after a crash
        rows = self.broker.run(
            lambda conn: dialect.claim(conn, table.spec, limit, lease, skip=skip),
            durable=False, repeatable=True)
        self.broker.keeper.hold(self.held_for(table, row) for row in rows)
        return rows

    def settle(self, how: Settlement, held: Held, delay: float = 0.0) -> None:
        self.broker.keeper.settle(how, held, delay)

    def run_held(self, held: Held, work: Callable[[Connection], T]) -> T:
        # work on a held row is fenced: run again after its commit landed, it finds nothing
        result = self.broker.run(work, repeatable=True)
        self.broker.keeper.forget(held)
        return result


class RowLockClaims(ClaimForm):
    """The row-lock form: a connection and an open transaction per row in work.

    The attempt is bumped and committed first (so crashes count), then the row is
    locked ``FOR UPDATE SKIP LOCKED`` by id and attempt on a connection kept until
    the row settles.
    """

    name = "row_lock"
    #: connections of the pool kept free for publishes, the keeper and the tasks' own
    #: queries
    reserved_connections = 3

    def __init__(self, broker: Broker) -> None:
        super().__init__(broker)
        self._open: dict[tuple[int, int], Connection] = {}
        self._lock = threading.Lock()

    def check(self, queue: str) -> None:
        self.refuse_without_locks(queue)

    def capacity(self) -> int:
        pool = self.broker.engine.pool
        size = int(getattr(pool, "size", lambda: 5)()) + max(
            int(getattr(pool, "_max_overflow", 0)), 0)
        with self._lock:
            return max(size - self.reserved_connections - len(self._open), 0)

    def claim(self, table: QueueTable, limit: int, skip: Sequence[Any] = ()) -> list[ClaimedRow]:
        dialect = self.broker.dialect
        limit = min(limit, self.capacity())
        if limit <= 0:
            return []
        counted = self.broker.run(
            lambda conn: dialect.claim(conn, table.spec, limit, 0.0, skip=skip))
        taken = []
        lock_row = dialect.statements(table.spec).lock_row
        for row in counted:
            conn = self.broker.engine.connect()
            try:
                conn.begin()
                locked = conn.execute(lock_row, {"id": row.id, "attempt": row.attempt}).first()
            except Exception:
                conn.close()
                raise
            if locked is None:  # taken by another claimer between the two steps
                conn.close()
                continue
            with self._lock:
                self._open[(id(table), row.id)] = conn
            taken.append(row)
        return taken

    def _take(self, held: Held) -> Connection:
        with self._lock:
            return self._open.pop((id(held.table), held.id))

    def settle(self, how: Settlement, held: Held, delay: float = 0.0) -> None:
        conn = self._take(held)
        try:
            if how is not Settlement.RELEASE:  # a release is the rollback below
                statement = getattr(self.broker.dialect.statements(held.table.spec), how.value)
                self.broker.dialect.settle(
                    conn, statement, {held.attempt: [held.id]}, {"delay": delay})
                conn.commit()
        finally:
            conn.close()

    def run_held(self, held: Held, work: Callable[[Connection], T]) -> T:
        conn = self._take(held)
        try:
            result = work(conn)
            conn.commit()
            return result
        finally:
            conn.close()


class AdvisoryClaims(LeaseClaims):
    """Lease plus an advisory lock on the row's key, held on one connection per process.

    The server drops a session's locks when the session dies (a restart, a KILL). The
    form notices on its next use of the session, opens another, and takes back the
    keys of its rows in work; a key another process locked meanwhile is forgotten. Its
    row stays leased, and the key's later rows wait behind that row in the claim, so
    none of them runs before it or at the same time.
    """

    name = "advisory"
    #: candidate rows read per wanted row: keys already in work elsewhere are skipped
    overscan = 4

    def __init__(self, broker: Broker) -> None:
        super().__init__(broker)
        #: space -> key -> the id of the row in work here that holds it
        self._keys: dict[int, dict[str, int]] = defaultdict(dict)
        self._lock = threading.Lock()
        self._connection: Connection | None = None

    def check(self, queue: str) -> None:
        self.refuse_without_locks(queue)

    @staticmethod
    def space(table: QueueTable) -> int:
        """The advisory-lock namespace of a table (a signed 32-bit number)."""
        return zlib.crc32(table.spec.table.encode()) - 2**31

    @staticmethod
    def key_of(table: QueueTable, row: ClaimedRow) -> str:
        if table.spec.has(Role.PARTITION_KEY) and row.partition_key is not None:
            return f"k:{row.partition_key}"
        return f"id:{row.id}"

    def _locks(self) -> Connection:
        """The session that owns this process's advisory locks (autocommit; the caller
        holds ``_lock``). A new one, after one died, takes back the keys of rows in work."""
        if self._connection is None or self._connection.closed:
            session = self._connection = self.broker.engine.connect().execution_options(
                isolation_level="AUTOCOMMIT")
            self._take_back(session)  # failing, it leaves a session the next use drops
        return self._connection

    def _take_back(self, session: Connection) -> None:
        """Lock again, on a new session, the keys of rows still in work here; forget those
        another process took meanwhile (their rows stay leased)."""
        for space, mine in self._keys.items():
            keys = sorted(mine)
            if not keys:
                continue
            taken = self.broker.dialect.try_key_locks(session, space, keys)
            lost = [key for key, ok in zip(keys, taken, strict=True) if not ok]
            for key in lost:
                del mine[key]
            logger.warning(
                "sqlinbox: the advisory-lock session was lost; took back %d key locks of "
                "rows in work%s", len(keys) - len(lost),
                f", {len(lost)} were taken elsewhere meanwhile" if lost else "")

    def _drop_session(self) -> None:
        """The lock session failed: its locks are gone (or go now, with it)."""
        failed, self._connection = self._connection, None
        if failed is not None:
            failed.close()

    def _take(self, space: int, keys: list[str]) -> list[bool]:
        """Try the locks of ``keys`` without waiting (the caller holds ``_lock``)."""
        dialect = self.broker.dialect
        try:
            return dialect.try_key_locks(self._locks(), space, keys)
        except DBAPIError:
            self._drop_session()
        return dialect.try_key_locks(self._locks(), space, keys)

    def _give_back(self, space: int, keys: list[str]) -> None:
        """Release the locks of ``keys`` (the caller holds ``_lock``). When the session
        fails, they went with it; a new one takes back the others."""
        try:
            self.broker.dialect.release_key_locks(self._locks(), space, keys)
        except DBAPIError:
            self._drop_session()
            self._locks()

    def held_for(self, table: QueueTable, row: ClaimedRow) -> Held:
        return Held(table, row.id, row.attempt, self.key_of(table, row))

    def claim(self, table: QueueTable, limit: int, skip: Sequence[Any] = ()) -> list[ClaimedRow]:
        """Pick each free key's first unfinished row, lock the keys, lease those rows.

        Candidates are read without a lease, so a key locked elsewhere never has its
        first row leased here (which would let its next row overtake it). Keys in work
        here are passed over by their locks, ``skip`` among them. Keys locked for rows
        the claim did not get are released, whatever happened.
        """
        dialect = self.broker.dialect
        statements = dialect.statements(table.spec)
        space = self.space(table)
        with self._lock:
            mine = self._keys[space]
            candidates = self.broker.run(lambda conn: conn.execute(
                statements.candidates, {"limit": limit * self.overscan}).all(), read_only=True)
            firsts: dict[str, int] = {}
            for row_id, partition_key in candidates:
                key = f"k:{partition_key}" if partition_key is not None else f"id:{row_id}"
                if key not in mine and key not in firsts and len(firsts) < limit:
                    firsts[key] = row_id
            if not firsts:
                return []
            locked = [key for key, ok in zip(firsts, self._take(space, list(firsts)),
                                             strict=True) if ok]
            wanted = [firsts[key] for key in locked]
            lease = table.options.visibility_timeout
            rows: list[ClaimedRow] = []
            try:
                if wanted:
                    rows = self.broker.run(lambda conn: dialect.claim(
                        conn, table.spec, len(wanted), lease, ids=wanted), durable=False,
                        repeatable=True)
            finally:
                mine.update({self.key_of(table, row): row.id for row in rows})
                unused = [key for key in locked if key not in mine]
                if unused:
                    self._give_back(space, unused)
        self.broker.keeper.hold(self.held_for(table, row) for row in rows)
        return rows

    def settle(self, how: Settlement, held: Held, delay: float = 0.0) -> None:
        self.broker.keeper.settle(how, held, delay)

    def run_held(self, held: Held, work: Callable[[Connection], T]) -> T:
        result = super().run_held(held, work)
        self.settled([held])
        return result

    def settled(self, rows: Iterable[Held]) -> None:
        """Release the keys of settled rows: only those this process still holds for
        them (a forgotten key may be another process's now)."""
        with self._lock:
            by_space: dict[int, list[str]] = defaultdict(list)
            for held in rows:
                space = self.space(held.table)
                if held.key is not None and self._keys[space].get(held.key) == held.id:
                    del self._keys[space][held.key]
                    by_space[space].append(held.key)
            for space, keys in by_space.items():
                self._give_back(space, keys)


CLAIM_FORMS: dict[str, type[ClaimForm]] = {
    form.name: form for form in (LeaseClaims, RowLockClaims, AdvisoryClaims)
}


class LeaseKeeper:
    """Extends leases of held rows and settles them in batches, on its own thread."""

    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        self._lock = threading.Lock()
        self._held: dict[QueueTable, dict[int, int]] = defaultdict(dict)
        self._pending: list[tuple[Settlement, Held, float]] = []
        self._wake = threading.Event()
        self._idle = threading.Condition(self._lock)
        self._stopped = False
        self._thread: threading.Thread | None = None
        self._next_extension = 0.0

    # -- called from consumer and pool threads ------------------------------
    def hold(self, rows: Iterable[Held]) -> None:
        soonest: float | None = None
        with self._lock:
            for held in rows:
                self._held[held.table][held.id] = held.attempt
                due = time.monotonic() + held.table.options.visibility_timeout / 3
                soonest = due if soonest is None else min(soonest, due)
            self._ensure_thread()
            # a row with a shorter lease than those held so far must not wait for the
            # extension their longer interval scheduled
            early = soonest is not None and soonest < self._next_extension
            if soonest is not None and early:
                self._next_extension = soonest
        if early:
            self._wake.set()

    def settle(self, how: Settlement, held: Held, delay: float = 0.0) -> None:
        """Queue a settlement; the keeper thread runs it with whatever else is pending."""
        with self._lock:
            self._pending.append((how, held, delay))
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
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._ensure_thread()
                self._idle.wait(min(remaining, 0.5))
        return True

    def held_count(self) -> int:
        with self._lock:
            return sum(len(rows) for rows in self._held.values())

    def stop(self) -> None:
        self.flush(timeout=5.0)
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
            if backoff:  # the database is away: new settlements must not hurry the retry
                time.sleep(backoff)
            wait = max(0.0, self._next_extension - time.monotonic())
            self._wake.wait(wait)
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
        grouped: dict[tuple[QueueTable, Settlement, float], dict[int, list[int]]] = defaultdict(
            lambda: defaultdict(list))
        for how, held, delay in batch:
            grouped[(held.table, how, delay)][held.attempt].append(held.id)
        dialect = self.broker.dialect

        # a settled FIFO head lets the row behind it go: wake consumers here and elsewhere
        heads = {table for table, _, _ in grouped if table.fifo}

        def work(conn: Connection) -> int:
            touched = 0
            for (table, how, delay), tokens in grouped.items():
                statement = getattr(dialect.statements(table.spec), how.value)
                touched += dialect.settle(conn, statement, tokens, {"delay": delay})
            for table in heads:
                dialect.wake(conn, table.spec)
            return touched

        try:
            touched = self.broker.run(work, durable=False)
        except Exception:
            with self._lock:
                self._pending[:0] = batch
            raise
        if touched < len(batch):
            logger.info(
                "sqlinbox: %d of %d settled rows had already left this process (settled "
                "by a task's own transaction, or claimed again after their lease lapsed)",
                len(batch) - touched, len(batch))
        with self._lock:
            for _, held, _ in batch:
                rows = self._held.get(held.table)
                if rows is not None and rows.get(held.id) == held.attempt:
                    del rows[held.id]
            self._idle.notify_all()
        if heads:
            self.broker.wakeup.poke()
        by_form: dict[ClaimForm, list[Held]] = defaultdict(list)
        for _, held, _ in batch:
            by_form[held.table.claims].append(held)
        for form, rows_settled in by_form.items():
            form.settled(rows_settled)

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
                    logger.info(
                        "sqlinbox: %d rows of queue %r were no longer this process's when "
                        "their lease was extended", len(rows) - kept, table.queue)

        self.broker.run(work, durable=False)


class Wakeup:
    """What an idle consumer waits on instead of sleeping a whole polling interval."""

    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)
        self._channels: set[str] = set()
        self._listener: Any = None  # a detached DBAPI connection that LISTENs

    def poke(self) -> None:
        """Wake a consumer of this process now (a local publish, a key set free)."""
        with contextlib.suppress(BlockingIOError):  # a full pipe: a wake-up is pending
            os.write(self._write, b"!")

    def listen(self, table: QueueTable) -> None:
        """Ask for a NOTIFY wake-up from a consumed table, where the database has them."""
        if not self.broker.dialect.notify:
            return
        name = self.broker.dialect.channel(table.spec)
        if name in self._channels:
            return
        self._channels.add(name)
        if self._listener is not None:
            try:
                self.broker.dialect.listen(self._listener, [name])
            except Exception:
                self._drop_listener()

    def _connect_listener(self) -> Any:
        raw = self.broker.engine.raw_connection()
        connection: Any = raw.driver_connection  # read before detach() forgets it
        raw.detach()
        connection.autocommit = True
        self.broker.dialect.listen(connection, self._channels)
        return connection

    def _drop_listener(self) -> None:
        if self._listener is not None:
            try:
                self._listener.close()
            except Exception:
                logger.debug("closing a dead LISTEN connection failed", exc_info=True)
        self._listener = None

    def wait(self, timeout: float) -> None:
        """Return after a wake-up or ``timeout`` seconds, whichever comes first."""
        sources: list[Any] = [self._read]
        if self._channels:
            if self._listener is None:
                try:
                    self._listener = self._connect_listener()
                except Exception as exc:  # the database is away: poll until it is back
                    logger.warning("sqlinbox: LISTEN connection failed (%s); polling every "
                                   "%.2fs until it works", exc, timeout)
            if self._listener is not None:
                sources.append(self._listener)
        try:
            ready, _, _ = select.select(sources, [], [], timeout)
        except (OSError, ValueError):  # the listener's socket died under us
            self._drop_listener()
            return
        if self._read in ready:
            try:
                while os.read(self._read, 4096):
                    pass
            except BlockingIOError:
                pass
        if self._listener is not None and self._listener in ready:
            try:
                self.broker.dialect.take_notifications(self._listener)
            except Exception:
                self._drop_listener()

    def close(self) -> None:
        self._drop_listener()
        os.close(self._read)
        os.close(self._write)
