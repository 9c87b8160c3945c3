"""Claim forms, the lease keeper and the wake-up.

A claim takes a batch of ready rows in one round trip and bumps their
``attempt``. The attempt is the fencing token: every later statement on a held
row repeats it, so a holder whose row was claimed again elsewhere (its lease
lapsed) can neither extend nor settle it.

* :class:`LeaseClaims` — ``locked_until`` marks the row in work; the
  :class:`LeaseKeeper` (one per process and database) extends the lease of
  every held row on one thread and settles rows in batches on another: acks
  from any thread land in its queue and one transaction settles all of them
  (group commit).
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
import math
import os
import select
import socket
import threading
import time
import zlib
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, TypeVar

from sqlalchemy import Connection
from sqlalchemy.exc import DBAPIError

from .database import Database
from .dialects.base import no_wakeups
from .errors import ConfigurationError
from .rows import ClaimedRow, QueueTable
from .rows import Held as Held  # re-exported: the transport imports them from here
from .rows import Settlement as Settlement
from .tables import Role

logger = logging.getLogger(__name__)
T = TypeVar("T")


class ClaimRunner(Protocol):
    """How a lease claim's transaction is run: :meth:`.Database.run_fenced`, or
    :meth:`Wakeup.claim` on the LISTEN connection."""

    def __call__(self, work: Callable[[Connection], T]) -> T: ...


class ClaimForm:
    """How a queue's rows are taken into work and given back."""

    name = ""

    def __init__(self, database: Database) -> None:
        self.database = database
        self.dialect = database.dialect

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
        if not self.dialect.capabilities.serves(self.name):
            raise ConfigurationError(
                f"queue {queue!r}: claim={self.name!r} needs row or advisory locks, which "
                f"{self.database.engine.dialect.name} does not have; use claim='lease'"
            )


