"""Concurrency limits: at most N rows of a key (or of a queue) in work at once, across every
process and worker of the database.

A message names its key with the property or header ``limit_key`` (Celery:
``apply_async(..., limit_key="tenant-7")``); the queue option ``concurrency_limits`` gives
each key prefix its limit (``"*"``: any key), ``max_in_work`` the queue's own. The publish
keeps the key in the envelope's headers, where a claim reads it.

A queue with limits is claimed by :class:`Limiter` instead of its claim form's statement,
in one transaction: read the first ready rows whose keys are not known to be full, with
their keys' slots (``<prefix>limit_slots``), lease the rows that found a free slot, and
take those slots by compare-and-set on the holder each was seen with. A row whose slot
was taken meanwhile goes back uncounted before the commit, so no other claimer ever sees
it leased. A slot is free once its holder is no longer in work under the attempt it took
it with (:mod:`.dialects.limits`): a killed worker's slots free with its leases. Rows of a
full key are passed over, not delivered; the claim reads on past them (up to
:data:`ROUNDS` windows; once a window comes up short, a look ahead at the keys of the
rows beyond finds those at their limit), so other keys go on. Where the dialect has one
(:attr:`.LimitedClaim.whole`: PostgreSQL), a claim is first tried as one statement that
leases only the rows whose slots it wrote. Queues without limits never come here.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Any

from sqlalchemy import Connection, inspect
from sqlalchemy.exc import DBAPIError

from .database import Database
from .dialects import LimitedClaim, LimitStatements
from .dialects.limits import digest
from .errors import ConfigurationError, SchemaMismatch
from .keeper import LeaseKeeper
from .options import MAX_LIMIT_KEY, QueueOptions, TransportOptions
from .rows import ClaimedRow, ClaimRunner, QueueTable
from .tables import Role, TableSpec

#: the message property and header naming a row's key
KEY_PROPERTY = "limit_key"
#: the slots' key of a queue's own limit (no key's digest: those are 64 hex digits)
QUEUE_SLOTS = "queue"
#: candidate rows read per row wanted; and windows read, each passing over the keys the
#: ones before found full, before a claim gives up on finding more
OVERSCAN, ROUNDS = 4, 4
#: rows a congested claim looks ahead at (unlocked, keys only) at a time, to find the
#: keys at their limit that fill the head: up to :data:`ROUNDS` looks, each past the
#: keys the ones before found full, whatever the keys in work
LOOKAHEAD = 256
#: the live slots a key without a limit of its own passes over at (a queue with only a
#: queue's limit: none of its keys has slots)
MAX_SLOTS = 2**31 - 1
#: seconds between two sweeps of a table's dead slots by one process
SWEEP_INTERVAL = 60.0


def limit_key_of(message: dict[str, Any]) -> str | None:
    """The key a message names (property, else header), put in its headers where a claim
    reads it; a key that is no non-empty string of at most :data:`MAX_LIMIT_KEY`
    characters of UTF-8 without NUL is refused before anything is written: a lone
    surrogate reaches the envelope as a JSON escape that PostgreSQL and SQLite fail every
    claim of the queue on, and MariaDB reads as no key."""
    headers = message.get("headers")
    if headers is None:
        headers = message["headers"] = {}
    key = message["properties"].get(KEY_PROPERTY)
    if key is None:
        key = headers.get(KEY_PROPERTY)
    if key is None:
        headers.pop(KEY_PROPERTY, None)
        return None
    if (not isinstance(key, str) or not key or len(key) > MAX_LIMIT_KEY or "\x00" in key
            or not _utf8(key)):
        raise ConfigurationError(
            f"limit_key must be a non-empty string of at most {MAX_LIMIT_KEY} characters "
            f"without NUL or lone surrogates, got {type(key).__name__} {str(key)[:80]!r}")
    headers[KEY_PROPERTY] = key
    return key


def _utf8(key: str) -> bool:
    """Whether ``key`` is UTF-8 text: it holds no lone surrogate."""
    if key.isascii():
        return True
    try:
        key.encode()
    except UnicodeEncodeError:
        return False
    return True


def limit_of(options: QueueOptions, key: str) -> int | None:
    """The limit of ``key`` on a queue: its longest matching prefix's, else ``"*"``'s."""
    for prefix, limit in options.concurrency_limits:
        if prefix == "*" or key.startswith(prefix):
            return limit
    return None


def limited(options: QueueOptions) -> bool:
    return bool(options.concurrency_limits) or options.max_in_work is not None


@dataclass
class Slots:
    """One key's slots as read: how many are held, and the free ones (slot number, the
    holder it was seen with or None: never taken)."""

    limit: int
    live: int
    free: list[tuple[int, tuple[int, int] | None]]

    def available(self) -> bool:
        return self.live < self.limit and bool(self.free)

    @classmethod
    def read(cls, seen: Iterable[Sequence[int]], limit: int, wanted: int) -> Slots:
        """A key's slots from the ``(slot, holder_id, holder_attempt, live)`` of each it
        has: of the free ones, the first ``wanted`` (a claim takes no more), found by
        walking the slot numbers lazily -- a limit may be far larger than anything in
        work."""
        held: dict[int, tuple[int, int] | None] = {}
        live = 0
        for slot, holder, attempt, alive in seen:
            live += bool(alive)
            held[slot] = None if alive else (holder, attempt)  # None: not free
        free = list(islice(((slot, held.get(slot)) for slot in range(limit)
                            if slot not in held or held[slot] is not None), wanted))
        return cls(limit, live, free)

    def take(self) -> tuple[int, tuple[int, int] | None] | None:
        if not self.available():
            return None
        self.live += 1
        return self.free.pop(0)


def parsed(listed: str | None) -> list[tuple[int, ...]]:
    """The slots a candidate row brings (:attr:`.LimitedClaim.candidates`)."""
    return [tuple(int(part) for part in each.split(":")) for each in
            (listed.split(",") if listed else ())]


class Limiter:
    """Claims of the queues with limits on one database and table prefix."""

    def __init__(self, database: Database, keeper: LeaseKeeper, options: TransportOptions,
                 run_claim: ClaimRunner | None = None,
                 run_statement: ClaimRunner | None = None) -> None:
        self.database, self.dialect, self.keeper = database, database.dialect, keeper
        #: run a claim's transaction, and a claim of one statement: by default a
        #: transaction of the pool's whose commit does not wait for the disk; the broker's
        #: :meth:`.Wakeup.claim_in_transaction` and :meth:`.Wakeup.claim`
        self.run_claim: ClaimRunner = run_claim or database.run_fenced
        self.run_statement: ClaimRunner = run_statement or database.run_fenced
        self.prefix, self.create = options.table_prefix, options.create_tables
        self.sql: LimitStatements = self.dialect.limit_statements(self.prefix)
        self.name = self.sql.names[0]
        self._ready = False
        self._swept: dict[str, float] = {}
        #: tables whose last claim took rows: the next claims without a read first
        self._busy: set[QueueTable] = set()
        self._lock = threading.Lock()
        keeper.give_back = self.give_back  # rows given back let go of their slots

    def check(self, table: QueueTable) -> None:
        """Refuse a queue whose rows are no envelopes the transport writes."""
        spec = table.spec
        if (table.transient or spec.publish is not None or spec.plain
                or spec.rows is not None or not spec.has(Role.HEADERS)):
            raise ConfigurationError(
                f"queue {table.queue!r}: concurrency limits need a queue table with a headers "
                "column storing Celery's messages (not a transient queue, a declared publish "
                "statement, row mode or plain rows)")

    def claim(self, table: QueueTable, limit: int, skip: Sequence[Any] = (),
              ids: Sequence[int] | None = None) -> list[ClaimedRow]:
        """Lease up to ``limit`` rows of ``table`` (of ``ids`` only, when given) within its
        limits (see the module). A transient queue (replies, remote control) has none,
        whatever the defaults say."""
        if table.transient:
            return table.claims.claim(table, limit, skip)
        self.check(table)
        self.ensure()
        probe = self.dialect.statements(table.spec).any_ready
        if probe is not None and table not in self._busy and self.database.run(
                lambda conn: conn.execute(probe).first(), read_only=True) is None:
            return []  # as the lease claim does after a claim that took nothing
        self._sweep(table)
        # the settlements queued so far (a busy consumer's acks) are written with the claim,
        # as the lease claim's are (in its statement, its transaction, or just before it on
        # the LISTEN connection): no commit of their own, and the slots of the rows they
        # complete are free to this very claim
        reads = self.dialect.limited_claim(table.spec, self.prefix)
        more, congested = True, False
        if (reads.whole is not None and not skip and ids is None
                and table.options.max_in_work is None):
            def one(conn: Connection) -> list[ClaimedRow]:
                return completing(conn, 0, [])[1]

            def completing(conn: Connection, attempt: int,
                           acked: list[int]) -> tuple[int, list[ClaimedRow]]:
                nonlocal more
                touched, rows, more = self._claim_whole(conn, table, reads, limit,
                                                        attempt, acked)
                return touched, rows

            rows = self.keeper.folded(one, self.run_statement, (table, completing))
            congested = more  # its windows held full keys' rows only
        if more:
            rows = self.keeper.folded(
                lambda conn: self._claim(conn, table, limit, set(skip), ids, congested),
                self.run_claim)
        if rows:
            self._busy.add(table)
        else:
            self._busy.discard(table)
        self.keeper.hold(table, rows)
        return rows

    def _claim_whole(self, conn: Connection, table: QueueTable, reads: LimitedClaim,
                     limit: int, attempt: int, acked: list[int]
                     ) -> tuple[int, list[ClaimedRow], bool]:
        """Claim in one statement (:attr:`.LimitedClaim.whole`; completing the rows
        ``acked`` held at ``attempt`` first, when there are any), read again over a
        window :data:`OVERSCAN` times as long when the first was of full keys only: the
        rows completed, the rows leased, and whether to claim again by several statements
        (none leased, and that window too was of full keys only: those pass over the
        keys found full)."""
        limits = table.options.concurrency_limits
        params = self.dialect.claim_parameters(
            conn, table.spec, limit, table.options.visibility_timeout, wanted=limit,
            queue_table=spec_name(table.spec), prefixes=[prefix for prefix, _ in limits],
            limits=[n for _, n in limits], attempt=attempt, ids=acked)
        completed = 0
        for window in (limit * OVERSCAN, limit * OVERSCAN**2):
            statement = reads.whole_completing if acked else reads.whole
            assert statement is not None  # the caller checked: both or neither
            found = self.dialect.execute(conn, statement, {**params, "limit": window}).all()
            if acked:
                completed = self.dialect.completed_all(
                    conn, self.dialect.statements(table.spec).complete, params,
                    int(found[0].completed))
                acked = []
            rows = [row for row in found if row.id is not None]
            if rows or found[0].seen < window:
                return completed, self.dialect.claimed(table.spec, rows), False
        return completed, [], True

    def _claim(self, conn: Connection, table: QueueTable, limit: int, skip: set[Any],
               ids: Sequence[int] | None = None, congested: bool = False
               ) -> list[ClaimedRow]:
        """Lease up to ``limit`` rows within the limits, in windows of candidates each
        passing over the keys found full so far. Once a window leaves the claim short (or
        the caller found the queue's head ``congested`` already), the next round first
        looks ahead (:meth:`_ahead`, once a claim): the rows of many full keys, each with
        a few rows waiting (bursts of many tenants in work), would fill every window."""
        options, spec = table.options, table.spec
        reads = self.dialect.limited_claim(spec, self.prefix)
        name = spec_name(spec)
        queue = None
        if options.max_in_work is not None:
            queue = self._slots(conn, reads, name, QUEUE_SLOTS, options.max_in_work, limit)
            if not queue.available():
                return []  # the queue's limit is reached: no row is read
        # keys holding as many live slots as the largest limit are full whatever their
        # prefix: the read passes over their rows
        most = max((n for _, n in options.concurrency_limits), default=MAX_SLOTS)
        slots: dict[str, Slots] = {}
        full: set[str] = set()
        plans: dict[int, list[tuple[str, int, tuple[int, int] | None]]] = {}
        floor = self.dialect.claim_floor(conn, spec)
        looked = ids is not None or not options.concurrency_limits  # none to look for
        params = {"floor": floor, "queue_table": name, "most": most}
        for _ in range(ROUNDS):
            if congested and not looked:
                full |= self._ahead(conn, reads, options, params, full)
                looked = True
            window = (limit - len(plans)) * OVERSCAN
            found = conn.execute(reads.candidates if ids is None else reads.among, {
                **params, "limit": window, "full": sorted(full),
                **({} if ids is None else {"ids": list(ids)})}).all()
            for row in found:
                # a key as text: a row sent before keys were checked may hold a number
                row_id, key = row[0], None if row[1] is None else str(row[1])
                # a key found full (as the look ahead saw its text: SQLite writes a
                # real's differently, so its rows may still come) never gets a row
                if row_id in plans or key in full or (len(row) > 3 and row[3] in skip):
                    continue
                if queue is not None and not queue.available():
                    break
                plan = []
                if key is not None and key not in slots and key not in full:
                    n = limit_of(options, key)
                    if n is not None:
                        slots[key] = Slots.read(parsed(row[2]), n, limit)
                if key in slots:
                    taken = slots[key].take()
                    if taken is None:
                        full.add(key)
                        continue
                    plan.append((digest(key), *taken))
                if queue is not None:
                    plan.append((QUEUE_SLOTS, *queue.free.pop(0)))
                    queue.live += 1
                plans[row_id] = plan
                if len(plans) == limit:
                    break
            if len(plans) == limit or len(found) < window or (
                    queue is not None and not queue.available()):
                break
            congested = True  # a window that left the claim short
        if not plans:
            return []
        return self._take(conn, table, plans)

    @staticmethod
    def _ahead(conn: Connection, reads: LimitedClaim, options: QueueOptions,
               params: dict[str, Any], full: set[str]) -> set[str]:
        """The keys at their limit among those of the next :data:`LOOKAHEAD` ready rows
        past the ``full`` ones (:attr:`.LimitedClaim.ahead`; their slots read by key),
        looked at again past them while every row seen was of a full key (up to
        :data:`ROUNDS` looks; none past the last ready row)."""
        found: set[str] = set()
        for _ in range(ROUNDS):
            keys = [None if key is None else str(key) for (key,) in conn.execute(
                reads.ahead, {**params, "limit": LOOKAHEAD, "full": sorted(full | found)})]
            limits = {digest(key): (key, n) for key in set(keys) if key is not None
                      and (n := limit_of(options, key)) is not None}
            live = Counter(row[0] for row in conn.execute(reads.holders, {
                "queue_table": params["queue_table"], "keys": sorted(limits)})
                if row[4]) if limits else Counter()
            now_full = {key for held, (key, n) in limits.items() if live[held] >= n}
            found |= now_full
            if len(keys) < LOOKAHEAD or any(key not in now_full for key in keys):
                break  # the last ready row, or rows a claim can take
        return found

    def _slots(self, conn: Connection, reads: LimitedClaim, name: str, key: str,
               limit: int, wanted: int) -> Slots:
        """The slots of ``key`` (a queue's own limit's) with its ``limit``, as read now."""
        return Slots.read([row[1:] for row in conn.execute(reads.holders, {
            "queue_table": name, "keys": [key]})], limit, wanted)

    def _take(self, conn: Connection, table: QueueTable,
              plans: dict[int, list[tuple[str, int, tuple[int, int] | None]]]
              ) -> list[ClaimedRow]:
        """Lease the planned rows and take their slots: one INSERT of the slots never
        taken, one compare-and-set UPDATE of those seen free, each in one order for every
        claimer; when they wrote fewer, read which are this claim's. A row that lost a
        slot goes back uncounted, with the slots it took (:meth:`give_back`)."""
        spec, name, dialect = table.spec, spec_name(table.spec), self.dialect
        lease = table.options.visibility_timeout
        planned = sorted((key, slot, seen, row_id) for row_id, plan in plans.items()
                         for key, slot, seen in plan)
        both = dialect.claim_and_take(conn, spec, self.prefix, lease, sorted(plans),
                                      planned, name) if planned else None
        if both is None:
            rows = dialect.claim(conn, spec, len(plans), lease, ids=sorted(plans))
        else:
            rows, written = both
        by_id = {row.id: row for row in rows}
        steps = [step for step in planned if step[3] in by_id]
        if not steps:
            return rows
        if both is None:
            written = self._write_slots(conn, name, steps, by_id)
        if written == len(steps):
            return rows  # every slot written: each is this claim's
        holders = {(key, slot): (holder, attempt) for key, slot, holder, attempt in
                   conn.execute(self.sql.held, {"queue_table": name,
                                                "keys": sorted({step[0] for step in steps})})}
        lost = {row_id for key, slot, _, row_id in steps
                if holders.get((key, slot)) != (row_id, by_id[row_id].attempt)}
        tokens: dict[int, list[int]] = defaultdict(list)
        for row_id in lost:
            tokens[by_id[row_id].attempt].append(row_id)
        self.give_back(conn, table, tokens)
        return [row for row in rows if row.id not in lost]

    def _write_slots(self, conn: Connection, name: str,
                     steps: list[tuple[str, int, tuple[int, int] | None, int]],
                     by_id: dict[int, ClaimedRow]) -> int:
        """Take the slots of ``steps`` for the rows leased: how many were written."""
        written = 0
        for stealing in (False, True):
            batch = [step for step in steps if (step[2] is not None) is stealing]
            if not batch:
                continue
            params: dict[str, Any] = {"queue_table": name}
            for n, (key, slot, seen, row_id) in enumerate(batch):
                params.update({f"k{n}": key, f"s{n}": slot, f"h{n}": row_id,
                               f"a{n}": by_id[row_id].attempt})
                if seen is not None:
                    params.update({f"e{n}": seen[0], f"f{n}": seen[1]})
            build = self.dialect.steal_slots if stealing else self.dialect.take_slots
            written += conn.execute(build(self.prefix, len(batch)), params).rowcount
        return written

    def give_back(self, conn: Connection, table: QueueTable, tokens: dict[int, list[int]]
                  ) -> int:
        """Give the rows ``tokens`` (ids by attempt) back uncounted, with the slots they
        hold, in ``conn``'s transaction; how many rows went back. A row given back takes
        its attempt back: claimed again, it is the very holder its old slot names, so a
        claim that saw that slot free would take it from under the row (its
        compare-and-set finds the holder it saw) and the key would pass its limit. The
        keeper gives every row back through here."""
        dialect = self.dialect
        if table.transient or not limited(table.options):
            return dialect.settle(conn, dialect.statements(table.spec).release_uncounted,
                                  tokens)
        first, *then = dialect.limited_claim(table.spec, self.prefix).give_back
        name = {"queue_table": spec_name(table.spec)}
        back = dialect.settle(conn, first, tokens, name)
        for statement in then:
            dialect.settle(conn, statement, tokens, name)
        return back

    def dropped(self, conn: Connection, spec: TableSpec) -> None:
        """Drop the slots of a queue table dropped in ``conn``'s transaction (see
        :attr:`.LimitStatements.dropped`), where there is a slots' table."""
        if self._ready or inspect(conn).has_table(self.name):
            conn.execute(self.sql.dropped, {"queue_table": spec_name(spec)})

    def _sweep(self, table: QueueTable) -> None:
        """Drop the slots of ``table`` whose holders are no longer in work, at most every
        :data:`SWEEP_INTERVAL` seconds (a key's free slots are otherwise kept for its next
        rows: only keys that come and go leave them behind)."""
        now = time.monotonic()
        name = spec_name(table.spec)
        if now - self._swept.get(name, -SWEEP_INTERVAL) < SWEEP_INTERVAL:
            return
        self._swept[name] = now
        reads = self.dialect.limited_claim(table.spec, self.prefix)

        def sweep(conn: Connection) -> None:
            for key, slot, holder, attempt, _ in conn.execute(
                    reads.dead, {"queue_table": name}).all():
                conn.execute(self.sql.forget, {
                    "queue_table": name, "limit_key": key, "slot": slot,
                    "seen_id": holder, "seen_attempt": attempt})

        self.database.run(sweep, durable=False, repeatable=True)

    def missing(self) -> str:
        return (f"table {self.name!r} does not exist (create_tables is off): no queue with "
                f"concurrency limits can be claimed; create it with:\n{';'.join(self.sql.ddl)};")

    def ensure(self) -> None:
        """The slots' table, created where the transport creates tables, else required."""
        if self._ready:
            return
        with self._lock:
            if self.database.run(lambda conn: inspect(conn).has_table(self.name),
                                 read_only=True):
                self._ready = True
                return
            if not self.create:
                raise SchemaMismatch(self.missing())

            def make(conn: Connection) -> None:
                for statement in self.sql.ddl:
                    conn.exec_driver_sql(statement)

            try:
                self.database.run(make)
            except DBAPIError:  # another process created it at the same moment
                self.database.run(make)
            self._ready = True


def spec_name(spec: TableSpec) -> str:
    """The slots' name of a queue table (schema-qualified where it has one)."""
    return f"{spec.schema}.{spec.table}" if spec.schema else spec.table
