"""Task history from the result table: its recent failures, one by one and per task.

The result backend keeps one row per task; a failed task's row (state ``FAILURE``, done
by the database's clock) is its history. Every read here is a range of the history index
``(status, date_done)``, the latest first and limited: none reads the whole table, however
many results it holds. Rows come back as stored (the encoded meta); Celery's side
(:mod:`celery_ext.history_cli`) decodes them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, inspect
from sqlalchemy.exc import DBAPIError

from .database import Database
from .dialects import ResultStatements
from .errors import ConfigurationError, reason_of

logger = logging.getLogger(__name__)


class ResultsMissing(ConfigurationError):
    """The result tables are not in this database (under this prefix)."""


@dataclass(frozen=True)
class Failure:
    """A failed task's row: ``date_done`` in epoch seconds; ``task_name`` and ``worker``
    None unless Celery's ``result_extended`` is on."""

    task_id: str
    task_name: str | None
    worker: str | None
    date_done: float
    meta: bytes


@dataclass(frozen=True)
class TaskFailures:
    """A task's failures in a window: how many, the last one's time, and the last one."""

    task_name: str | None
    count: int
    last_done: float
    last: Failure | None


class History:
    """The failures in the result tables ``sql`` of ``database``."""

    def __init__(self, database: Database, sql: ResultStatements) -> None:
        self.database = database
        self.sql = sql

    def _read(self, statement: Any, params: dict[str, Any]) -> list[Any]:
        """The rows of ``statement``; the task table missing is :class:`ResultsMissing`
        (looked for only when the read fails: the usual read costs one statement)."""
        try:
            return self.database.run(
                lambda conn: list(conn.execute(statement, params)), read_only=True)
        except DBAPIError:
            if self.database.run(lambda conn: inspect(conn).has_table(self.sql.names[0]),
                                 read_only=True):
                raise
            raise ResultsMissing(
                f"the result table {self.sql.names[0]} does not exist: no task result is "
                "stored in this database under this prefix") from None

    def failures(self, since: float, limit: int, task: str | None = None) -> list[Failure]:
        """The last ``limit`` failures of the last ``since`` seconds (of ``task`` only
        when given), the latest first."""
        statement, params = self._of(self.sql.failures, self.sql.task_failures, since,
                                     limit, task)
        return [_failure(row) for row in self._read(statement, params)]

    def summary(self, since: float, limit: int, task: str | None = None
                ) -> list[TaskFailures]:
        """Per task (at most ``limit``, the latest failing first; ``task`` only when
        given): its failures in the last ``since`` seconds, the last one's time, and the
        last one (read at that time: one index lookup per task)."""
        found = []
        for name, count, last in self._read(*self._of(
                self.sql.failure_summary, self.sql.task_summary, since, limit, task)):
            name = _text(name)
            at = [_failure(row) for row in self._read(self.sql.failures_at,
                                                      {"last": float(last)})]
            found.append(TaskFailures(name, int(count), float(last), next(
                (each for each in at if each.task_name == name), None)))
        return found


    def _of(self, every: Any, one: Any, since: float, limit: int, task: str | None
            ) -> tuple[Any, dict[str, Any]]:
        """``every`` task's statement, or ``one``'s for ``task``, as its column holds
        the name (cut where the column is shorter: MariaDB/MySQL's 255), and its
        parameters."""
        params: dict[str, Any] = {"since": float(since), "limit": int(limit)}
        if task is None:
            return every, params
        return one, {**params, "task_name": self.database.dialect.result_label(task)}


def _text(value: str | bytes | None) -> str | None:
    """A text column as stored (MySQL's binary id comes back as bytes)."""
    return value.decode() if isinstance(value, bytes | bytearray) else value


def _failure(row: Any) -> Failure:
    task_id, name, worker, done, meta = row
    return Failure(str(_text(task_id)), _text(name), _text(worker), float(done), bytes(meta))


def history_index_missing(conn: Connection, sql: ResultStatements) -> bool:
    """Whether the task table is there without the history index (made before it)."""
    tasks = sql.names[0]
    found = inspect(conn)
    return found.has_table(tasks) and sql.history_index[0] not in {
        index["name"] for index in found.get_indexes(tasks)}


def add_history_index(database: Database, sql: ResultStatements, create: bool) -> None:
    """Give a task table made before the history index its index: created here where the
    tables are (``create``), else a warning with the statement (the failure history then
    reads each window's rows of every state); so is a creation the database refuses (a
    worker's user may write rows, not indexes): results are stored without it."""
    name, statement = sql.history_index
    if not database.run(lambda conn: history_index_missing(conn, sql), read_only=True):
        return
    if not create:
        logger.warning("sqlinbox: the result table %s has no index %s (create_tables is off): "
                       "the failure history reads every result of its window; create it "
                       "with:\n%s;", sql.names[0], name, statement)
        return
    logger.info("sqlinbox: creating the index %s on %s (the failure history's)",
                name, sql.names[0])
    try:
        database.run(lambda conn: conn.exec_driver_sql(statement))
    except DBAPIError as exc:  # another process created it at the same moment, or may not
        if database.run(lambda conn: history_index_missing(conn, sql), read_only=True):
            logger.warning("sqlinbox: the index %s could not be created on %s (%s): the "
                           "failure history reads every result of its window; results "
                           "are stored as before; create it with:\n%s;", name,
                           sql.names[0], reason_of(exc), statement)


def history_problems(sql: ResultStatements, create: bool,
                     conn: Connection) -> list[tuple[str, str]]:
    """The schema check's finding: a task table without the history index where no
    process creates it (``create_tables`` off; else the result backend adds it as it
    starts)."""
    if create or not history_index_missing(conn, sql):
        return []
    return [(sql.names[0], f"no index {sql.history_index[0]} (the failure history reads "
                           f"every result of its window); create it with:\n"
                           f"{sql.history_index[1]};")]