class LeaseClaims(ClaimForm):
    """The lease form: ``UPDATE ... SET locked_until, attempt + 1`` on a batch; the
    ``keeper`` extends the leases of the rows held and settles them."""

    name = "lease"

    def __init__(self, database: Database, keeper: LeaseKeeper,
                 run_claim: ClaimRunner | None = None) -> None:
        super().__init__(database)
        self.keeper = keeper
        #: runs the claim statement: by default a transaction of the pool's whose commit
        #: does not wait for the disk; the broker's :meth:`Wakeup.claim`
        self.run_claim: ClaimRunner = run_claim or database.run_fenced
        #: tables whose last claim took rows: the next claims without a read first
        self._busy: set[QueueTable] = set()

    def claim(self, table: QueueTable, limit: int, skip: Sequence[Any] = ()) -> list[ClaimedRow]:
        """Lease up to ``limit`` rows and register them with the keeper before returning.
        After a claim that took nothing, where the dialect has a read for it
        (:meth:`.Dialect.any_ready`), claim only once that read finds a ready row."""
        dialect = self.dialect
        lease = table.options.visibility_timeout

        def claim(conn: Connection) -> list[ClaimedRow]:
            return dialect.claim(conn, table.spec, limit, lease, skip=skip)

        def completing(conn: Connection, attempt: int,
                       ids: list[int]) -> tuple[int, list[ClaimedRow]]:
            return dialect.complete_and_claim(conn, table.spec, limit, lease, attempt, ids)

        probe = dialect.statements(table.spec).any_ready
        if probe is not None and table not in self._busy and self.database.run(
                lambda conn: conn.execute(probe).first(), read_only=True) is None:
            return []  # a row ready from now on is found by the next round
        # a claim repeated after a lost commit reply takes other rows; the rows of the
        # first come back after one lease, their attempt counted, as after a crash
        one_statement = (not skip
                         and dialect.statements(table.spec).claim_completing is not None)
        rows = self.keeper.folded(claim, self.run_claim,
                                  (table, completing) if one_statement else None)
        if rows:
            self._busy.add(table)
        else:
            self._busy.discard(table)
        self.keeper.hold(table, rows)
        return rows

    def settle(self, how: Settlement, held: Held, delay: float = 0.0) -> None:
        self.keeper.settle(how, held, delay)

    def run_held(self, held: Held, work: Callable[[Connection], T]) -> T:
        # work on a held row is fenced: run again after its commit landed, it finds nothing
        result = self.database.run(work, repeatable=True)
        self.keeper.forget(held)
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

    def __init__(self, database: Database) -> None:
        super().__init__(database)
        self._open: dict[tuple[int, int], Connection] = {}
        self._lock = threading.Lock()

    def check(self, queue: str) -> None:
        self.refuse_without_locks(queue)

    def capacity(self) -> int:
        pool = self.database.engine.pool
        size = int(getattr(pool, "size", lambda: 5)()) + max(
            int(getattr(pool, "_max_overflow", 0)), 0)
        with self._lock:
            return max(size - self.reserved_connections - len(self._open), 0)

    def claim(self, table: QueueTable, limit: int, skip: Sequence[Any] = ()) -> list[ClaimedRow]:
        dialect = self.dialect
        limit = min(limit, self.capacity())
        if limit <= 0:
            return []
        # fenced like a lease claim's: run again after a lost commit reply, it counts other
        # rows, and the first ones, leased for no time, are ready again at once
        counted = self.database.run_fenced(
            lambda conn: dialect.claim(conn, table.spec, limit, 0.0, skip=skip))
        taken = []
        lock_row = dialect.statements(table.spec).lock_row
        for row in counted:
            conn = self.database.engine.connect()
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
                statement = getattr(self.dialect.statements(held.table.spec), how.value)
                self.dialect.settle(
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

    def __init__(self, database: Database, keeper: LeaseKeeper) -> None:
        super().__init__(database, keeper)
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
            session = self._connection = self.database.engine.connect().execution_options(
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
            taken = self.dialect.try_key_locks(session, space, keys)
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
        dialect = self.dialect
        try:
            return dialect.try_key_locks(self._locks(), space, keys)
        except DBAPIError:
            self._drop_session()
        return dialect.try_key_locks(self._locks(), space, keys)

    def _give_back(self, space: int, keys: list[str]) -> None:
        """Release the locks of ``keys`` (the caller holds ``_lock``). When the session
        fails, they went with it; a new one takes back the others."""
        try:
            self.dialect.release_key_locks(self._locks(), space, keys)
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
        dialect = self.dialect
        statements = dialect.statements(table.spec)
        space = self.space(table)
        with self._lock:
            mine = self._keys[space]
            candidates = self.database.run(lambda conn: conn.execute(
                statements.candidates, {"limit": limit * self.overscan,
                                        "floor": dialect.claim_floor(conn, table.spec)}).all(),
                read_only=True)
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
                    rows = self.database.run(lambda conn: dialect.claim(
                        conn, table.spec, len(wanted), lease, ids=wanted), durable=False,
                        repeatable=True)
            finally:
                mine.update({self.key_of(table, row): row.id for row in rows})
                unused = [key for key in locked if key not in mine]
                if unused:
                    self._give_back(space, unused)
        self.keeper.hold(table, rows)
        return rows

    def settle(self, how: Settlement, held: Held, delay: float = 0.0) -> None:
        self.keeper.settle(how, held, delay)

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


def claim_forms(database: Database, keeper: LeaseKeeper,
                wakeup: Wakeup | None = None) -> dict[str, ClaimForm]:
    """Every claim form on ``database`` by name, the lease-based ones sharing ``keeper``;
    lease claims run on ``wakeup``'s LISTEN connection where it has one."""
    forms = (LeaseClaims(database, keeper, wakeup.claim if wakeup else None),
             RowLockClaims(database),
             AdvisoryClaims(database, keeper))
    return {form.name: form for form in forms}


#: how long closing a channel, a broker or the process waits for the settlements queued
#: so far to be written
SETTLE_LIMIT = 10.0
#: how long the settling thread lets settlements gather before it writes them: acks that
#: arrive one by one (a Celery worker's, one per task) then share a commit, or ride on
#: the consumer's next claim
SETTLE_GATHER = 0.005
#: how long after the last settlement the settling thread keeps looking every
#: SETTLE_GATHER instead of sleeping until the next one wakes it: a busy consumer's
#: claims carry most of its acks, and waking the thread for each batch cost the consumer
#: a thread switch per claim (the driver lets go of the GIL while it sends a statement)
SETTLE_ACTIVE = 0.1
#: the first and the longest wait before a failed settlement group or extension is retried
BACKOFF_FIRST = 0.2
BACKOFF_MAX = 5.0


class Queued(NamedTuple):
    """A settlement waiting to be written; ``seq`` orders it for :meth:`LeaseKeeper.flush`.
    A tuple: one is made per ack, and a frozen dataclass costs several times as much."""

    seq: int
    how: Settlement
    held: Held
    delay: float
    at: float  # when it was queued (monotonic)


@dataclass
class Failing:
    """A settlement group whose statement failed: when it is tried next."""

    failures: int = 0
    backoff: float = 0.0
    retry_at: float = 0.0


#: settlements written together: one queue's acks, or its requeues, ...
Group = tuple[QueueTable, Settlement]


#: a claim that also completes the rows ``ids`` held at ``attempt``: how many it
#: completed, and the rows it claimed (:meth:`.Dialect.complete_and_claim`)
Completing = Callable[[Connection, int, list[int]], tuple[int, list[ClaimedRow]]]


def _acks_of(batch: Sequence[Queued], table: QueueTable) -> tuple[int, list[int]] | None:
    """The attempt and ids of ``batch`` when it only completes rows of ``table``, all at
    one attempt, with no delay; else None."""
    attempts = {queued.held.attempt for queued in batch}
    if len(attempts) != 1 or any(queued.held.table is not table or queued.delay
                                 or queued.how is not Settlement.COMPLETE for queued in batch):
        return None
    return attempts.pop(), [queued.held.id for queued in batch]


def grouped(batch: Iterable[Queued]) -> dict[Group, list[Queued]]:
    """Settlements by group, each group in queue order."""
    groups: dict[Group, list[Queued]] = defaultdict(list)
    for queued in batch:
        groups[(queued.held.table, queued.how)].append(queued)
    return groups


def next_backoff(backoff: float) -> float:
    """The wait after one more failure: doubling, from the first to the longest."""
    return min(max(backoff * 2, BACKOFF_FIRST), BACKOFF_MAX)


class OwnSession:
    """A connection of this process's own, out of the pool (its session settings stay its
    own), in autocommit, for fenced work whose commits need not wait for the disk: each
    statement is one round trip, with no pool checkout, ``BEGIN`` or ``COMMIT``, run as a
    prepared statement where the dialect can (:meth:`.Dialect.prepare_session`).
    ``setup`` runs first on the driver connection (the wake-up's LISTEN)."""

    def __init__(self, database: Database, setup: Callable[[Any], None] | None = None) -> None:
        self.database = database
        self.setup = setup
        self.driver: Any = None
        self.session: Connection | None = None
        self._pid = 0

    def connect(self) -> Connection:
        """Connect (again); a connection whose set-up fails is closed as it is."""
        raw = self.database.engine.raw_connection()
        driver: Any = raw.driver_connection  # read before detach() forgets it
        raw.detach()
        driver.autocommit = True
        session = Connection(self.database.engine, connection=raw)
        dialect = self.database.dialect
        try:
            if self.setup is not None:
                self.setup(driver)
            if dialect.relaxed_session:
                session.exec_driver_sql(dialect.relaxed_session)
                session.commit()
            dialect.prepare_session(session)
        except Exception:
            # the driver's own close: the session's would roll back first and, on a
            # broken connection, give up before closing it
            driver.close()
            raise
        self.driver, self.session, self._pid = driver, session, os.getpid()
        return session

    @staticmethod
    def commit(session: Connection, work: Callable[[Connection], T]) -> T:
        """Run ``work`` on ``session``; each statement committed as it ran (autocommit), the
        commit only ends SQLAlchemy's view of a transaction."""
        result = work(session)
        session.commit()
        return result

    def current(self) -> Connection | None:
        """The session, when there is one of this process (a forked child leaves its
        parent's alone)."""
        return self.session if self._pid == os.getpid() else None

    def drop(self) -> None:
        """Close the session without the pool's reset: in autocommit it has nothing to roll
        back, and dropped because it failed, it is often dead already (a reset would log
        an ERROR with a traceback, "connection already closed", for what is recovered)."""
        session = self.current()
        if session is not None:
            session.invalidate()
        self.driver = self.session = None


class LeaseKeeper:
    """Extends leases of held rows and settles them in batches, each on its own thread.

    Extensions never wait behind a settlement. Settlements are grouped by queue and kind
    (acks, requeues, ...); a group whose statement fails is retried with back-off on its
    own while every other group is written, and one whose table no longer exists is
    dropped (its rows went with the table). ``wake`` is called when a settlement may let
    a waiting row go (a FIFO head settled).

    Where the database relaxes a whole session's commits (PostgreSQL), settlements are
    written on an :class:`OwnSession` of the keeper's, one round trip per statement; a
    settlement that fails there runs again on the pool (it is fenced).
    """

    def __init__(self, database: Database, wake: Callable[[], None]) -> None:
        self.database = database
        self.dialect = database.dialect
        self.wake = wake
        self._own = OwnSession(database) if database.dialect.relaxed_session else None
        self._lock = threading.Lock()
        self._written = threading.Condition(self._lock)  # settlements left the queue
        self._held: dict[QueueTable, dict[int, int]] = defaultdict(dict)
        self._pending: list[Queued] = []
        self._writing: list[Queued] = []
        self._failing: dict[Group, Failing] = {}
        self._queued = 0
        self._settle_wake = threading.Event()
        #: someone waits for the settlements (flush, stop): write them without gathering
        self._hurry = threading.Event()
        self._extend_wake = threading.Event()
        self._stopped = False
        #: the running threads by name (each takes itself out as it ends), of process _pid
        self._threads: dict[str, threading.Thread] = {}
        self._pid = os.getpid()
        #: the settling thread waits for ``_settle_wake`` (or may be about to) with no
        #: timeout: a settlement queued meanwhile sets it; one queued while it gathers,
        #: writes or looks every SETTLE_GATHER (settlements came in the last
        #: SETTLE_ACTIVE) does not, sparing the consumer a thread switch per ack
        self._settler_idle = True
        #: when the last settlement was queued (monotonic)
        self._last_queued = -math.inf
        #: when the leases held are next extended (never while nothing is held)
        self._next_extension = math.inf

    # -- called from consumer and pool threads ------------------------------
    def hold(self, table: QueueTable, rows: Sequence[ClaimedRow]) -> None:
        """Extend the leases of ``rows`` of ``table`` (just claimed) until they settle."""
        if not rows:
            return
        # the first extension of these rows is due at a third of their lease: bring forward
        # one scheduled later (for longer leases, or none while nothing was held)
        due = time.monotonic() + table.options.visibility_timeout / 3
        with self._lock:
            held = self._held[table]
            for row in rows:
                held[row.id] = row.attempt
            self._ensure_threads()
            early = due < self._next_extension
            if early:
                self._next_extension = due
        if early:
            self._extend_wake.set()

    def settle(self, how: Settlement, held: Held, delay: float = 0.0) -> None:
        """Queue a settlement; the settling thread writes it with whatever else is due."""
        with self._lock:
            self._queued += 1
            self._last_queued = now = time.monotonic()
            self._pending.append(Queued(self._queued, how, held, delay, now))
            self._ensure_threads()
            wake, self._settler_idle = self._settler_idle, False
        if wake:
            self._settle_wake.set()

    def forget(self, held: Held) -> None:
        """Stop extending a row that left by another path (moved to a dead-letter queue)."""
        with self._lock:
            self._held[held.table].pop(held.id, None)

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every settlement queued so far is committed (or dropped with its
        table); False on timeout."""
        deadline = time.monotonic() + timeout
        with self._lock:
            target = self._queued
            if self._oldest() <= target:
                self._ensure_threads()
        self._hurry.set()
        self._settle_wake.set()
        with self._lock:
            while self._oldest() <= target:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._written.wait(remaining)
        return True

    def held_count(self) -> int:
        with self._lock:
            return sum(len(rows) for rows in self._held.values())

    def stop(self, timeout: float = SETTLE_LIMIT) -> None:
        """Write what is queued (waiting at most ``timeout``), then end both threads."""
        if not self.flush(timeout):
            with self._lock:
                left = len(self._pending) + len(self._writing)
            logger.warning(
                "sqlinbox lease keeper: %d settlements not written within %.0fs; their rows "
                "go back to their queues when their lease runs out", left, timeout)
        self._stopped = True
        self._settle_wake.set()
        self._extend_wake.set()

    # -- the threads --------------------------------------------------------
    def _ensure_threads(self) -> None:
        """Start the settling and the extending thread where not running (call locked; once
        per ack, so the usual case is one comparison). A forked child has none of its
        parent's threads."""
        if len(self._threads) == 2 and self._pid == os.getpid():
            return
        if self._pid != os.getpid():
            self._pid, self._threads = os.getpid(), {}
        for name, target in (("settler", self._settle_loop), ("extender", self._extend_loop)):
            if name not in self._threads:
                self._stopped = False
                self._threads[name] = thread = threading.Thread(
                    target=self._run, args=(name, target), name=f"sqlinbox-lease-{name}",
                    daemon=True)
                thread.start()

    def _run(self, name: str, loop: Callable[[], None]) -> None:
        """A keeper thread: its loop, then out of ``_threads`` however the loop ended (stopped,
        or failed), so that the next use starts another."""
        try:
            loop()
        finally:
            with self._lock:
                if self._threads.get(name) is threading.current_thread():
                    del self._threads[name]

    def _oldest(self) -> float:
        """The sequence number of the oldest settlement not yet written (call locked)."""
        return min((queued.seq for queued in (*self._pending, *self._writing)),
                   default=math.inf)

    def _interval(self) -> float:
        """Extend at a third of the shortest lease held: two tries before any lease lapses
        (call locked)."""
        leases = [t.options.visibility_timeout for t, rows in self._held.items() if rows]
        return min(leases) / 3 if leases else math.inf

    # -- settling -----------------------------------------------------------
    def _settle_loop(self) -> None:
        while not self._stopped:
            with self._lock:
                gather = self._gathering()
                due, wait = ([], None) if gather else self._take_due()
                if not self._pending and not self._writing:
                    self._hurry.clear()
                looking = time.monotonic() - self._last_queued < SETTLE_ACTIVE
                self._settler_idle = not gather and not due and not looking
            if gather:
                self._hurry.wait(gather)
                continue
            if due:
                self._write(due)
                continue
            if looking:  # a settlement queued meanwhile is found within SETTLE_GATHER
                wait = SETTLE_GATHER if wait is None else min(wait, SETTLE_GATHER)
            self._settle_wake.wait(wait)
            self._settle_wake.clear()
        if self._own is not None:
            self._own.drop()

    def _gathering(self) -> float:
        """How much longer the settlements queued may gather before they are written: up to
        :data:`SETTLE_GATHER` after the oldest was queued, none once someone waits for them
        (call locked)."""
        if self._hurry.is_set() or not self._pending:
            return 0.0
        return max(0.0, self._pending[0].at + SETTLE_GATHER - time.monotonic())

    def _take_due(self) -> tuple[list[Queued], float | None]:
        """Move every settlement not held back by its group's back-off to ``_writing``;
        else how long until a held-back group is due (call locked)."""
        now = time.monotonic()
        due: list[Queued] = []
        later: list[Queued] = []
        for queued in self._pending:
            failing = self._failing.get((queued.held.table, queued.how))
            (later if failing is not None and failing.retry_at > now else due).append(queued)
        self._pending = later
        self._writing.extend(due)
        retries = [self._failing[(q.held.table, q.how)].retry_at for q in later]
        return due, (max(0.0, min(retries) - now) if retries else None)

    def _write(self, due: list[Queued]) -> None:
        """Everything due in one transaction (group commit); if that fails, each group."""
        isolated(grouped(due), lambda parts: self._commit(
            [queued for entries in parts.values() for queued in entries]),
            self._failed, self._done)

    def _commit(self, batch: list[Queued]) -> None:
        work, written = self._settling(batch)
        written(self._settle_on_own(work))

    def _settle_on_own(self, work: Callable[[Connection], T]) -> T:
        """Run fenced settlement ``work`` (run again after a commit whose reply was lost, it
        finds nothing to do) on the keeper's own session where it has one, else, and when
        that fails, in a transaction of the pool's; either way its commit does not wait
        for the disk."""
        own = self._own
        if own is not None:
            session = own.current()
            try:
                session = session or own.connect()
                return own.commit(session, work)
            except DBAPIError as exc:
                if session is not None and not exc.connection_invalidated:
                    session.rollback()  # a statement's own error: the connection is sound
                    raise
                logger.info("sqlinbox: settling on the lease keeper's own connection failed "
                            "(%s); settling on the pool", exc)
                own.drop()
        return self.database.run_fenced(work)

    def _settling(self, batch: list[Queued]) -> tuple[Callable[[Connection], int],
                                                      Callable[[int], None]]:
        """The statements that write ``batch`` in the caller's transaction (returning the
        rows they touched), and what to do once that transaction committed."""
        grouped: dict[tuple[QueueTable, Settlement, float], dict[int, list[int]]] = defaultdict(
            lambda: defaultdict(list))
        for queued in batch:
            grouped[(queued.held.table, queued.how, queued.delay)][queued.held.attempt].append(
                queued.held.id)
        dialect = self.dialect
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

        def written(touched: int) -> None:
            if touched < len(batch):
                logger.info(
                    "sqlinbox: %d of %d settled rows had already left this process (settled "
                    "by a task's own transaction, or claimed again after their lease "
                    "lapsed)", len(batch) - touched, len(batch))
            if heads:
                self.wake()

        return work, written

    # -- settling in a claim's transaction --------------------------------------
    def folded(self, claim: Callable[[Connection], list[ClaimedRow]], run: ClaimRunner,
               completing: tuple[QueueTable, Completing] | None = None) -> list[ClaimedRow]:
        """Run ``claim`` (fenced, so repeatable) through ``run`` with the settlements queued
        so far written first: a busy consumer's acks then cost no commit of their
        own. They count as written once that transaction committed, as when the settling
        thread writes them. If it fails, they go back to the settling thread (its
        isolation and back-off decide) and the claim runs alone.

        ``completing`` is the claim's table and its claim with a completion in the same
        statement, where it has one: when every settlement queued completes a row of
        that table at one attempt (a consumer acking what it claimed), that statement
        runs instead, one round trip for both."""
        with self._lock:
            if self._failing:  # groups in back-off stay the settling thread's
                batch = [queued for queued in self._pending
                         if (queued.held.table, queued.how) not in self._failing]
                taken = {id(queued) for queued in batch}
                self._pending = [queued for queued in self._pending if id(queued) not in taken]
            else:
                batch, self._pending = self._pending, []
            self._writing.extend(batch)
        if not batch:
            return run(claim)
        work, written = self._settling(batch)
        acked = _acks_of(batch, completing[0]) if completing is not None else None

        def both(conn: Connection) -> tuple[int, list[ClaimedRow]]:
            if completing is not None and acked is not None:
                return completing[1](conn, *acked)
            return work(conn), claim(conn)
        try:
            touched, rows = run(both)
        except DBAPIError as exc:
            logger.info("sqlinbox: a claim with %d settlements failed (%s); the settling "
                        "thread writes them, the claim runs alone", len(batch), exc)
            self._hand_back(batch)
            return run(claim)
        written(touched)
        for group, entries in grouped(batch).items():
            self._done(group, entries)
        return rows

    def _hand_back(self, batch: list[Queued]) -> None:
        """Settlements a claim took but could not write: the settling thread's again."""
        with self._lock:
            returned = {id(queued) for queued in batch}
            self._writing = [queued for queued in self._writing if id(queued) not in returned]
            self._pending[:0] = batch
            self._ensure_threads()
        self._settle_wake.set()

    def _done(self, group: Group, entries: list[Queued]) -> None:
        """A group's settlements are written (or dropped): the rows leave this process."""
        with self._lock:
            self._failing.pop(group, None)
            written = {id(queued) for queued in entries}
            self._writing = [queued for queued in self._writing if id(queued) not in written]
            for queued in entries:
                rows = self._held.get(queued.held.table)
                if rows is not None and rows.get(queued.held.id) == queued.held.attempt:
                    del rows[queued.held.id]
            self._written.notify_all()
        group[0].claims.settled(queued.held for queued in entries)

    def _failed(self, group: Group, entries: list[Queued], exc: Exception) -> None:
        """Drop the group when its table is gone; else retry it alone, with back-off."""
        table, how = group
        if self._gone(table):
            logger.warning(
                "sqlinbox: %d %s settlements of queue %r dropped: its table %r no longer "
                "exists, and their rows went with it", len(entries), how.value, table.queue,
                table.spec.table)
            self._done(group, entries)
            return
        with self._lock:
            failing = self._failing.setdefault(group, Failing())
            failing.failures += 1
            failing.backoff = next_backoff(failing.backoff)
            failing.retry_at = time.monotonic() + failing.backoff
            retried = {id(queued) for queued in entries}
            self._writing = [queued for queued in self._writing if id(queued) not in retried]
            self._pending[:0] = entries
        logger.warning(
            "sqlinbox lease keeper: %d %s settlements of queue %r failed (%s); retrying in "
            "%.1fs (failure %d); other queues are not held up", len(entries), how.value,
            table.queue, exc, failing.backoff, failing.failures)

    def _gone(self, table: QueueTable) -> bool:
        """Whether the table was dropped; a database that cannot say is taken as there."""
        try:
            return not self.database.has_table(table.spec)
        except Exception:
            return False

    # -- extending ----------------------------------------------------------
    def _extend_loop(self) -> None:
        backoff = 0.0
        while not self._stopped:
            with self._lock:
                wait = self._next_extension - time.monotonic()
            if wait > 0:
                self._extend_wake.wait(None if wait == math.inf else wait)
                self._extend_wake.clear()
                continue
            failed = self._extend()
            backoff = next_backoff(backoff) if failed else 0.0
            with self._lock:
                interval = self._interval()
                self._next_extension = time.monotonic() + (
                    min(backoff, interval) if failed else interval)

    def _extend(self) -> bool:
        """Extend every held row's lease; True when some table's extension failed."""
        with self._lock:
            snapshot = {table: dict(rows) for table, rows in self._held.items() if rows}
        if not snapshot:
            return False
        dialect = self.dialect

        def work(conn: Connection, tables: dict[QueueTable, dict[int, int]]) -> None:
            for table, rows in tables.items():
                tokens: dict[int, list[int]] = defaultdict(list)
                for row_id, attempt in rows.items():
                    tokens[attempt].append(row_id)
                kept = dialect.extend(conn, table.spec, tokens, table.options.visibility_timeout)
                if kept < len(rows):
                    logger.info(
                        "sqlinbox: %d rows of queue %r were no longer this process's when "
                        "their lease was extended", len(rows) - kept, table.queue)

        failed = isolated(
            snapshot,
            lambda tables: self.database.run(lambda conn: work(conn, tables), durable=False,
                                           repeatable=True),
            self._extension_failed, lambda table, rows: None)
        return bool(failed)

    def _extension_failed(self, table: QueueTable, rows: dict[int, int],
                          exc: Exception) -> None:
        """Forget the rows of a dropped table; anything else is tried again soon."""
        if self._gone(table):
            with self._lock:
                self._held.pop(table, None)
            logger.warning(
                "sqlinbox: %d held rows of queue %r forgotten: its table %r no longer exists",
                len(rows), table.queue, table.spec.table)
            return
        logger.warning("sqlinbox lease keeper: extending %d leases of queue %r failed (%s); "
                       "retrying soon", len(rows), table.queue, exc)


K = TypeVar("K")
V = TypeVar("V")


def isolated(parts: dict[K, V], run: Callable[[dict[K, V]], object],
             failed: Callable[[K, V, Exception], None],
             done: Callable[[K, V], None]) -> list[K]:
    """Run every part in one go; if that fails, each part alone, so that a part that keeps
    failing holds up no other. Returns the parts that failed."""
    try:
        run(parts)
    except Exception as exc:
        if len(parts) == 1:
            ((key, value),) = parts.items()
            failed(key, value, exc)
            return [key]
        broken = []
        for key, value in parts.items():
            try:
                run({key: value})
            except Exception as alone:
                broken.append(key)
                failed(key, value, alone)
            else:
                done(key, value)
        return broken
    for key, value in parts.items():
        done(key, value)
    return []


#: how old (ns) a directory's modification time must be for its last listing to hold
SETTLED_NS = 1_000_000_000


class LocalSignal:
    """Wake-ups between the processes of one host, without the database server (SQLite).

    Each consuming process binds a Unix datagram socket in a directory next to the
    database file; a publisher sends a byte to every socket there after its commit.
    The byte is only a hint: the row is in the table whatever becomes of it, and a
    consumer that missed one finds the row at its next poll. A socket whose process
    died (a ``kill -9`` leaves it behind) refuses the byte, and the publisher removes it.
    """

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.socket: socket.socket | None = None
        self.path: str | None = None
        self.failed = False
        self._sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sender.setblocking(False)
        self._pid = os.getpid()
        #: the names in the directory and its modification time (ns) when they were listed
        #: (-1 when listed too soon after it: see :meth:`_names`)
        self._listing: tuple[int, list[str]] = (-1, [])

    def bind(self) -> socket.socket | None:
        """This process's socket, bound on first need; None when the directory cannot
        hold one (not writable, the path too long): the consumer polls."""
        if self.socket is None and not self.failed:
            path = os.path.join(self.directory, f"{os.getpid()}-{os.urandom(3).hex()}")
            bound = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            try:
                os.makedirs(self.directory, exist_ok=True)
                bound.bind(path)
            except OSError as exc:
                bound.close()
                self.failed = True
                no_wakeups(self.directory, exc)
                return None
            bound.setblocking(False)
            self.socket, self.path = bound, path
        return self.socket

    def send(self) -> None:
        """Wake every consumer of the database on this host (after a commit)."""
        try:
            names = self._names()
        except OSError:  # no consumer ever bound here
            return
        for name in names:
            path = os.path.join(self.directory, name)
            if path == self.path:
                continue  # this process's own consumers are poked through its pipe
            try:
                self._sender.sendto(b"!", path)
            except ConnectionRefusedError:  # nobody reads it: its process died
                # another publisher removed it first, or it is no socket (a directory)
                with contextlib.suppress(OSError):
                    os.unlink(path)
            except OSError:  # its queue is full (a wake-up is pending), or it just went
                pass

    def _names(self) -> list[str]:
        """The directory's sockets, listed again only when it changed since (a publish
        costs a ``stat`` rather than a listing). A listing taken less than
        :data:`SETTLED_NS` after the directory's last change is not kept: file system
        clocks are coarse, and a socket bound later in the same tick leaves the
        modification time as it was."""
        modified = os.stat(self.directory).st_mtime_ns
        listed_at, names = self._listing
        if modified != listed_at:
            settled = time.time_ns() - modified >= SETTLED_NS
            names = os.listdir(self.directory)
            self._listing = (modified if settled else -1, names)
        return names

    def take(self) -> None:
        """Read the bytes that arrived, so that the next wait blocks."""
        assert self.socket is not None
        with contextlib.suppress(BlockingIOError):
            while self.socket.recv(4096):
                pass

    def close(self) -> None:
        self._sender.close()
        if self.socket is not None:
            self.socket.close()
            if self._pid == os.getpid():  # a forked child leaves its parent's socket
                with contextlib.suppress(OSError):
                    os.unlink(self.path or "")
            self.socket = None


class Wakeup:
    """What an idle consumer waits on instead of sleeping a whole polling interval: an
    in-process pipe (a local publish, a key set free), PostgreSQL's LISTEN connection,
    and on SQLite the same-host :class:`LocalSignal`.

    Threads of one process share it (an event receiver in one, ``inspect`` calls in
    another, as in Flower): every use of the LISTEN connection and its channels holds
    :attr:`_lock`, as psycopg2 connections are not safe to use from two threads at once;
    the wait itself (``select``) does not.

    The LISTEN connection also runs the process's lease claims (:meth:`claim`): in
    autocommit, a claim is one round trip straight after the wake-up, with no pool
    checkout, BEGIN or COMMIT.
    """

    def __init__(self, database: Database, local: bool = True) -> None:
        self.database = database
        self.dialect = database.dialect
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)
        self._channels: set[str] = set()
        #: it only claims, settles and listens: see :class:`OwnSession`
        self._own = OwnSession(database, lambda driver: self.dialect.listen(driver,
                                                                            self._channels))
        self._lock = threading.Lock()
        directory = self.dialect.signal_directory() if local else None
        self.signal = LocalSignal(directory) if directory else None
        self._consuming = False
        self._closed = False

    def poke(self) -> None:
        """Wake a consumer of this process now (a local publish, a key set free). Not once
        closed: a channel may outlive its broker (``close_all`` at a test's end) and
        publish on, and the pipe's descriptors may by then be another file's."""
        if self._closed:
            return
        with contextlib.suppress(BlockingIOError):  # a full pipe: a wake-up is pending
            os.write(self._write, b"!")

    def published(self) -> None:
        """A publish committed: wake the consumers of this process (when it has any: a
        consumer registers before its first claim, which finds the row) and, where there
        is a same-host signal, those of the other processes."""
        if self._consuming:
            self.poke()
        if self.signal is not None:
            self.signal.send()

    def listen(self, name: str | None) -> None:
        """This process consumes: ask for a NOTIFY wake-up on channel ``name`` (a consumed
        queue's) where the database has them, and for the same-host signal."""
        self._consuming = True
        if name is None:
            return
        with self._lock:
            if name in self._channels:
                return
            self._channels.add(name)
            if self._listener is not None:
                try:
                    self.dialect.listen(self._listener, [name])
                except Exception:
                    self._drop_listener()
                return
        self.poke()  # a consumer waiting in an event loop connects the listener now

    @property
    def _listener(self) -> Any:
        """The DBAPI connection that LISTENs, if connected."""
        return self._own.driver

    @property
    def _session(self) -> Connection | None:
        """The same, as SQLAlchemy runs statements."""
        return self._own.session

    def _listening(self) -> Connection | None:
        """The LISTEN connection's session, connected when a queue is consumed and there is
        none (the first claim or wait, and again after it died); None while the database
        is away (call locked). A consumer with a backlog claims before it ever waits, so
        its claims run on this connection from the first."""
        if self._channels and self._listener is None:
            try:
                self._own.connect()
            except Exception as exc:  # the database is away: poll until it is back
                logger.warning("sqlinbox: LISTEN connection failed (%s); polling until "
                               "it works", exc)
        return self._session

    def _drop_listener(self) -> None:
        self._own.drop()

    def claim(self, work: Callable[[Connection], T]) -> T:
        """Run a claim (one repeatable statement) on the LISTEN connection when it is up
        and its driver keeps what arrives during a statement (a notification that did is
        a pending wake-up); else, or when that connection fails, in a transaction of the
        pool's. Either way its commit does not wait for the disk."""
        with self._lock:
            session = self._listening()
            if session is not None and self.dialect.keeps_notifications(self._listener):
                try:
                    result = self._own.commit(session, work)
                    if self.dialect.take_notifications(self._listener):
                        self.poke()
                    return result
                except DBAPIError as exc:
                    logger.warning("sqlinbox: a claim on the LISTEN connection failed (%s); "
                                   "claiming on the pool", exc)
                    self._drop_listener()
        return self.database.run_fenced(work)

    def sources(self) -> list[Any]:
        """What a consumer waits on: the in-process pipe; the LISTEN connection where the
        database has NOTIFY and a queue is consumed (connected on first need, and again
        after it died; while the database is away, none: the consumer polls); the
        same-host signal's socket where there is one."""
        sources: list[Any] = [self._read]
        with self._lock:
            self._listening()
            if self._listener is not None:
                sources.append(self._listener)
        if self._consuming and self.signal is not None and self.signal.bind() is not None:
            sources.append(self.signal.socket)
        return sources

    def take(self, ready: Collection[Any]) -> None:
        """Consume the wake-ups of the ``ready`` sources, so that the next wait blocks."""
        if self._read in ready:
            try:
                while os.read(self._read, 4096):
                    pass
            except BlockingIOError:
                pass
        if self.signal is not None and self.signal.socket in ready:
            self.signal.take()
        with self._lock:
            # the listener waited on: another thread may have dropped it meanwhile
            if self._listener is not None and self._listener in ready:
                try:
                    self.dialect.take_notifications(self._listener)
                except Exception:
                    self._drop_listener()

    def wait(self, timeout: float) -> None:
        """Return after a wake-up or ``timeout`` seconds, whichever comes first."""
        sources = self.sources()
        try:
            ready, _, _ = select.select(sources, [], [], timeout)
        except (OSError, ValueError):  # the listener's socket died under us
            with self._lock:
                if self._listener is not None and self._listener in sources:
                    self._drop_listener()
            return
        self.take(ready)

    def close(self) -> None:
        """Drop the listener, the signal and the pipe; once only (a descriptor closed twice
        may close another file's)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._drop_listener()
        if self.signal is not None:
            self.signal.close()
        os.close(self._read)
        os.close(self._write)
