"""The paused queues' table: one row per paused queue, with who paused it, when and why.

Consumers read the whole (small) table at most every ``pause_check_interval`` and when a
wake-up says it changed (:mod:`kombu_sqlinbox.pausing`), never per claim. Its name column
holds a queue name as the routing tables do (:attr:`RoutingFamily.name_type`): names
compare exactly, ``Jobs`` is not ``jobs`` on any database.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import Connection, TextClause, text
from sqlalchemy.engine import Engine

from ..roles import check_identifier
from .routing import RoutingFamily
from .schedules import ScheduleFamily

#: the paused queues' table under a table prefix
PAUSE_TABLE = "paused_queues"
#: values the schema check binds to every statement it plans
PLAN_PARAMS = {"name": "-", "reason": None, "paused_by": None}


@dataclass(frozen=True)
class PauseStatements:
    """The statements on the paused queues' table of one table prefix."""

    names: tuple[str]
    ddl: list[str]
    drop: list[str]
    #: ``:name`` paused by ``:paused_by`` for ``:reason`` now; a queue paused already keeps
    #: its first record (rowcount 0)
    pause: TextClause
    #: ``:name`` resumed; rowcount 0 when it was not paused
    resume: TextClause
    #: the paused queues: ``name, reason, paused_by, paused_at`` and the database's now
    #: (epoch seconds), by name
    listed: TextClause

    @staticmethod
    def tables(prefix: str) -> tuple[str]:
        return (check_identifier(prefix + PAUSE_TABLE, "table"),)


class PauseFamily(RoutingFamily, ScheduleFamily):
    """The paused queues' statements, built once per table prefix (names as the routing
    tables hold them, rows written as the schedules' are: a second writer's row stays)."""

    def __init__(self, engine: Engine | None = None) -> None:
        super().__init__(engine)
        self._pauses: dict[str, PauseStatements] = {}

    def pause_statements(self, prefix: str) -> PauseStatements:
        cached = self._pauses.get(prefix)
        if cached is None:
            cached = self._pauses[prefix] = self.build_pauses(prefix)
        return cached

    def build_pauses(self, prefix: str) -> PauseStatements:
        names = PauseStatements.tables(prefix)
        paused = self.quote(names[0])
        now = self.epoch(self.now)

        def sql(statement: str) -> TextClause:
            return self.clocked(self.named(text(statement)))

        return PauseStatements(
            names=names,
            ddl=[f"CREATE TABLE IF NOT EXISTS {paused} (name {self.name_type} NOT NULL "
                 f"PRIMARY KEY, reason {self.schedule_text_type}, paused_by "
                 f"{self.schedule_text_type}, paused_at {self.seconds_type} NOT NULL)"
                 + self.schedule_table_suffix],
            drop=[f"DROP TABLE IF EXISTS {paused}"],
            pause=sql(self.insert_new(paused, "name, reason, paused_by, paused_at",
                                      f":name, :reason, :paused_by, {now}", "name")),
            resume=sql(f"DELETE FROM {paused} WHERE name = :name"),
            listed=sql(f"SELECT {self.name_text('name')}, reason, paused_by, paused_at, "
                       f"{now} FROM {paused} ORDER BY name"),
        )

    def notify_channel(self, conn: Connection, channel: str) -> None:
        """Wake the listeners of ``channel`` when ``conn`` commits, where the database has
        wake-ups (elsewhere the same-host signal and the consumers' own looks do)."""
