"""The throughput table: how many rows each process settled per queue and minute.

Each process adds its own counts to its own rows (one per queue, minute and process),
so no row is shared by the workers and their writes never wait on each other. The
primary key leads with the minute: the last hour is a range of it, and so are the
minutes old enough to prune.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import TextClause, text
from sqlalchemy.engine import Engine

from ..roles import check_identifier
from .routing import RoutingFamily
from .schedules import ScheduleFamily

#: the throughput table under a table prefix
THROUGHPUT_TABLE = "throughput"
#: values the schema check binds to every statement it plans
THROUGHPUT_PLAN_PARAMS = {"minute": 0, "queue": "-", "process": "-", "settled": 1,
                          "since": 0, "before": 0}


@dataclass(frozen=True)
class ThroughputStatements:
    """The statements on the throughput table of one table prefix."""

    names: tuple[str]
    ddl: list[str]
    drop: list[str]
    #: ``:settled`` rows settled by process ``:process`` from queue ``:queue`` in minute
    #: ``:minute`` (epoch seconds over 60), added to its row (made when missing)
    add: TextClause
    #: ``queue, minute, settled`` summed over the processes, for the minutes from
    #: ``:since`` on
    read: TextClause
    #: every row of the minutes before ``:before``
    prune: TextClause
    #: the database's clock, in epoch seconds: the minutes are its minutes
    now: TextClause

    @staticmethod
    def tables(prefix: str) -> tuple[str]:
        return (check_identifier(prefix + THROUGHPUT_TABLE, "table"),)


class ThroughputFamily(RoutingFamily, ScheduleFamily):
    """The throughput table's statements, built once per table prefix: names as the
    routing tables hold them, counts added by the dialect's upsert."""

    #: a minute's number: epoch seconds over 60
    minute_type = "BIGINT"

    def __init__(self, engine: Engine | None = None) -> None:
        super().__init__(engine)
        self._throughput: dict[str, ThroughputStatements] = {}

    def throughput_statements(self, prefix: str) -> ThroughputStatements:
        cached = self._throughput.get(prefix)
        if cached is None:
            cached = self._throughput[prefix] = self.build_throughput(prefix)
        return cached

    def build_throughput(self, prefix: str) -> ThroughputStatements:
        names = ThroughputStatements.tables(prefix)
        table = self.quote(names[0])
        return ThroughputStatements(
            names=names,
            ddl=[f"CREATE TABLE IF NOT EXISTS {table} (minute {self.minute_type} NOT NULL, "
                 f"queue {self.name_type} NOT NULL, process {self.name_type} NOT NULL, "
                 f"settled BIGINT NOT NULL, PRIMARY KEY (minute, queue, process))"
                 + self.schedule_table_suffix],
            drop=[f"DROP TABLE IF EXISTS {table}"],
            add=self.named(text(self.upsert(table, ["minute", "queue", "process"], [],
                                            added=["settled"]))),
            read=text(f"SELECT {self.name_text('queue')}, minute, SUM(settled) FROM {table} "
                      f"WHERE minute >= :since GROUP BY queue, minute"),
            prune=text(f"DELETE FROM {table} WHERE minute < :before"),
            now=self.clocked(text(f"SELECT {self.epoch(self.now)}")),
        )
