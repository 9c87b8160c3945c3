"""The rate budget's table: what every worker took of each short window's claims.

A rate-limited queue's time is cut into windows (by the database's clock); a window's
budget is split into a few shards, one row each, made by the first claim that takes from
it. A claim takes tokens from one shard by a conditional UPDATE, so claimers of one queue
spread over several rows instead of queueing on one (:mod:`kombu_sqlinbox.rates`). Queues
without a rate limit never touch the table.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import TextClause, text
from sqlalchemy.engine import Engine

from ..roles import check_identifier
from .routing import RoutingFamily
from .schedules import ScheduleFamily

#: the rate budget's table under a table prefix
RATE_TABLE = "rate_budget"
#: values the schema check binds to every statement it plans
PLAN_PARAMS = {"name": "-", "window": 0, "shard": 0, "k": 1, "share": 1}


@dataclass(frozen=True)
class RateStatements:
    """The statements on the rate budget's table of one table prefix."""

    names: tuple[str]
    ddl: list[str]
    drop: list[str]
    #: take ``:k`` tokens of shard ``:shard`` of ``:name``'s window ``:window`` when
    #: ``:share`` allows them (rowcount 1), else nothing
    take: TextClause
    #: the shard's row, made with ``:k`` tokens taken; rowcount 0 when it was there
    open: TextClause
    #: ``shard, used`` of each shard of the window made so far
    shards: TextClause
    #: ``:k`` tokens taken and not used, given back to their shard
    give_back: TextClause
    #: the windows of ``:name`` before ``:window``
    prune: TextClause
    #: the database's now, in epoch seconds
    now: TextClause

    @staticmethod
    def tables(prefix: str) -> tuple[str]:
        return (check_identifier(prefix + RATE_TABLE, "table"),)


class RateFamily(RoutingFamily, ScheduleFamily):
    """The rate budget's statements, built once per table prefix (names as the routing
    tables hold them, a shard's row made as the schedules' are: a second maker's row
    stays)."""

    #: a window's number: epoch seconds over a window's length (beyond 32 bits)
    window_type = "BIGINT"

    def __init__(self, engine: Engine | None = None) -> None:
        super().__init__(engine)
        self._rates: dict[str, RateStatements] = {}

    def rate_statements(self, prefix: str) -> RateStatements:
        cached = self._rates.get(prefix)
        if cached is None:
            cached = self._rates[prefix] = self.build_rates(prefix)
        return cached

    def build_rates(self, prefix: str) -> RateStatements:
        names = RateStatements.tables(prefix)
        budget = self.quote(names[0])
        shard = "name = :name AND window_no = :window AND shard = :shard"

        def sql(statement: str) -> TextClause:
            return self.clocked(self.named(text(statement)))

        return RateStatements(
            names=names,
            ddl=[f"CREATE TABLE IF NOT EXISTS {budget} (name {self.name_type} NOT NULL, "
                 f"window_no {self.window_type} NOT NULL, shard INTEGER NOT NULL, "
                 f"used INTEGER NOT NULL, PRIMARY KEY (name, window_no, shard))"
                 + self.schedule_table_suffix],
            drop=[f"DROP TABLE IF EXISTS {budget}"],
            take=sql(f"UPDATE {budget} SET used = used + :k WHERE {shard} "
                     f"AND used + :k <= :share"),
            open=sql(self.insert_new(budget, "name, window_no, shard, used",
                                     ":name, :window, :shard, :k", "name, window_no, shard")),
            shards=sql(f"SELECT shard, used FROM {budget} "
                       f"WHERE name = :name AND window_no = :window"),
            give_back=sql(f"UPDATE {budget} SET used = used - :k WHERE {shard} AND used >= :k"),
            prune=sql(f"DELETE FROM {budget} WHERE name = :name AND window_no < :window"),
            now=sql(f"SELECT {self.epoch(self.now)}"),
        )
