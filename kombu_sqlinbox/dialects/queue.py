"""The queue's hot path: a table's compiled statements (claims, settlements, lease
extension, size, purge) and running them: publish, claim, complete and claim, settle,
extend."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from operator import itemgetter
from typing import Any

from sqlalchemy import Connection, Row, TextClause, text
from sqlalchemy.engine import Engine

from ..rows import ClaimedRow
from ..tables import Role, TableSpec
from .driver import _expanding, json_text, plain_payload
from .schema import SchemaFamily

#: attempt -> ids held with that attempt (the attempt is the lease's fencing token)
Tokens = Mapping[int, Sequence[int]]
#: seconds the floor stays below the oldest row it saw: a publish committing late (its
#: transaction's start is its ready time) or with a slightly past ETA stays above it
FLOOR_MARGIN = 10.0
#: a claim that picks candidates before it locks them (MySQL) picks this many per row
#: wanted, so that rows other claims lock at that moment leave it enough
CANDIDATES = 2

#: rows past the claim's limit a FIFO claim reads in claim order before it looks for the
#: groups' heads one group at a time: many groups claim from the window, a long group
#: behind its head in work costs the window, not its length
FIFO_WINDOW = 16


@dataclass(frozen=True)
class Statements:
    """The compiled statements of one table; built once per (dialect, spec)."""

    insert: TextClause
    claim: tuple[TextClause, ...]
    claim_ids: tuple[TextClause, ...]
    #: the claim passing over rows of the partition keys in ``:skip`` (the plain claim on
    #: a table without partition keys)
    claim_skipping: tuple[TextClause, ...]
    #: on a FIFO table, the claim of the groups' heads found one group at a time, run
    #: when :attr:`claim` (which reads only the first ``:window`` ready rows) got too few;
    #: without and with ``:skip``
    claim_heads: tuple[TextClause, ...] | None
    claim_heads_skipping: tuple[TextClause, ...] | None
    candidates: TextClause
    extend: TextClause
    complete: TextClause
    delete: TextClause
    release: TextClause
    release_uncounted: TextClause
    retry: TextClause | None
    lock_row: TextClause
    still_held: TextClause
    size: TextClause
    purge: TextClause
    drop: TextClause
    #: the epoch seconds of the table's oldest ready time (now, when it is empty), where
    #: claims take a floor (:attr:`Dialect.floor_time`); read over the whole table, and
    #: from ``:floor`` up (see :meth:`Dialect.oldest_above`)
    floor: TextClause | None = None
    floor_above: TextClause | None = None
    #: one row if any may be ready, read before a claim where claiming takes a lock for
    #: the whole database (:meth:`Dialect.any_ready`)
    any_ready: TextClause | None = None
    #: :attr:`claim` with the completion of ``:ids`` at ``:attempt`` in the same statement,
    #: where the database runs both as one (:meth:`Dialect.completing_claim`)
    claim_completing: TextClause | None = None
    #: the completion by ids, run for the rows :attr:`complete` found fewer of than it was
    #: given where it writes rows by their tuple ids (:meth:`Dialect.completion`)
    complete_again: TextClause | None = None


class QueueFamily(SchemaFamily):
    """A table's statements, and the claims and settlements a consumer runs."""

    def __init__(self, engine: Engine | None = None) -> None:
        super().__init__(engine)
        self._statements: dict[TableSpec, Statements] = {}
        #: per completion statement's text, its :attr:`Statements.complete_again`
        self._again: dict[str, TextClause] = {}

    def _clock_all(self, statements: Statements) -> Statements:
        """Every statement of a table :meth:`clocked`."""
        if self.clock is None:
            return statements

        def clock(value: Any) -> Any:
            if isinstance(value, tuple):
                return tuple(self.clocked(item) for item in value)
            return None if value is None else self.clocked(value)
        return replace(statements, **{field.name: clock(getattr(statements, field.name))
                                      for field in fields(statements)})

    def statements(self, spec: TableSpec) -> Statements:
        cached = self._statements.get(spec)
        if cached is None:
            built = self._clock_all(self.build_statements(spec))
            if built.complete_again is not None:  # before another thread can find them
                self._again[built.complete.text] = built.complete_again
            cached = self._statements[spec] = built
        return cached

    def build_statements(self, spec: TableSpec) -> Statements:
        claim = self.claim_statements(spec, self.selection(spec, False))
        skipping = claim
        if spec.has(Role.PARTITION_KEY):
            skipping = self.claim_statements(spec, self.selection(spec, False, skipping=True))
        heads = heads_skipping = None
        if self.fifo(spec):
            heads = heads_skipping = self.claim_statements(spec, self.selection(
                spec, False, heads=True))
            if spec.has(Role.PARTITION_KEY):
                heads_skipping = self.claim_statements(spec, self.selection(
                    spec, False, skipping=True, heads=True))
        return self.assemble(spec, claim, self.claim_statements(spec, self.selection(spec, True)),
                             skipping, (heads, heads_skipping))

    def claim_statements(self, spec: TableSpec, selection: str) -> tuple[TextClause, ...]:
        """The claim of the rows ``selection`` picks: lease them, bump the attempt, return
        them (see :meth:`returned_columns`), in as few round trips as the database allows."""
        raise NotImplementedError

    def assemble(self, spec: TableSpec, claim: tuple[TextClause, ...],
                 claim_ids: tuple[TextClause, ...],
                 claim_skipping: tuple[TextClause, ...],
                 claim_heads: tuple[tuple[TextClause, ...] | None,
                                    tuple[TextClause, ...] | None]) -> Statements:
        """A table's statements around its dialect-written claim. Statements on held
        rows have the same shape everywhere, fenced by (attempt, ids)."""
        f = self.fields(spec)
        fence = f"WHERE {f['attempt']} = :attempt AND {f['id']} IN :ids"
        rows, delete_rows = self.by_id(spec)
        # a row given back (released, retried, completed in place) has no lease: an
        # extension written after its settlement must not lease it again
        extend = (f"UPDATE {rows} SET {f['locked_until']} = {self.later(':lease')} "
                  f"{fence} AND {f['locked_until']} IS NOT NULL")
        retry = None
        if spec.has(Role.AVAILABLE_AT):
            retry = _expanding(
                f"UPDATE {rows} SET {f['locked_until']} = NULL, "
                f"{f['available_at']} = {self.later(':delay')} {fence}")
        one_row = (f"SELECT r.{f['id']} FROM {f['table']} AS r "
                   f"WHERE r.{f['id']} = :id AND r.{f['attempt']} = :attempt ")
        delete = f"{delete_rows} {fence}"
        complete = delete
        if spec.has(Role.PROCESSED_AT):
            complete = (
                f"UPDATE {rows} SET {f['processed_at']} = {self.now}, "
                f"{f['locked_until']} = NULL {fence}"
            )
        release = f"UPDATE {rows} SET {f['locked_until']} = NULL {fence}"
        uncounted = (
            f"UPDATE {rows} SET {f['locked_until']} = NULL, "
            f"{f['attempt']} = {f['attempt']} - 1 {fence}"
        )
        waiting = f"WHERE {f['locked_until']} IS NULL OR {f['locked_until']} < {self.now}"
        if spec.has(Role.PROCESSED_AT):
            waiting = f"WHERE ({waiting[6:]}) AND {f['processed_at']} IS NULL"
        key = f"r.{f['partition_key']}" if spec.has(Role.PARTITION_KEY) else "NULL"
        key_head = (" AND " + self.head_of(spec, Role.PARTITION_KEY)
                    if spec.has(Role.PARTITION_KEY) else "")
        floor = floor_above = None
        if self.floor_time is not None and spec.has(Role.AVAILABLE_AT):
            # never above the present: with only rows due later in the table, a floor at
            # their ready time would hide every row published until the next whole reading
            least = f"MIN({f['available_at']})"
            oldest = f"CASE WHEN {least} < {self.now} THEN {least} ELSE {self.now} END"
            floor = text(f"SELECT {self.epoch(oldest)} FROM {f['table']}")
            floor_above = text(f"SELECT {self.epoch(oldest)} FROM "
                               f"({self.oldest_above(spec)}) AS m")
        candidates = self.ordered_select(spec, [f"r.{f['id']}", key], (
            f"WHERE {self.ready_filter(spec)}{self.above_floor(spec)}"
            f"{key_head} ORDER BY {self.claim_order(spec, 'r')} LIMIT :limit"))
        complete, again = self.completion(spec, complete)
        return Statements(
            insert=self.insert_statement(spec),
            claim=claim,
            claim_ids=claim_ids,
            claim_skipping=claim_skipping,
            claim_heads=claim_heads[0],
            claim_heads_skipping=claim_heads[1],
            candidates=text(candidates),
            extend=_expanding(extend),
            retry=retry,
            lock_row=text(one_row + self.lock_clause),
            still_held=text(one_row),
            complete=_expanding(complete),
            delete=_expanding(delete),
            release=_expanding(release),
            release_uncounted=_expanding(uncounted),
            size=text(f"SELECT COUNT(*) FROM {f['table']} {waiting}"),
            purge=text(f"DELETE FROM {f['table']} {waiting}"),
            drop=text(self.drop_ddl(spec)),
            floor=floor,
            floor_above=floor_above,
            any_ready=self.any_ready(spec),
            claim_completing=self.completing_claim(spec, claim, complete),
            complete_again=None if again is None else _expanding(again),
        )

    def completion(self, spec: TableSpec, complete: str) -> tuple[str, str | None]:
        """The completion of held rows (``complete``: fenced by their attempt and ids) to
        run, and the one to run again for the rows it found fewer of than it was given;
        None where it finds them by their ids."""
        return complete, None

    def completing_claim(self, spec: TableSpec, claim: tuple[TextClause, ...],
                         complete: str) -> TextClause | None:
        """The claim ``claim`` and the fenced ``complete`` of the rows a consumer acked, as
        one statement returning the claimed rows and the completed count (``completed``, last
        on each row; a row of NULLs with it when none was claimed): a busy consumer's acks
        then cost no round trip of their own. On a FIFO table it also wakes the table's
        consumers, as :meth:`wake` after a settlement. None where the database has no
        such statement."""
        return None

    def any_ready(self, spec: TableSpec) -> TextClause | None:
        """A read that finds a row a claim could take, if there is one, run before the
        claim so that an idle consumer's rounds take no write lock; None where an empty
        claim locks nothing (a server's claim locks only the rows it takes)."""
        return None

    def publish(self, conn: Connection, spec: TableSpec, params: Sequence[dict[str, Any]]) -> None:
        conn.execute(self.statements(spec).insert, list(params))

    def claim(
        self, conn: Connection, spec: TableSpec, limit: int, lease: float,
        ids: Sequence[int] | None = None, skip: Sequence[Any] = (),
    ) -> list[ClaimedRow]:
        """Lease up to ``limit`` ready rows (or the ready ones of ``ids``; none of the
        partition keys in ``skip``) in the caller's transaction: in one ``UPDATE ...
        RETURNING`` where the database has it, else by locking the rows, then leasing them.
        On a FIFO table a claim that found too few heads in its window goes on with the
        heads found group by group (see :meth:`selection`), in the same transaction."""
        statements = self.claim_statements_for(spec, ids, skip)
        params = self.claim_parameters(conn, spec, limit, lease, ids=list(ids or ()),
                                       skip=list(skip))
        rows = self.claim_rows(conn, statements, params)
        if ids is None:
            rows = self._with_heads(conn, spec, rows, params, skip)
        return self.claimed(spec, rows, leased=self.capabilities.returning)

    def _with_heads(self, conn: Connection, spec: TableSpec, rows: list[Row[Any]],
                    params: dict[str, Any], skip: Sequence[Any]) -> list[Row[Any]]:
        """``rows``, and on a FIFO table whose claim found fewer than ``:limit`` heads in
        its window, the heads found group by group (see :meth:`selection`)."""
        compiled = self.statements(spec)
        heads = compiled.claim_heads_skipping if skip else compiled.claim_heads
        wanted = params["limit"] - len(rows)
        if heads is None or wanted <= 0:
            return rows
        return rows + self.claim_rows(conn, heads, {**params, "limit": wanted})

    def claim_parameters(self, conn: Connection, spec: TableSpec, limit: int, lease: float,
                         **given: Any) -> dict[str, Any]:
        """What a claim statement of ``spec`` binds, plus ``given``."""
        return {"limit": limit, "lease": lease, "window": limit + FIFO_WINDOW,
                "floor": self.claim_floor(conn, spec), "candidates": limit * CANDIDATES,
                **given}

    def complete_and_claim(self, conn: Connection, spec: TableSpec, limit: int, lease: float,
                           attempt: int, ids: Sequence[int]) -> tuple[int, list[ClaimedRow]]:
        """Complete the rows ``ids`` held at ``attempt`` and lease up to ``limit`` ready
        rows, in one statement (:attr:`Statements.claim_completing`, which the table must
        have): how many rows were completed, and the claimed ones."""
        statement = self.statements(spec).claim_completing
        assert statement is not None, "the table has no completing claim"
        params = self.claim_parameters(conn, spec, limit, lease, attempt=attempt,
                                       ids=list(ids))
        rows = list(self.execute(conn, statement, params).all())
        completed = self.completed_all(conn, self.statements(spec).complete, params,
                                       int(rows[0].completed))
        claimed = self._with_heads(conn, spec, [row for row in rows if row.id is not None],
                                   params, ())
        return completed, self.claimed(spec, claimed)

    def claim_rows(self, conn: Connection, statements: tuple[TextClause, ...],
                   params: dict[str, Any]) -> list[Row[Any]]:
        """The rows one claim statement (or select and lease) took."""
        if self.capabilities.returning:
            (claim,) = statements
            return list(self.execute(conn, claim, params).all())
        select, lease_rows = statements
        rows = list(self.execute(conn, select, params).all())
        if rows:
            self.execute(conn, lease_rows, {"ids": [row.id for row in rows],
                                            "lease": params["lease"]})
        return rows

    def claim_floor(self, conn: Connection, spec: TableSpec) -> float | None:
        """The ready time (epoch seconds) below which a claim of ``spec`` looks for no row.

        A queue deletes the rows it has done with in claim order, so they pile up at the
        head of the claim index; while a snapshot older than their deletion stays open
        anywhere in the database (a transaction left idle, a long report), neither vacuum
        nor InnoDB's purge can remove them, and a claim reading from the index's start
        visits every one. Below the floor it passes over them in the index alone. The
        floor is the oldest ready time of any row in the table (ready, leased, or due
        later) or the present, whichever is sooner (a row due later must not hide those
        published before it is due), less :data:`FLOOR_MARGIN`, read over the whole table
        every :attr:`floor_refresh` seconds: a row falls below it only by committing more than
        the margin after its ready time (a transaction's start, for a publish inside one)
        or with an ETA further than the margin in the past, and then waits for the next
        whole reading. That reading walks the dead rows too; in between, every
        :attr:`floor_step` seconds, the floor is read again from where it stands
        (:meth:`oldest_above`), which walks only those above it: the floor follows the
        queue's head, and a claim passes over the rows deleted in the margin and the step."""
        statements = self.statements(spec)
        if statements.floor is None or statements.floor_above is None:
            return None
        now = time.monotonic()
        known = self._floors.get(spec)
        if known is None or now - known[2] >= self.floor_refresh:
            oldest = float(conn.execute(statements.floor).scalar_one())
            known = self._floors[spec] = (oldest - FLOOR_MARGIN, now, now)
        elif now - known[1] >= self.floor_step:
            oldest = float(conn.execute(statements.floor_above, {"floor": known[0]}).scalar_one())
            known = self._floors[spec] = (max(known[0], oldest - FLOOR_MARGIN), now, known[2])
        return known[0]

    def claim_statements_for(self, spec: TableSpec, ids: Sequence[int] | None,
                             skip: Sequence[Any]) -> tuple[TextClause, ...]:
        """The claim to run: by ids, passing over keys, or plain (no empty ``NOT IN``)."""
        statements = self.statements(spec)
        if ids is not None:
            return statements.claim_ids
        return statements.claim_skipping if skip else statements.claim

    @staticmethod
    def claimed(spec: TableSpec, rows: Sequence[Row[Any]], leased: bool = True) -> list[ClaimedRow]:
        """The rows of :meth:`returned_columns`, read by label, in claim order (RETURNING
        gives none): -priority, ready time, id. Rows selected before their lease
        (``leased=False``) carry the attempt the lease then raised. Labels are resolved
        to positions once per claim, and the rows sorted by those positions (the
        priority's pass last, descending: sorts are stable): reading each row by name,
        or building a sort key for each, costs a good part of a consume."""
        if not rows:
            return []
        position = {label: at for at, label in enumerate(rows[0]._fields)}

        def read(label: str) -> Callable[[Row[Any]], Any]:
            at = position.get(label)
            return (lambda row: None) if at is None else itemgetter(at)

        ready = [position[Role.AVAILABLE_AT.value]] if spec.has(Role.AVAILABLE_AT) else []
        ordered = sorted(rows, key=itemgetter(*ready, position[Role.ID.value]))
        if spec.has(Role.PRIORITY):
            ordered.sort(key=itemgetter(position[Role.PRIORITY.value]), reverse=True)
        row_id, attempt, payload, headers, group, partition_key = (read(label) for label in (
            "id", "attempt", "payload", "headers", "group", "partition_key"))
        extra = [read(f"x{at}") for at in range(len(spec.row_columns))]
        raised = 0 if leased else 1
        return [ClaimedRow(
            id=row_id(row), attempt=attempt(row) + raised, payload=plain_payload(payload(row)),
            headers=json_text(headers(row)), group=group(row),
            partition_key=partition_key(row),
            columns=tuple(plain_payload(value(row)) for value in extra) if extra else ())
            for row in ordered]

    def settle(self, conn: Connection, statement: TextClause, tokens: Tokens,
               extra: Mapping[str, Any] | None = None) -> int:
        """Run a fenced statement once per attempt value; returns the rows it touched."""
        touched = 0
        for attempt, ids in tokens.items():
            if ids:
                params = {"attempt": attempt, "ids": list(ids), **(extra or {})}
                touched += self.completed_all(conn, statement, params,
                                              self.execute(conn, statement, params).rowcount)
        return touched

    def completed_all(self, conn: Connection, statement: TextClause, params: dict[str, Any],
                      touched: int) -> int:
        """``touched`` rows of ``params['ids']`` written by ``statement``; where it is a
        completion by tuple ids that found fewer (a row written by another session while
        the completion waited for its lock: its newest version is not in the statement's
        snapshot), plus those its :attr:`Statements.complete_again` completes, in a
        statement of its own that sees them."""
        again = self._again.get(statement.text)
        if again is None or touched >= len(params["ids"]):
            return touched
        fenced = {"attempt": params["attempt"], "ids": params["ids"]}
        return touched + int(self.execute(conn, again, fenced).rowcount)

    def extend(self, conn: Connection, spec: TableSpec, tokens: Tokens, lease: float) -> int:
        return self.settle(conn, self.statements(spec).extend, tokens, {"lease": lease})
