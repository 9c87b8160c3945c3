"""Concurrency limits' statements: the slots table, and the claim of a queue with limits.

A slot is a row ``(queue_table, limit_key, slot)`` naming its holder: a queue row by id
and attempt. It is free when that holder is no longer in work under that attempt: gone
(acknowledged), given back, claimed again, or its lease lapsed -- read by joining the
queue table, never by a lock or a flag someone must clear. A slot changes hands only by
a compare-and-set on the holder it was seen with, so of two claimers that saw it free one
takes it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, String, TextClause, bindparam, text
from sqlalchemy.engine import Engine

from ..roles import check_identifier
from ..rows import ClaimedRow
from ..tables import Role, TableSpec
from .queue import QueueFamily
from .schedules import ScheduleFamily
from .unique import UniqueFamily

#: the slots' table under a table prefix
LIMIT_TABLE = "limit_slots"
#: values the schema check binds to every statement it plans
PLAN_PARAMS = {"queue_table": "-", "limit_key": "-", "keys": ["-"], "slot": 0,
               "seen_id": 0, "seen_attempt": 0, "ids": [0], "attempt": 0}


def digest(key: str) -> str:
    """The slots' name of the limit key ``key``."""
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True)
class LimitStatements:
    """The statements on the slots' table of one table prefix (a claim's takes and steals,
    of any number of slots, are built by :meth:`LimitFamily.take_slots` and
    :meth:`LimitFamily.steal_slots`)."""

    names: tuple[str]
    ddl: list[str]
    drop: list[str]
    #: ``limit_key, slot, holder_id, holder_attempt`` of the slots of ``:keys``, as this
    #: transaction sees them: which of the slots a claim wrote are its own
    held: TextClause
    #: a slot seen held by ``:seen_id`` at ``:seen_attempt`` dropped (a dead holder's slot
    #: swept)
    forget: TextClause
    #: the slots held by the rows ``:ids`` at ``:attempt`` dropped, as those rows are
    #: given back uncounted (their attempt taken back) in the same transaction
    release: TextClause
    #: every slot of ``:queue_table``, dropped with that table: the next table of its name
    #: numbers its rows from 1 again, and would find them named as holders
    dropped: TextClause

    @staticmethod
    def tables(prefix: str) -> tuple[str]:
        return (check_identifier(prefix + LIMIT_TABLE, "table"),)


@dataclass(frozen=True)
class LimitedClaim:
    """The reads of a claim of one queue table with limits."""

    #: ``id, limit_key, slots[, partition_key]`` of the first ``:limit`` ready rows in
    #: claim order whose key is not among the ``:full`` ones, locked (skipping locked
    #: rows); ``slots`` lists its key's slots (:meth:`LimitFamily.slot_list`). Where the
    #: scan reads the slots (:attr:`LimitFamily.slots_in_scan`), it passes over the rows
    #: of keys holding ``:most`` live slots too (neither read on nor locked)
    candidates: TextClause
    #: the same among the rows of ``:ids`` (those a rate-limited task's tokens allow)
    among: TextClause
    #: ``limit_key, slot, holder_id, holder_attempt, live`` of the slots of ``:keys`` (a
    #: queue's own limit's)
    holders: TextClause
    #: the same of up to 500 slots whose holder is no longer in work
    dead: TextClause
    #: the limit keys of the first ``:limit`` ready rows the candidates would read on
    #: to (past the ``:full`` keys, and where the scan reads slots past keys holding
    #: ``:most``), none locked: a look ahead at the keys a congested head holds
    ahead: TextClause
    #: the rows ``:ids`` at ``:attempt`` given back uncounted with the slots they hold
    #: (:attr:`LimitStatements.release`), in this order in one transaction; the first
    #: statement's count is the rows'
    give_back: tuple[TextClause, ...]
    #: the whole claim in one statement, where the database has one
    #: (:meth:`LimitFamily.whole_claim`); and the same completing the rows ``:ids`` held
    #: at ``:attempt`` first (``completed``: how many)
    whole: TextClause | None = None
    whole_completing: TextClause | None = None


