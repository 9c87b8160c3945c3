"""The result tables' statements: one row per task (its state, its encoded result, when
it finished) and one per saved group, under the table prefix; every value bound, every
time epoch seconds read from the database's clock.

Celery's result backend (:mod:`celery_ext.results`) runs them through
:mod:`kombu_sqlinbox.results`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from sqlalchemy import Connection, TextClause, bindparam, text
from sqlalchemy.engine import Engine

from ..roles import check_identifier
from .schedules import ScheduleFamily

#: the result tables under a table prefix: tasks' results, saved groups, chords' counters,
#: and the ids of the parts of chords whose header was a generator
RESULT_TABLES = ("task_results", "group_results", "chords", "chord_parts")
#: the longest task or group id the result tables key (bytes, UTF-8): Celery takes any
#: string a caller gives (``task_id=...``); within what a PostgreSQL btree entry and an
#: InnoDB key hold
RESULT_ID_BYTES = 2048
#: the state a stored result never leaves (Celery's rule: a task run again after its
#: success does not replace the result)
FINAL = "SUCCESS"
#: the state of a task that raised: what the history statements look for
FAILED = "FAILURE"
#: values the schema check binds to every statement it plans
PLAN_PARAMS = {"task_id": "-", "group_id": "-", "status": "PENDING", "task_name": None,
               "worker": None, "meta": b"", "expires": 0.0, "limit": 1,
               "size": 1, "task_ids": ["-"], "since": 3600.0, "last": 0.0,
               "generated": 0, "group_index": 0}
Names = tuple[str, str, str, str]
#: the history index's columns: a task table's failures by time, each listing a range of it
HISTORY_COLUMNS = "(status, date_done)"


def history_index_name(names: Names) -> str:
    """The history index of the task table of ``names`` (unquoted)."""
    return names[0] + "_status_done"


@dataclass(frozen=True)
class ResultStatements:
    """The statements on the result tables of one table prefix."""

    names: Names
    ddl: list[str]
    drop: list[str]
    #: write a task's state and encoded meta (``:task_id, :status, :task_name, :worker,
    #: :meta, :ready``); a row already in SUCCESS is left as it is
    store: TextClause
    #: :attr:`store` of a task that has no row yet, else nothing (no row counted): the
    #: failure of a chord's body, written once by whichever part finds its counter gone
    store_new: TextClause
    #: ``status, meta, date_done`` of ``:task_id``
    read: TextClause
    #: ``task_id, status, meta, date_done`` of each of ``:task_ids`` stored
    read_many: TextClause
    forget: TextClause
    save_group: TextClause
    #: ``meta, date_done`` of ``:group_id``
    restore_group: TextClause
    delete_group: TextClause
    #: a chord's counter row (``:group_id, :meta``, ``:generated`` 1 for a header given
    #: as a generator, whose parts record their ids): no size yet, nothing done
    chord_save: TextClause
    #: ``:size`` of chord ``:group_id``, set once its header is published
    chord_size: TextClause
    #: one more header task of ``:group_id`` done (the row locked until the commit)
    chord_count: TextClause
    #: one more task expected by chord ``:group_id`` (``add_to_chord``): ``done`` counts
    #: the tasks done less those added, so it still completes at ``size`` (which a
    #: header being published has not set yet); the row locked until the commit
    chord_add: TextClause
    #: the ``:meta`` of chord ``:group_id``, rewritten under the lock of one of the above
    chord_meta: TextClause
    #: ``done, size, generated`` of ``:group_id``: what a count reads (nothing that grows
    #: with the chord)
    chord_numbers: TextClause
    #: ``meta`` of ``:group_id``
    chord_read: TextClause
    chord_delete: TextClause
    #: a generator's part counted: ``:task_id`` (once) of chord ``:group_id`` at
    #: ``:group_index``
    chord_part: TextClause
    #: ``group_index, task_id`` of every part recorded for ``:group_id``
    chord_parts: TextClause
    chord_parts_delete: TextClause
    #: at most ``:limit`` rows of each table done (a chord: saved) more than ``:expires``
    #: seconds ago
    expire: tuple[TextClause, ...]
    #: ``task_id, task_name, worker, date_done, meta`` of the last ``:limit`` failures
    #: done in the last ``:since`` seconds, the latest first (the history index's range)
    failures: TextClause
    #: :attr:`failures` of task ``:task_name`` only
    task_failures: TextClause
    #: ``task_name, failures, last date_done`` per task of the failures done in the last
    #: ``:since`` seconds, the latest first (at most ``:limit`` tasks)
    failure_summary: TextClause
    #: :attr:`failure_summary` of task ``:task_name`` only
    task_summary: TextClause
    #: :attr:`failures`' columns of the failures done at ``:last``
    #: (a task's last one: :attr:`failure_summary` gives the time)
    failures_at: TextClause
    #: the history index, for result tables made before it (what :attr:`ddl` makes)
    history_index: tuple[str, str]

    @staticmethod
    def tables(prefix: str) -> Names:
        tasks, groups, chords, parts = (check_identifier(prefix + name, "table")
                                        for name in RESULT_TABLES)
        return tasks, groups, chords, parts


class ResultFamily(ScheduleFamily):
    """The result tables' statements, built once per table prefix."""

    #: a task or group id (any string Celery is given, up to :data:`RESULT_ID_BYTES`;
    #: compared as stored)
    result_id_type: ClassVar[str] = f"VARCHAR({RESULT_ID_BYTES})"
    #: a state, task name or worker name
    result_text_type: ClassVar[str] = "TEXT"
    #: the most characters :attr:`result_text_type` holds (None: no limit)
    result_text_chars: ClassVar[int | None] = None
    #: the encoded meta: the result, traceback, children, and with ``result_extended``
    #: the task's arguments
    result_meta_type: ClassVar[str] = "BLOB"
    #: what :attr:`result_meta_type` holds at most (bytes)
    result_meta_bytes: ClassVar[int] = 1_000_000_000
    #: epoch seconds
    result_time_type: ClassVar[str] = "DOUBLE PRECISION"

    def __init__(self, engine: Engine | None = None) -> None:
        super().__init__(engine)
        self._results: dict[str, ResultStatements] = {}

    def result_statements(self, prefix: str) -> ResultStatements:
        cached = self._results.get(prefix)
        if cached is None:
            cached = self._results[prefix] = self.build_results(prefix)
        return cached

    def result_limit(self) -> tuple[int, str]:
        """The largest encoded meta one write can carry (bytes), and what sets it: the
        column's type, or the server's limit on one statement (less room for the rest
        of it), whichever is lower."""
        limit = (self.result_meta_bytes, f"the {self.result_meta_type} column's limit")
        if self.max_statement_bytes is not None:  # room for the ids and names too
            statement = (self.max_statement_bytes - 16384,
                         f"the server's max_allowed_packet of {self.max_statement_bytes}")
            limit = min(limit, statement)
        return limit

    def result_label(self, name: str | None) -> str | None:
        """A task or worker name as its column holds it: cut to fit, for these columns
        are labels to find results by (the meta keeps the whole name)."""
        limit = self.result_text_chars
        return name if name is None or limit is None else name[:limit]

    def result_channel(self, prefix: str, task_id: str) -> str:
        """The NOTIFY channel a task's result is announced on (a valid identifier of at
        most 63 bytes whatever the id and prefix)."""
        digest = hashlib.md5(f"{prefix}\0{task_id}".encode()).hexdigest()
        return f"sqlinbox_r_{digest}"

    def result_notify(self, conn: Connection, channel: str) -> None:
        """Announce a stored result on ``channel`` when ``conn`` commits, where the
        database has NOTIFY (nothing elsewhere: waiters there are woken otherwise)."""

    def result_name(self, value: str) -> str:
        """A task name as the history compares and groups names: as stored."""
        return value

    def result_upsert(self, table: str, key: str, values: Sequence[tuple[str, str]],
                      guarded: bool) -> str:
        """INSERT of (column, SQL value) pairs; on a conflict on ``key`` the other columns
        are updated, unless ``guarded`` and the row is already in :data:`FINAL`."""
        columns = ", ".join(column for column, _ in values)
        given = ", ".join(value for _, value in values)
        updates = ", ".join(f"{column} = excluded.{column}"
                            for column, _ in values if column != key)
        guard = f" WHERE {table}.status <> '{FINAL}'" if guarded else ""
        return (f"INSERT INTO {table} ({columns}) VALUES ({given}) "
                f"ON CONFLICT ({key}) DO UPDATE SET {updates}{guard}")

    def result_expire_sql(self, table: str, key: str) -> str:
        """DELETE of at most ``:limit`` rows of ``table`` done ``:expires`` seconds ago,
        the oldest first (the index on ``date_done``'s walk)."""
        return (f"DELETE FROM {table} WHERE {key} IN (SELECT {key} FROM {table} "
                f"WHERE date_done < {self.epoch(self.now)} - :expires ORDER BY date_done "
                "LIMIT :limit)")

    def history_index(self, tasks: str, name: str) -> str:
        """CREATE INDEX of the history index on an existing task table."""
        return f"CREATE INDEX IF NOT EXISTS {self.quote(name)} ON {tasks} {HISTORY_COLUMNS}"

    def result_ddl(self, quoted: Names, names: Names) -> list[str]:
        """The result tables, each with its index on ``date_done`` (expiry's scan); the
        tasks' also on ``(status, date_done)``: the history's failures, latest first."""
        key, label = self.result_id_type, self.result_text_type
        meta, seconds = self.result_meta_type, self.result_time_type
        tasks, groups, chords, parts = quoted
        return [
            f"CREATE TABLE IF NOT EXISTS {tasks} (task_id {key} NOT NULL PRIMARY KEY, "
            f"task_name {label}, worker {label}, date_done {seconds}, "
            f"meta {meta} NOT NULL, status {label} NOT NULL)",
            f"CREATE INDEX IF NOT EXISTS {self.quote(names[0] + '_done')} "
            f"ON {tasks} (date_done)",
            self.history_index(tasks, history_index_name(names)),
            f"CREATE TABLE IF NOT EXISTS {groups} (group_id {key} NOT NULL PRIMARY KEY, "
            f"date_done {seconds} NOT NULL, meta {meta} NOT NULL)",
            f"CREATE INDEX IF NOT EXISTS {self.quote(names[1] + '_done')} "
            f"ON {groups} (date_done)",
            f"CREATE TABLE IF NOT EXISTS {chords} (group_id {key} NOT NULL PRIMARY KEY, "
            f"date_done {seconds} NOT NULL, size INTEGER, done INTEGER NOT NULL, "
            f"generated INTEGER NOT NULL, meta {meta} NOT NULL)",
            f"CREATE INDEX IF NOT EXISTS {self.quote(names[2] + '_done')} "
            f"ON {chords} (date_done)",
            f"CREATE TABLE IF NOT EXISTS {parts} (task_id {key} NOT NULL PRIMARY KEY, "
            f"group_id {key} NOT NULL, group_index INTEGER, date_done {seconds} NOT NULL)",
            f"CREATE INDEX IF NOT EXISTS {self.quote(names[3] + '_group')} "
            f"ON {parts} (group_id)",
            f"CREATE INDEX IF NOT EXISTS {self.quote(names[3] + '_done')} "
            f"ON {parts} (date_done)",
        ]

    def build_results(self, prefix: str) -> ResultStatements:
        names = ResultStatements.tables(prefix)
        quoted: Names = (self.quote(names[0]), self.quote(names[1]), self.quote(names[2]),
                         self.quote(names[3]))
        tasks, groups, chords, parts = quoted
        now = self.epoch(self.now)
        # status last: MySQL's guard reads it as each assignment leaves it
        stored = [("task_id", ":task_id"), ("task_name", ":task_name"), ("worker", ":worker"),
                  ("date_done", now), ("meta", ":meta"),
                  ("status", ":status")]
        saved = [("group_id", ":group_id"), ("date_done", now), ("meta", ":meta")]
        counted = [*saved, ("size", "NULL"), ("done", "0"), ("generated", ":generated")]
        part = [("task_id", ":task_id"), ("group_id", ":group_id"),
                ("group_index", ":group_index"), ("date_done", now)]
        history = "task_id, task_name, worker, date_done, meta"
        window = f"WHERE status = '{FAILED}' AND date_done >= {now} - :since"
        failed = f"SELECT {history} FROM {tasks} {window}"
        name = self.result_name("task_name")
        of_task = f" AND {name} = {self.result_name(':task_name')}"
        per_task = f"SELECT {name}, COUNT(*), MAX(date_done) FROM {tasks} {window}"
        grouped = f"GROUP BY {name} ORDER BY MAX(date_done) DESC LIMIT :limit"

        def sql(statement: str) -> TextClause:
            return self.clocked(text(statement))

        return ResultStatements(
            names=names,
            ddl=self.result_ddl(quoted, names),
            drop=[f"DROP TABLE IF EXISTS {table}" for table in quoted],
            store=sql(self.result_upsert(tasks, "task_id", stored, guarded=True)),
            store_new=sql(self.insert_new(
                tasks, ", ".join(column for column, _ in stored),
                ", ".join(value for _, value in stored), "task_id")),
            read=sql(f"SELECT status, meta, date_done FROM {tasks} WHERE task_id = :task_id"),
            read_many=sql(f"SELECT task_id, status, meta, date_done FROM {tasks} "
                          "WHERE task_id IN :task_ids").bindparams(
                              bindparam("task_ids", expanding=True)),
            forget=sql(f"DELETE FROM {tasks} WHERE task_id = :task_id"),
            save_group=sql(self.result_upsert(groups, "group_id", saved, guarded=False)),
            restore_group=sql(
                f"SELECT meta, date_done FROM {groups} WHERE group_id = :group_id"),
            delete_group=sql(f"DELETE FROM {groups} WHERE group_id = :group_id"),
            chord_save=sql(self.result_upsert(chords, "group_id", counted, guarded=False)),
            chord_size=sql(f"UPDATE {chords} SET size = :size WHERE group_id = :group_id"),
            chord_count=sql(f"UPDATE {chords} SET done = done + 1 WHERE group_id = :group_id"),
            chord_add=sql(f"UPDATE {chords} SET done = done - 1 WHERE group_id = :group_id"),
            chord_meta=sql(f"UPDATE {chords} SET meta = :meta WHERE group_id = :group_id"),
            chord_numbers=sql(
                f"SELECT done, size, generated FROM {chords} WHERE group_id = :group_id"),
            chord_read=sql(f"SELECT meta FROM {chords} WHERE group_id = :group_id"),
            chord_delete=sql(f"DELETE FROM {chords} WHERE group_id = :group_id"),
            chord_part=sql(self.insert_new(parts, ", ".join(column for column, _ in part),
                                           ", ".join(value for _, value in part), "task_id")),
            chord_parts=sql(
                f"SELECT group_index, task_id FROM {parts} WHERE group_id = :group_id"),
            chord_parts_delete=sql(f"DELETE FROM {parts} WHERE group_id = :group_id"),
            expire=(sql(self.result_expire_sql(tasks, "task_id")),
                    sql(self.result_expire_sql(groups, "group_id")),
                    sql(self.result_expire_sql(chords, "group_id")),
                    sql(self.result_expire_sql(parts, "task_id"))),
            failures=sql(f"{failed} ORDER BY date_done DESC LIMIT :limit"),
            task_failures=sql(f"{failed}{of_task} ORDER BY date_done DESC LIMIT :limit"),
            failure_summary=sql(f"{per_task} {grouped}"),
            task_summary=sql(f"{per_task}{of_task} {grouped}"),
            failures_at=sql(f"SELECT {history} FROM {tasks} "
                            f"WHERE status = '{FAILED}' AND date_done = :last"),
            history_index=(history_index_name(names),
                           self.history_index(tasks, history_index_name(names))),
        )
