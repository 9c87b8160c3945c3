"""Concurrency limits' statements: the slots table, and the claim of a queue with limits.

A slot is a row ``(queue_table, limit_key, slot)`` naming its holder: a queue row by id
and attempt. It is free when that holder is no longer in work under that attempt: gone
(acknowledged), given back, claimed again, or its lease lapsed -- read by joining the
queue table, never by a lock or a flag someone must clear. A slot changes hands only by
a compare-and-set on the holder it was seen with, so of two claimers that saw it free one
takes it.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import String, TextClause, bindparam, text
from sqlalchemy.engine import Engine

from ..roles import check_identifier
from ..tables import Role, TableSpec
from .queue import QueueFamily
from .schedules import ScheduleFamily
from .unique import UniqueFamily

#: the slots' table under a table prefix
LIMIT_TABLE = "limit_slots"
#: values the schema check binds to every statement it plans
PLAN_PARAMS = {"queue_table": "-", "limit_key": "-", "keys": ["-"], "slot": 0,
               "seen_id": 0, "seen_attempt": 0, "ids": [0], "attempt": 0}


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

    #: ``id, limit_key[, partition_key]`` of the first ``:limit`` ready rows in claim
    #: order whose key is not among the ``:full`` ones, locked (skipping locked rows)
    candidates: TextClause
    #: ``limit_key, slot, holder_id, holder_attempt, live`` of the slots of ``:keys``
    holders: TextClause
    #: the same of up to 500 slots whose holder is no longer in work
    dead: TextClause
    #: the rows ``:ids`` at ``:attempt`` given back uncounted with the slots they hold
    #: (:attr:`LimitStatements.release`), in this order in one transaction; the first
    #: statement's count is the rows'
    give_back: tuple[TextClause, ...]


class LimitFamily(QueueFamily, UniqueFamily, ScheduleFamily):
    """The slots' statements (built once per table prefix) and a limited claim's reads
    (once per table and prefix)."""

    def __init__(self, engine: Engine | None = None) -> None:
        super().__init__(engine)
        self._limits: dict[str, LimitStatements] = {}
        self._limited: dict[tuple[TableSpec, str], LimitedClaim] = {}
        self._batches: dict[tuple[str, str, int], TextClause] = {}

    def limit_key_of(self, column: str) -> str:
        """SQL: the limit key in the envelope a headers column holds (NULL: none)."""
        raise NotImplementedError

    def exact_key(self, key: str) -> str:
        """SQL: the key ``key`` as compared with the keys a claim found full, character
        for character."""
        return key

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

    def limited_claim(self, spec: TableSpec, prefix: str) -> LimitedClaim:
        cached = self._limited.get((spec, prefix))
        if cached is None:
            cached = self._limited[(spec, prefix)] = self.build_limited(spec, prefix)
        return cached

    def build_limited(self, spec: TableSpec, prefix: str) -> LimitedClaim:
        f = self.fields(spec)
        slots = self.quote(LimitStatements.tables(prefix)[0])
        key = self.limit_key_of(f"r.{f['headers']}")
        columns = [f"r.{f['id']}", key]
        if spec.has(Role.PARTITION_KEY):
            columns.append(f"r.{f['partition_key']}")
        # locked, skipping rows locked by other claims: claimers reading at once take
        # different rows, as the plain claim's do, not the same few one after another
        candidates = self.ordered_select(spec, columns, (
            f"WHERE {self.ready_filter(spec)}{self.above_floor(spec)} "
            f"AND ({key} IS NULL OR {self.exact_key(key)} NOT IN :full) "
            f"ORDER BY {self.claim_order(spec, 'r')} LIMIT :limit"),
            f" {self.lock_clause}" if self.lock_clause else "")
        live = (f"LEFT JOIN {f['table']} AS h ON h.{f['id']} = s.holder_id "
                f"AND h.{f['attempt']} = s.holder_attempt "
                f"AND h.{f['locked_until']} >= {self.now}{self.unfinished(spec, 'h')}")
        read = (f"SELECT s.limit_key, s.slot, s.holder_id, s.holder_attempt, "
                f"CASE WHEN h.{f['id']} IS NULL THEN 0 ELSE 1 END FROM {slots} AS s {live} "
                "WHERE s.queue_table = :queue_table AND ")
        return LimitedClaim(
            candidates=self.clocked(text(candidates).bindparams(
                bindparam("full", expanding=True, type_=String()))),
            holders=self.clocked(text(read + "s.limit_key IN :keys").bindparams(
                bindparam("keys", expanding=True, type_=String()))),
            dead=self.clocked(text(read + f"h.{f['id']} IS NULL LIMIT 500")),
            give_back=self.limited_give_back(self.statements(spec).release_uncounted,
                                             self.limit_statements(prefix).release),
        )

    def limited_give_back(self, uncounted: TextClause,
                          release: TextClause) -> tuple[TextClause, ...]:
        """:attr:`LimitedClaim.give_back`: the rows' release, then their slots'."""
        return (uncounted, release)
