"""The lease keeper: it extends the leases of the rows the lease-based claim forms hold,
and writes their settlements in batches, each on a thread of its own."""

from __future__ import annotations

import logging
import math
import os
import threading
import time
import weakref
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import TypeVar

from sqlalchemy import Connection
from sqlalchemy.exc import DBAPIError

from .database import Database
from .handover import HandOver
from .own_session import OwnSession
from .retries import Failing, isolated, next_backoff
from .rows import ClaimedRow, ClaimRunner, Group, Held, Queued, QueueTable, Settlement, grouped

#: the logger of the claim forms: the docs name it, operators' settings select it
logger = logging.getLogger("kombu_sqlinbox.claims")
T = TypeVar("T")


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
        #: gives a table's rows (ids by attempt) back uncounted in the caller's transaction;
        #: how many went. The limits' (:meth:`.Limiter.give_back`) frees their slots too
        self.give_back: Callable[[Connection, QueueTable, dict[int, list[int]]], int] = (
            lambda conn, table, tokens: self.dialect.settle(
                conn, self.dialect.statements(table.spec).release_uncounted, tokens))
        self._begin()
        _KEEPERS.add(self)

    def _begin(self) -> None:
        """This process's state, begun again in a forked child: it has none of the parent's
        threads, its copy of their lock may be held for ever, and the parent settles and
        extends what it holds."""
        self._lock = threading.Lock()
        self._written = threading.Condition(self._lock)  # settlements left the queue
        #: what finalizers hand over: the release of a row whose message was freed
        self.handed_over = HandOver()
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
        #: the running threads by name (each takes itself out as it ends)
        self._threads: dict[str, threading.Thread] = {}
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
        """Stop extending a row that left by another path (moved to a dead-letter queue,
        completed by its task). Only this delivery of it: a row claimed again into this
        process, under a later attempt, is still extended."""
        with self._lock:
            rows = self._held[held.table]
            if rows.get(held.id) == held.attempt:
                del rows[held.id]

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every settlement queued so far is committed (or dropped with its
        table); False on timeout."""
        deadline = time.monotonic() + timeout
        self.handed_over.run()
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
        per ack, so the usual case is one comparison)."""
        if len(self._threads) == 2:
            return
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
                if how is Settlement.RELEASE_UNCOUNTED:
                    touched += self.give_back(conn, table, tokens)
                    continue
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
        """Drop the group when its table is gone (asked once); else retry it, backing off."""
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
            return not self.database.has_table(table.spec, attempts=1)
        except Exception:
            return False

    # -- extending ----------------------------------------------------------
    def _extend_loop(self) -> None:
        backoff = 0.0
        while not self._stopped:
            self.handed_over.run()  # outside the lock; a process no longer consuming too
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


#: every keeper of this process, begun again in a forked child
_KEEPERS: weakref.WeakSet[LeaseKeeper] = weakref.WeakSet()


def _begin_after_fork() -> None:
    for keeper in list(_KEEPERS):
        keeper._begin()


os.register_at_fork(after_in_child=_begin_after_fork)
