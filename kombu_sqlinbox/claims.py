"""The claim forms: how a queue's rows are taken into work and given back.

A claim takes a batch of ready rows in one round trip and bumps their
``attempt``. The attempt is the fencing token: every later statement on a held
row repeats it, so a holder whose row was claimed again elsewhere (its lease
lapsed) can neither extend nor settle it.

* :class:`LeaseClaims` — ``locked_until`` marks the row in work; the
  :class:`~.keeper.LeaseKeeper` (one per process and database) extends the lease of
  every held row on one thread and settles rows in batches on another: acks
  from any thread land in its queue and one transaction settles all of them
  (group commit).
* :class:`RowLockClaims` — the row stays locked by an open transaction on a
  connection of its own until it settles; a crash frees it at once.
* :class:`AdvisoryClaims` — a lease plus a session-level advisory lock on the
  row's key (partition key, else id), so rows of one key go into work one at a
  time across every process on the server.
"""

from __future__ import annotations

import logging
import threading
import zlib
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from sqlalchemy import Connection
from sqlalchemy.exc import DBAPIError

from .database import Database
from .errors import ConfigurationError
from .keeper import LeaseKeeper
from .rows import ClaimedRow, ClaimRunner, Held, QueueTable, Settlement
from .tables import Role
from .wakeups import Wakeup

logger = logging.getLogger(__name__)
T = TypeVar("T")


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

    def completed(self, held: Held) -> None:
        """The held row was completed by a transaction of its task's own, fenced by its
        attempt (a result written with it): let go of it. A form that cannot tell that
        from its own state settles it, and the fenced completion finds nothing."""
        self.settle(Settlement.COMPLETE, held)

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

    def completed(self, held: Held) -> None:
        """No statement: the keeper stops extending the row (a FIFO group's head is settled
        as usual, as that settlement wakes the group's consumers)."""
        if held.table.fifo:
            super().completed(held)
            return
        self.keeper.forget(held)
        self.settled([held])


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
            try:
                conn.close()
            except DBAPIError as exc:  # its session ended with it: so did the row's lock
                if not exc.connection_invalidated:
                    raise

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
