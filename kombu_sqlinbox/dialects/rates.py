"""The rate budget's table: what every worker took of each short window's claims; and the
reads a rate-limited queue's claim makes of its own table.

A rate-limited queue's (or task's) time is cut into windows (by the database's clock); a
window's budget is split into a few shards, one row each, made by the first claim that
takes from it. A claim takes tokens from one shard by a conditional UPDATE, so claimers of
one queue spread over several rows instead of queueing on one
(:mod:`kombu_sqlinbox.rates`). Queues without a rate limit never touch the table.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import String, TextClause, bindparam, text
from sqlalchemy.engine import Engine

from ..roles import check_identifier
from ..tables import Role, TableSpec
from .routing import RoutingFamily
from .schedules import ScheduleFamily
from .selection import SelectionFamily

#: the rate budget's table under a table prefix
RATE_TABLE = "rate_budget"
#: values the schema check binds to every statement it plans
PLAN_PARAMS = {"name": "-", "window": 0, "shard": 0, "k": 1, "share": 1, "limit": 1,
               "start": 0.0, "end": 1.0}


@dataclass(frozen=True)
class RateStatements:
    """The statements on the rate budget's table of one table prefix."""

    names: tuple[str]
    ddl: list[str]
    drop: list[str]
    #: take ``:k`` tokens of shard ``:shard`` of ``:name``'s window ``:window`` when
    #: ``:share`` allows them and the database's clock is inside the window (from
    #: ``:start`` to ``:end``, epoch seconds) once the row is had (rowcount 1), else
    #: nothing: a take that waited on the row, or came late, past the window's end
    #: takes none of its tokens
    take: TextClause
    #: the shard's row, made with ``:k`` tokens taken while the database's clock is
    #: inside the window; rowcount 0 when it was there or the window is not the current
    #: one (a late open never makes again a window that ended, and was pruned)
    open: TextClause
    #: ``shard, used`` of each shard of the window made so far
    shards: TextClause
    #: ``:k`` tokens taken and not used, given back to their shard
    give_back: TextClause
    #: at most ``:limit`` rows of the windows of ``:name`` before ``:window``, passing over
    #: rows another prune holds where the database can
    prune: TextClause
    #: the database's clock as the statement runs, in epoch seconds
    now: TextClause

    @staticmethod
    def tables(prefix: str) -> tuple[str]:
        return (check_identifier(prefix + RATE_TABLE, "table"),)


@dataclass(frozen=True)
class RatedReads:
    """The reads a rate-limited claim makes of one queue table, from ``:floor`` up
    (:meth:`SelectionFamily.above_floor`)."""

    #: a row of each of the first ``:limit`` ready rows in claim order (an idle queue's
    #: poll reads one, before any token is taken)
    ready: TextClause
    #: the task name (Celery's ``task`` header; NULL: none) of each of the first
    #: ``:limit`` ready rows in claim order whose task is not among the ``:spent`` ones:
    #: which tasks' budgets a claim takes from (None: a table without headers, which
    #: holds no task name)
    tasks: TextClause | None = None
    #: ``id, task[, partition_key]`` of the first ``:limit`` ready rows in claim order
    #: whose task is not among the ``:spent`` ones, locked (skipping locked rows)
    candidates: TextClause | None = None