class LimitFamily(QueueFamily, UniqueFamily, ScheduleFamily):
    """The slots' statements (built once per table prefix) and a limited claim's reads
    (once per table and prefix)."""

    def __init__(self, engine: Engine | None = None) -> None:
        super().__init__(engine)
        self._limits: dict[str, LimitStatements] = {}
        self._limited: dict[tuple[TableSpec, str], LimitedClaim] = {}
        self._batches: dict[tuple[str, str, int], TextClause] = {}
        self._taking: dict[tuple[TableSpec, str, int], TextClause | None] = {}

    def limit_key_of(self, column: str) -> str:
        """SQL: the limit key in the envelope a headers column holds (NULL: none)."""
        raise NotImplementedError

    #: whether a limited claim's candidates read takes each row's slots in its scan,
    #: passing over the rows of full keys (else the slots of the rows it picked, in the
    #: same statement: :meth:`slots_after`)
    slots_in_scan = True

    def key_digest(self, key: str) -> str:
        """SQL: the slots' name of the key ``key`` (text): the hex SHA-256 of its UTF-8,
        as :func:`digest` computes it (MariaDB/MySQL's here: in the slots' column's
        character set and collation, so the comparison uses its primary key)."""
        return f"CONVERT(SHA2({key}, 256) USING ascii) COLLATE ascii_bin"

    def slot_list(self, parts: Sequence[str]) -> str:
        """SQL: the aggregate of ``parts`` (integers) of each row, joined by ``:``, the
        rows by ``,`` (MariaDB/MySQL's here)."""
        return f"GROUP_CONCAT(CONCAT_WS(':', {', '.join(parts)}))"

    def limit_statements(self, prefix: str) -> LimitStatements:
        cached = self._limits.get(prefix)
        if cached is None:
            cached = self._limits[prefix] = self.build_limits(prefix)
        return cached

    def build_limits(self, prefix: str) -> LimitStatements:
        names = LimitStatements.tables(prefix)
        slots = self.quote(names[0])
        queue_type, key_type = self.key_types[:2]
        return LimitStatements(
            names=names,
            ddl=self.limit_ddl([
                f"CREATE TABLE IF NOT EXISTS {slots} (queue_table {queue_type} NOT NULL, "
                f"limit_key {key_type} NOT NULL, slot INTEGER NOT NULL, "
                "holder_id BIGINT NOT NULL, holder_attempt INTEGER NOT NULL, "
                "PRIMARY KEY (queue_table, limit_key, slot))",
                f"CREATE INDEX IF NOT EXISTS {self.quote(names[0] + '_holder')} ON {slots} "
                "(queue_table, holder_id)"]),
            drop=[f"DROP TABLE IF EXISTS {slots}"],
            held=text(f"SELECT limit_key, slot, holder_id, holder_attempt FROM {slots} "
                      "WHERE queue_table = :queue_table AND limit_key IN :keys").bindparams(
                          bindparam("keys", expanding=True, type_=String())),
            forget=text(f"DELETE FROM {slots} WHERE queue_table = :queue_table "
                        "AND limit_key = :limit_key AND slot = :slot "
                        "AND holder_id = :seen_id AND holder_attempt = :seen_attempt"),
            release=text(f"DELETE FROM {slots} WHERE queue_table = :queue_table "
                         "AND holder_attempt = :attempt AND holder_id IN :ids").bindparams(
                             bindparam("ids", expanding=True)),
            dropped=text(f"DELETE FROM {slots} WHERE queue_table = :queue_table"),
        )

    def limit_ddl(self, statements: list[str]) -> list[str]:
        """The slots' table and its index of holders, as this database writes them."""
        return statements

    def _batch(self, kind: str, prefix: str, count: int) -> TextClause:
        """The statement ``kind`` (take or steal) of ``count`` slots, built once."""
        cached = self._batches.get((kind, prefix, count))
        if cached is None:
            build = self._take_slots if kind == "take" else self._steal_slots
            cached = self._batches[(kind, prefix, count)] = build(prefix, count)
        return cached

    def take_slots(self, prefix: str, count: int) -> TextClause:
        return self._batch("take", prefix, count)

    def steal_slots(self, prefix: str, count: int) -> TextClause:
        return self._batch("steal", prefix, count)

    def _take_slots(self, prefix: str, count: int) -> TextClause:
        """``count`` slots nobody held yet, each ``(:k<n>, :s<n>)`` for ``:h<n>`` at
        ``:a<n>``; one taken meanwhile by another claim is left as it is."""
        slots = self.quote(LimitStatements.tables(prefix)[0])
        rows = ", ".join(f"(:queue_table, :k{n}, :s{n}, :h{n}, :a{n})" for n in range(count))
        insert = self.insert_new(slots, "queue_table, limit_key, slot, holder_id, "
                                 "holder_attempt", "{}", "queue_table, limit_key, slot")
        return text(insert.replace("({})", rows))

    def _steal_slots(self, prefix: str, count: int) -> TextClause:
        """``count`` slots, each ``(:k<n>, :s<n>)`` seen held by ``:e<n>`` at ``:f<n>`` (no
        longer in work), for ``:h<n>`` at ``:a<n>``: a compare-and-set on the holder seen,
        so a slot another claim took meanwhile is left as it is."""
        slots = self.quote(LimitStatements.tables(prefix)[0])
        which = [f"limit_key = :k{n} AND slot = :s{n}" for n in range(count)]

        def new(column: str, value: str) -> str:
            cases = " ".join(f"WHEN {each} THEN :{value}{n}" for n, each in enumerate(which))
            return f"{column} = CASE {cases} END"

        seen = " OR ".join(f"({each} AND holder_id = :e{n} AND holder_attempt = :f{n})"
                           for n, each in enumerate(which))
        return text(f"UPDATE {slots} SET {new('holder_id', 'h')}, "
                    f"{new('holder_attempt', 'a')} WHERE queue_table = :queue_table "
                    f"AND ({seen})")

    def claim_taking(self, spec: TableSpec, prefix: str, count: int) -> TextClause | None:
        """:meth:`build_claim_taking`, built once."""
        key = (spec, prefix, count)
        if key not in self._taking:
            self._taking[key] = self.build_claim_taking(spec, prefix, count)
        return self._taking[key]

    def build_claim_taking(self, spec: TableSpec, prefix: str,
                           count: int) -> TextClause | None:
        """The lease of the rows ``:ids`` (:attr:`.Statements.claim_ids`) and the take of
        ``count`` slots for them in one statement, where the database has one: slot
        ``(:k<n>, :s<n>)`` for row ``:h<n>`` at the attempt its lease gave it, never held
        (``:e<n>`` NULL) or seen held by ``:e<n>`` at ``:f<n>`` (compare-and-set, as
        :meth:`take_slots` and :meth:`steal_slots`). It returns the leased rows, each with
        ``written``: how many of the slots it wrote (those of rows not leased are not)."""
        return None

    def claim_and_take(self, conn: Connection, spec: TableSpec, prefix: str, lease: float,
                       ids: Sequence[int], steps: Sequence[tuple[str, int, Any, int]],
                       queue_table: str) -> tuple[list[ClaimedRow], int] | None:
        """Run :meth:`claim_taking` of ``steps`` (key, slot, holder seen or None, row
        id): the rows leased and the slots written; None where there is no such
        statement."""
        statement = self.claim_taking(spec, prefix, len(steps))
        if statement is None:
            return None
        params = self.claim_parameters(conn, spec, len(ids), lease, ids=list(ids),
                                       queue_table=queue_table)
        for n, (key, slot, seen, row_id) in enumerate(steps):
            params.update({f"k{n}": key, f"s{n}": slot, f"h{n}": row_id,
                           f"e{n}": None if seen is None else seen[0],
                           f"f{n}": None if seen is None else seen[1]})
        rows = list(self.execute(conn, statement, params).all())
        return self.claimed(spec, rows), int(rows[0].written) if rows else 0

    def limited_claim(self, spec: TableSpec, prefix: str) -> LimitedClaim:
        cached = self._limited.get((spec, prefix))
        if cached is None:
            cached = self._limited[(spec, prefix)] = self.build_limited(spec, prefix)
        return cached

    def build_limited(self, spec: TableSpec, prefix: str) -> LimitedClaim:
        f = self.fields(spec)
        slots = self.quote(LimitStatements.tables(prefix)[0])
        key = self.limit_key_of(f"r.{f['headers']}")
        holder = (f"{f['table']} AS h ON h.{f['id']} = s.holder_id "
                  f"AND h.{f['attempt']} = s.holder_attempt "
                  f"AND h.{f['locked_until']} >= {self.now}{self.unfinished(spec, 'h')}")
        alive = f"CASE WHEN h.{f['id']} IS NULL THEN 0 ELSE 1 END"
        # the slots of a candidate's key, by the slots' primary key: each row brings its
        # key's slots (no read of them after), and a full key's rows are passed over
        # before they are locked
        def its_slots(join: str, of: str) -> str:
            return (f"FROM {slots} AS s {join}JOIN {holder} WHERE s.queue_table = "
                    f":queue_table AND s.limit_key = {self.key_digest(of)}")

        parts = ["s.slot", "s.holder_id", "s.holder_attempt", alive]

        def listed(of: str) -> str:
            return f"(SELECT {self.slot_list(parts)} {its_slots('LEFT ', of)})"

        live = f"(SELECT COUNT(*) {its_slots('', key)})"
        in_scan = self.slots_in_scan
        columns = [f"r.{f['id']}", key, *([listed(key)] if in_scan else [])]
        if spec.has(Role.PARTITION_KEY):
            columns.append(f"r.{f['partition_key']}")
        # locked, skipping rows locked by other claims: claimers reading at once take
        # different rows, as the plain claim's do, not the same few one after another
        def picking(among: str, columns: list[str], full: bool = True,
                    index: str = "claim", locked: bool = True) -> str:
            passed = (f" AND ({key} IS NULL OR ({self.exact_key(key)} NOT IN :full"
                      f"{f' AND {live} < :most' if in_scan else ''}))") if full else ""
            return self.ordered_select(spec, columns, (
                f"WHERE {among}{self.ready_filter(spec)}{self.above_floor(spec)}{passed} "
                f"ORDER BY {self.claim_order(spec, 'r')} LIMIT :limit"),
                f" {self.lock_clause}" if locked and self.lock_clause else "", index)

        def candidates(among: str, index: str = "claim") -> TextClause:
            picked = picking(among, columns, index=index)
            if not in_scan:
                picked = self.slots_after(picked, len(columns), listed)
            return self.clocked(text(picked).bindparams(
                bindparam("full", expanding=True, type_=String())))

        whole = picking("", [f"r.{f['id']}", key, f"r.{f['attempt']}",
                             *self.locked_version(spec)], full=False)
        read = (f"SELECT s.limit_key, s.slot, s.holder_id, s.holder_attempt, {alive} "
                f"FROM {slots} AS s LEFT JOIN {holder} WHERE s.queue_table = :queue_table AND ")
        return LimitedClaim(
            candidates=candidates(""),
            # by ids: read through the id's index, so as to lock no row it was not given
            among=candidates(f"r.{f['id']} IN :ids AND ", "PRIMARY").bindparams(
                bindparam("ids", expanding=True)),
            holders=self.clocked(text(read + "s.limit_key IN :keys").bindparams(
                bindparam("keys", expanding=True, type_=String()))),
            dead=self.clocked(text(read + f"h.{f['id']} IS NULL LIMIT 500")),
            ahead=self.clocked(text(picking("", [key], locked=False)).bindparams(
                bindparam("full", expanding=True, type_=String()))),
            give_back=self.limited_give_back(self.statements(spec).release_uncounted,
                                             self.limit_statements(prefix).release),
            whole=self.whole_claim(spec, prefix, whole, holder),
            whole_completing=self.whole_claim(spec, prefix, whole, holder, completing=True),
        )

    def whole_claim(self, spec: TableSpec, prefix: str, picked: str, holder: str,
                    completing: bool = False) -> TextClause | None:
        """A limited claim of ``spec`` in one statement, where the database has one: of
        the rows ``picked`` (id, key, attempt; the candidates' query, locked), up to
        ``:wanted`` in claim order that find a free slot of their key (its limit the
        first of ``:prefixes`` it matches, ``:limits`` in step), their slots taken by
        compare-and-set and only the rows whose slots were written leased; ``completing``,
        the rows ``:ids`` held at ``:attempt`` completed first. It returns ``seen`` (the
        rows picked), ``completed`` (completing) and the claim's columns (NULL: none
        leased)."""
        return None

    def locked_version(self, spec: TableSpec) -> list[str]:
        """Columns a whole claim's picked rows bring after id, key and attempt: where the
        lease names rows by the version locked (:meth:`whole_claim`), that version."""
        return []

    def slots_after(self, picked: str, count: int, listed: Callable[[str], str]) -> str:
        """SQL: the ``count`` columns of the rows ``picked`` (a query: id, key, ...) with
        ``listed(key)``, their key's slots, third, in the order picked."""
        raise NotImplementedError

    def keys_in_work(self, spec: TableSpec) -> TextClause:
        """The rows of a table with headers in work per limit key (``limit_key``, NULL
        for rows without one; ``in_work``), the most first, up to ``:limit`` keys: one
        pass over the rows with a live lease, for the dashboard's limits page."""
        f = self.fields(spec)
        key = self.limit_key_of(f"r.{f['headers']}")
        return self.clocked(text(
            f"SELECT {key} AS limit_key, COUNT(*) AS in_work FROM {f['table']} AS r "
            f"WHERE r.{f['locked_until']} >= {self.now}{self.unfinished(spec, 'r')} "
            f"GROUP BY {key} ORDER BY 2 DESC, 1 LIMIT :limit"))

    def limited_give_back(self, uncounted: TextClause,
                          release: TextClause) -> tuple[TextClause, ...]:
        """:attr:`LimitedClaim.give_back`: the rows' release, then their slots'."""
        return (uncounted, release)
