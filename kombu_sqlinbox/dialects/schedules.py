"""The schedule tables' statements: one row per periodic task (its definition, whether it
is enabled, when it last ran and runs next), and one per tick sent, keyed by (schedule, due
time) so that a tick is claimed once however many schedulers race for it.

Every value is bound, every time is epoch seconds read from the database's clock.
:mod:`celery_ext.beat` runs them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from sqlalchemy import TextClause, bindparam, text
from sqlalchemy import types as sqltypes
from sqlalchemy.engine import Engine

from ..roles import check_identifier
from .driver import DriverFamily

#: the schedule tables under a table prefix: the schedules, the ticks they sent
SCHEDULE_TABLES = ("schedules", "schedule_ticks")
#: a schedule's columns as :attr:`ScheduleStatements.read` and ``listed`` return them
COLUMNS = ("name", "task", "kind", "spec", "args", "kwargs", "options", "misfire", "grace",
           "enabled", "last_run_at", "next_run_at", "total_run_count")
#: how long (seconds) a tick's transaction may sit idle before the server ends it: a
#: scheduler frozen mid-tick (a paused VM, a stopped process) holds its schedules' rows,
#: which the others skip, until then
TICK_IDLE_LIMIT = 10
#: values the schema check binds to every statement it plans
PLAN_PARAMS = {"name": "-", "task": "-", "kind": "interval", "spec": "{}", "args": "[]",
               "kwargs": "{}", "options": "{}", "misfire": "skip", "grace": 1.0, "enabled": 1,
               "next_run_at": 0.0, "due": 0.0, "sent": 0, "task_id": None, "older_than": 1.0}


@dataclass(frozen=True)
class ScheduleStatements:
    """The statements on the schedule tables of one table prefix."""

    names: tuple[str, str]
    ddl: list[str]
    drop: list[str]
    #: the database's time, epoch seconds
    now: TextClause
    #: a new schedule (every column of :data:`COLUMNS` but the run figures); a name
    #: already there is left as it is (rowcount 0)
    add: TextClause
    #: a schedule's definition and next run replaced (enabled flag and last run kept)
    define: TextClause
    #: :data:`COLUMNS` of ``:name``
    read: TextClause
    #: :data:`COLUMNS` of every schedule, by name
    listed: TextClause
    set_enabled: TextClause
    remove: tuple[TextClause, TextClause]
    #: :data:`COLUMNS` and the database's now of the enabled schedules due, locked (those
    #: another scheduler holds are skipped where rows lock)
    due: TextClause
    #: the tick ``(:name, :due)`` claimed; rowcount 0 when another scheduler has it
    claim: TextClause
    #: a schedule moved past ``:due`` to ``:next_run_at`` (``:sent``: whether it sent)
    advance: TextClause
    #: seconds until the first enabled schedule is due (negative: one is due), and until
    #: the first due after now (NULL without one)
    wait: TextClause
    #: ``due, sent_at, task_id`` of ``:name``'s ticks, oldest first
    ticks: TextClause
    #: ticks older than ``:older_than`` seconds
    prune: TextClause
    #: run first in a tick's transaction, and last: the server ends its session once it
    #: sits idle :data:`TICK_IDLE_LIMIT` seconds
    guard: list[str]
    unguard: list[str]

    @staticmethod
    def tables(prefix: str) -> tuple[str, str]:
        schedules, ticks = (check_identifier(prefix + name, "table")
                            for name in SCHEDULE_TABLES)
        return schedules, ticks


class ScheduleFamily(DriverFamily):
    """The schedule tables' statements, built once per table prefix."""

    #: a schedule's name (a key, compared exactly: ``'Ping'``, ``'ping'`` and ``'ping '``
    #: are three schedules), at most 255 characters
    schedule_name_type: ClassVar[str] = "VARCHAR(255)"
    #: a schedule's kind and misfire policy, a tick's task id
    schedule_word_type: ClassVar[str] = "VARCHAR(255)"
    #: a task name, the schedule's JSON, the arguments' JSON
    schedule_text_type: ClassVar[str] = "TEXT"

    if TYPE_CHECKING:  # the routing family's: a name column read as text, bound
        name_bind: ClassVar[sqltypes.TypeEngine[Any] | None]

        def name_text(self, column: str) -> str: ...
    #: epoch seconds
    schedule_time_type: ClassVar[str] = "DOUBLE PRECISION"
    #: what follows a CREATE TABLE's column list
    schedule_table_suffix: ClassVar[str] = ""

    def __init__(self, engine: Engine | None = None) -> None:
        super().__init__(engine)
        self._schedules: dict[str, ScheduleStatements] = {}

    def schedule_statements(self, prefix: str) -> ScheduleStatements:
        cached = self._schedules.get(prefix)
        if cached is None:
            cached = self._schedules[prefix] = self.build_schedules(prefix)
        return cached

    def insert_new(self, table: str, columns: str, values: str, key: str,
                   only_if: str = "") -> str:
        """INSERT of one row that writes nothing where ``key`` is taken (no error: a
        transaction that loses a race goes on), nor unless ``only_if`` (SQL) holds."""
        rows = f"SELECT {values} WHERE {only_if}" if only_if else f"VALUES ({values})"
        return f"INSERT INTO {table} ({columns}) {rows} ON CONFLICT ({key}) DO NOTHING"

    def schedule_ddl(self, schedules: str, ticks: str) -> list[str]:
        name, word, label = (self.schedule_name_type, self.schedule_word_type,
                             self.schedule_text_type)
        seconds = self.schedule_time_type
        return [
            f"CREATE TABLE IF NOT EXISTS {schedules} (name {name} NOT NULL PRIMARY KEY, "
            f"task {label} NOT NULL, kind {word} NOT NULL, spec {label} NOT NULL, "
            f"args {label} NOT NULL, kwargs {label} NOT NULL, options {label} NOT NULL, "
            f"misfire {word} NOT NULL, grace {seconds} NOT NULL, enabled INTEGER NOT NULL, "
            f"last_run_at {seconds}, next_run_at {seconds} NOT NULL, "
            f"total_run_count INTEGER NOT NULL)" + self.schedule_table_suffix,
            f"CREATE TABLE IF NOT EXISTS {ticks} (name {name} NOT NULL, due {seconds} NOT NULL, "
            f"sent_at {seconds} NOT NULL, task_id {word}, PRIMARY KEY (name, due))"
            + self.schedule_table_suffix,
        ]

    def schedule_guard(self, seconds: int) -> tuple[list[str], list[str]]:
        """What a tick runs first and last so that the server ends its session once it sits
        idle ``seconds`` (none: a database that holds no row locks)."""
        return [], []

    def build_schedules(self, prefix: str) -> ScheduleStatements:
        names = ScheduleStatements.tables(prefix)
        schedules, ticks = (self.quote(name) for name in names)
        now = self.epoch(self.now)
        named = self.name_text("name")
        columns = ", ".join(COLUMNS).replace(
            "name", "name" if named == "name" else f"{named} AS name", 1)
        defined = COLUMNS[:9]
        guard, unguard = self.schedule_guard(TICK_IDLE_LIMIT)

        def sql(statement: str) -> TextClause:
            made = self.clocked(text(statement))
            if self.name_bind is not None and ":name" in statement:
                made = made.bindparams(bindparam("name", type_=self.name_bind))
            return made

        return ScheduleStatements(
            names=names,
            ddl=self.schedule_ddl(schedules, ticks),
            drop=[f"DROP TABLE IF EXISTS {table}" for table in (schedules, ticks)],
            now=sql(f"SELECT {now}"),
            add=sql(self.insert_new(
                schedules, ", ".join(COLUMNS),
                ", ".join([*(f":{c}" for c in defined), ":enabled", "NULL", ":next_run_at",
                           "0"]), "name")),
            define=sql(f"UPDATE {schedules} SET "
                       + ", ".join(f"{c} = :{c}" for c in (*defined[1:], "next_run_at"))
                       + " WHERE name = :name"),
            read=sql(f"SELECT {columns} FROM {schedules} WHERE name = :name"),
            listed=sql(f"SELECT {columns} FROM {schedules} ORDER BY name"),
            set_enabled=sql(f"UPDATE {schedules} SET enabled = :enabled WHERE name = :name"),
            remove=(sql(f"DELETE FROM {schedules} WHERE name = :name"),
                    sql(f"DELETE FROM {ticks} WHERE name = :name")),
            due=sql(f"SELECT {columns}, {now} AS now FROM {schedules} AS r WHERE enabled = 1 "
                    f"AND next_run_at <= {now} ORDER BY next_run_at {self.lock_clause}"),
            claim=sql(self.insert_new(ticks, "name, due, sent_at, task_id",
                                      f":name, :due, {now}, :task_id", "name, due")),
            advance=sql(f"UPDATE {schedules} SET next_run_at = :next_run_at, "
                        f"last_run_at = CASE WHEN :sent = 1 THEN {now} ELSE last_run_at END, "
                        f"total_run_count = total_run_count + :sent "
                        f"WHERE name = :name AND next_run_at = :due"),
            wait=sql(f"SELECT MIN(next_run_at) - {now}, MIN(CASE WHEN next_run_at > {now} "
                     f"THEN next_run_at END) - {now} FROM {schedules} WHERE enabled = 1"),
            ticks=sql(f"SELECT due, sent_at, task_id FROM {ticks} WHERE name = :name "
                      "ORDER BY due"),
            prune=sql(f"DELETE FROM {ticks} WHERE due < {now} - :older_than"),
            guard=guard,
            unguard=unguard,
        )