class RateFamily(SelectionFamily, RoutingFamily, ScheduleFamily):
    """The rate budget's statements, built once per table prefix (names as the routing
    tables hold them, a shard's row made as the schedules' are: a second maker's row
    stays), and a rate-limited claim's reads, once per table."""

    #: a window's number: epoch seconds over a window's length (beyond 32 bits)
    window_type = "BIGINT"

    def __init__(self, engine: Engine | None = None) -> None:
        super().__init__(engine)
        self._rates: dict[str, RateStatements] = {}
        self._rated: dict[TableSpec, RatedReads] = {}

    def envelope_header(self, column: str, header: str) -> str:
        """SQL: the message header ``header`` in the envelope a headers column holds
        (NULL: none); ``header`` is a fixed word, never a value."""
        raise NotImplementedError

    def take_tokens(self, budget: str, current: str) -> str:
        """A take (:attr:`RateStatements.take`) from the table ``budget``, ``current``
        (SQL: the database's clock inside the window) judged once the shard's row is
        had: here the row's lock is waited for before the statement's condition is
        evaluated."""
        return (f"UPDATE {budget} SET used = used + :k WHERE name = :name "
                f"AND window_no = :window AND shard = :shard AND used + :k <= :share "
                f"AND {current}")

    def prune_rows(self, budget: str) -> str:
        """A prune (:attr:`RateStatements.prune`) of the table ``budget``: its rows by
        primary key, chosen under the lock clause."""
        lock = f" {self.lock_clause}" if self.lock_clause else ""
        return (f"DELETE FROM {budget} WHERE (name, window_no, shard) IN (SELECT r.name, "
                f"r.window_no, r.shard FROM {budget} AS r WHERE r.name = :name "
                f"AND r.window_no < :window LIMIT :limit{lock})")

    def rate_statements(self, prefix: str) -> RateStatements:
        cached = self._rates.get(prefix)
        if cached is None:
            cached = self._rates[prefix] = self.build_rates(prefix)
        return cached

    def rated_reads(self, spec: TableSpec) -> RatedReads:
        cached = self._rated.get(spec)
        if cached is None:
            cached = self._rated[spec] = self.build_rated(spec)
        return cached

    def build_rated(self, spec: TableSpec) -> RatedReads:
        ready = f"WHERE {self.ready_filter(spec)}{self.above_floor(spec)}"
        order = f"ORDER BY {self.claim_order(spec, 'r')} LIMIT :limit"
        probe = self.clocked(text(self.ordered_select(spec, ["1"], f"{ready} {order}")))
        if not spec.has(Role.HEADERS):
            return RatedReads(probe)
        f = self.fields(spec)
        task = self.envelope_header(f"r.{f['headers']}", "task")
        columns = [f"r.{f['id']}", task]
        if spec.has(Role.PARTITION_KEY):
            columns.append(f"r.{f['partition_key']}")
        among = f"{ready} AND ({task} IS NULL OR {self.exact_key(task)} NOT IN :spent) {order}"

        def sql(statement: str) -> TextClause:
            return self.clocked(text(statement).bindparams(
                bindparam("spent", expanding=True, type_=String())))

        return RatedReads(
            ready=probe,
            tasks=sql(self.ordered_select(spec, [task], among)),
            candidates=sql(self.ordered_select(
                spec, columns, among, f" {self.lock_clause}" if self.lock_clause else "")),
        )

    def build_rates(self, prefix: str) -> RateStatements:
        names = RateStatements.tables(prefix)
        budget = self.quote(names[0])
        shard = "name = :name AND window_no = :window AND shard = :shard"
        instant = self.epoch(self.instant)
        current = f"{instant} >= :start AND {instant} < :end"

        def sql(statement: str) -> TextClause:
            return self.clocked(self.named(text(statement)))

        return RateStatements(
            names=names,
            ddl=[f"CREATE TABLE IF NOT EXISTS {budget} (name {self.name_type} NOT NULL, "
                 f"window_no {self.window_type} NOT NULL, shard INTEGER NOT NULL, "
                 f"used INTEGER NOT NULL, PRIMARY KEY (name, window_no, shard))"
                 + self.schedule_table_suffix],
            drop=[f"DROP TABLE IF EXISTS {budget}"],
            take=sql(self.take_tokens(budget, current)),
            open=sql(self.insert_new(budget, "name, window_no, shard, used",
                                     ":name, :window, :shard, :k", "name, window_no, shard",
                                     current)),
            shards=sql(f"SELECT shard, used FROM {budget} "
                       f"WHERE name = :name AND window_no = :window"),
            give_back=sql(f"UPDATE {budget} SET used = used - :k WHERE {shard} AND used >= :k"),
            prune=sql(self.prune_rows(budget)),
            now=sql(f"SELECT {instant}"),
        )
