"""SQLite: every statement the transport runs there.

Times are stored as REAL seconds since the epoch; ``julianday('now')`` is
stable within one statement, so a claim compares every row with one instant.
"""

from __future__ import annotations

import logging
import os
import re
import sqlite3
import threading
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Connection, TextClause, event, text
from sqlalchemy import types as sqltypes
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError, OperationalError

from ..errors import SchemaMismatch
from ..tables import ColumnSpec, Role, TableSpec
from .base import Dialect
from .core import Capabilities
from .driver import _expanding
from .limits import digest

NOW = "((julianday('now') - 2440587.5) * 86400.0)"
#: seconds a statement waits for the database's write lock
BUSY_TIMEOUT = 30.0

logger = logging.getLogger(__name__)


class ForkGate:
    """Holds ``fork()`` back while another thread has a connection of ours in use.

    SQLite keeps each file's locks in process-wide memory, and a forked child inherits
    that memory: if another thread held the write lock at the fork (a claim, a lease
    extension), the child believes forever that some connection of its own holds it,
    and every write it tries waits out the busy timeout and fails with "database is
    locked" (a Celery prefork pool replacing a dead process forks at any moment). So
    the fork waits until the other threads have given their connections back, and none
    is checked out until the fork is done. The forking thread's own connections cannot
    be waited for: a fork inside one's own transaction is only warned about, as is a
    wait that ran out.
    """

    #: where a checked-out connection's record keeps the thread that took it
    KEY = "sqlinbox_fork_gate_thread"

    def __init__(self, limit: float) -> None:
        self.limit = limit
        self._changed = threading.Condition(threading.Lock())
        self._in_use: Counter[int] = Counter()
        self._forking = False

    def checkout(self, dbapi_connection: Any, record: Any, proxy: Any) -> None:
        thread = record.info[self.KEY] = threading.get_ident()
        with self._changed:
            if self._forking:
                self._changed.wait_for(lambda: not self._forking, self.limit)
            self._in_use[thread] += 1

    def checkin(self, dbapi_connection: Any, record: Any) -> None:
        thread = record.info.pop(self.KEY, None)
        with self._changed:
            if self._in_use[thread] > 0:  # else taken before the fork, in the parent
                self._in_use[thread] -= 1
            self._changed.notify_all()

    def before_fork(self) -> None:
        me = threading.get_ident()
        with self._changed:
            self._forking = True
            self._changed.wait_for(
                lambda: all(thread == me for thread in +self._in_use), self.limit)
            if +self._in_use:
                logger.warning(
                    "sqlinbox: forking while %d SQLite connections are in use; the child "
                    "may find the database locked", sum(self._in_use.values()))

    def after_fork_in_parent(self) -> None:
        with self._changed:
            self._forking = False
            self._changed.notify_all()

    def after_fork_in_child(self) -> None:
        """The child's other threads are gone, and its own connections are the parent's."""
        self._changed = threading.Condition(threading.Lock())
        self._in_use = Counter()
        self._forking = False


#: the gate of every SQLite engine of this process
FORK_GATE = ForkGate(BUSY_TIMEOUT + 5.0)
os.register_at_fork(before=FORK_GATE.before_fork,
                    after_in_parent=FORK_GATE.after_fork_in_parent,
                    after_in_child=FORK_GATE.after_fork_in_child)


def _regexp(pattern: str, value: str) -> bool:
    """SQLite's ``value REGEXP pattern``."""
    return re.match(pattern, value) is not None


def _sha256(key: object) -> str | None:
    """SQLite's ``sqlinbox_sha256(key)``: the slots' name of a limit key (a number as
    the text Python reads it as)."""
    return None if key is None else digest(str(key))


class SQLiteDialect(Dialect):
    # -- core: time, identifiers, capabilities ---------------------------------------------
    names = ("sqlite",)
    now = NOW
    #: read at each statement's step, after the write lock was had
    instant = NOW
    pinned_now = ":sqlinbox_now"
    eta_value = f"COALESCE(:eta, {NOW})"
    #: a single writer: claims need no row locks
    capabilities = Capabilities(returning=True)
    generated_id_type = "INTEGER PRIMARY KEY AUTOINCREMENT"
    column_types = {
        Role.ID: "INTEGER NOT NULL",
        Role.PAYLOAD: "BLOB NOT NULL",
        Role.HEADERS: "TEXT",
        Role.GROUP: "TEXT",
        Role.PARTITION_KEY: "TEXT",
        Role.ATTEMPT: "INTEGER NOT NULL DEFAULT 0",
        Role.LOCKED_UNTIL: "REAL",
        Role.AVAILABLE_AT: f"REAL NOT NULL DEFAULT {NOW}",
        Role.PRIORITY: "INTEGER NOT NULL DEFAULT 0",
        Role.PROCESSED_AT: "REAL",
    }

    def later(self, seconds: str) -> str:
        return f"{self.now} + {seconds}"

    def envelope_header(self, column: str, header: str) -> str:
        return f"json_extract({column}, '$.headers.{header}')"

    def limit_key_of(self, column: str) -> str:
        return self.envelope_header(column, "limit_key")

    def exact_key(self, key: str) -> str:
        """As text: ``json_extract`` gives a number for a key sent as one (a row from
        before keys were checked), and ``7 NOT IN ('7')`` holds."""
        return f"CAST({key} AS TEXT)"

    def key_digest(self, key: str) -> str:
        return f"sqlinbox_sha256({key})"

    def slot_list(self, parts: Sequence[str]) -> str:
        joined = " || ':' || ".join(parts)
        return f"group_concat({joined})"

    def epoch(self, moment: str) -> str:
        return moment  # times are epoch seconds here already

    def age(self, moment: str) -> str:
        return f"{self.now} - {moment}"

    # -- driver: engines, sessions, driver SQL, error codes --------------------------------
    #: the write lock up front, as the engine's transactions take it (prepare_engine)
    begin_write = "BEGIN IMMEDIATE"
    #: connections are in autocommit mode already (on_connect): a lone INSERT is its own
    #: transaction, taking the write lock as it starts
    autocommit_write = True
    #: SQLITE_MAX_VARIABLE_NUMBER's default (999 before SQLite 3.32)
    max_bind_params = 32766 if sqlite3.sqlite_version_info >= (3, 32) else 999

    def is_transient(self, exc: BaseException) -> bool:
        return "database is locked" in str(exc) or "database is busy" in str(exc)

    key_types = ("TEXT", "TEXT", "TEXT", "REAL")

    def unique_ddl(self, spec: TableSpec) -> list[str]:
        """No ADD COLUMN IF NOT EXISTS here: one writer at a time, the look for the column
        and its ALTER share the write lock."""
        alter, index = super().unique_ddl(spec)
        return [alter.replace(" IF NOT EXISTS", ""), index]

    def is_unique_violation(self, exc: BaseException) -> bool:
        orig = exc.orig if isinstance(exc, DBAPIError) else None
        return str(orig).startswith("UNIQUE constraint failed")

    def prepare_engine(self, engine: Engine, sqlite_begin: str = "IMMEDIATE") -> None:
        """pysqlite's own BEGIN is off (:meth:`on_connect`); ours takes the write lock up
        front (IMMEDIATE) unless a connection asks otherwise (execution option
        ``sqlite_begin``), so a transaction never fails to upgrade a read lock half-way.
        Its connections are in use only between forks (:class:`ForkGate`)."""
        super().prepare_engine(engine)
        event.listen(engine, "checkout", FORK_GATE.checkout)
        event.listen(engine, "checkin", FORK_GATE.checkin)
        event.listen(engine, "begin", lambda conn: conn.exec_driver_sql(
            "BEGIN " + conn.get_execution_options().get("sqlite_begin", sqlite_begin)))

    def on_connect(self, dbapi_connection: Any) -> None:
        """WAL lets readers run beside the single writer; the busy timeout waits for it."""
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        # the busy timeout first: switching to WAL needs the lock another connection may hold
        cursor.execute(f"PRAGMA busy_timeout={int(self.busy_timeout * 1000)}")
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.close()
        # topic bindings match with Python's re, as kombu's own topic exchange does
        dbapi_connection.create_function("regexp", 2, _regexp, deterministic=True)
        # a limit key's slots are named by its digest (see ``key_digest``)
        dbapi_connection.create_function("sqlinbox_sha256", 1, _sha256, deterministic=True)

    #: seconds a statement waits for the database's write lock
    busy_timeout = BUSY_TIMEOUT

    # -- selection: a claim's row selection ------------------------------------------------
    rare = "unlikely({})"

    def among(self, row_id: str, ids: str, order: str) -> tuple[str, str, str]:
        """The order's columns as expressions (``+column``), which no index serves: the
        planner then looks the ids up instead of walking the claim index in order."""
        join, among, _ = super().among(row_id, ids, order)
        return join, among, ", ".join("+" + column for column in order.split(", "))

    # -- queue: the hot path: claims and settlements ---------------------------------------
    def claim_statements(self, spec: TableSpec, selection: str) -> tuple[TextClause, ...]:
        f = self.fields(spec)
        claim = (
            f"UPDATE {f['table']} SET {f['locked_until']} = {self.later(':lease')}, "
            f"{f['attempt']} = {f['attempt']} + 1 "
            f"WHERE {f['id']} IN (SELECT r.{f['id']} FROM {f['table']} AS r {selection}) "
            f"RETURNING {self.returned_columns(spec)}"
        )
        return (_expanding(claim),)

    def any_ready(self, spec: TableSpec) -> TextClause:
        """A claim begins with the write lock on the whole file, which every publisher
        waits for: an idle consumer reads first (in WAL, beside any writer). The claim's
        readiness, without its FIFO head check (a row it finds that is not a head only
        costs one claim that takes nothing), in claim order: the claim index's walk."""
        ready = self.ready_filter(spec, heads=False)
        return text(f"SELECT 1 FROM {self.fields(spec)['table']} AS r WHERE {ready} "
                    f"ORDER BY {self.claim_order(spec, 'r')} LIMIT 1")

    # -- schema: DDL, table checks, the claim's plan ---------------------------------------
    explain_prefix = "EXPLAIN QUERY PLAN"

    def id_generated(self, conn: Connection, spec: TableSpec, column: Mapping[str, Any]
                     ) -> bool:
        """Only a column declared ``INTEGER PRIMARY KEY`` (exactly: not ``INT``, not
        ``BIGINT``) of a rowid table stands for the rowid, which SQLite generates; any
        other primary key left out of an INSERT is NULL."""
        if column.get("default") is not None:
            return True
        schema = f"{self.quote(spec.schema)}." if spec.schema else ""
        table = conn.execute(text(f"SELECT sql FROM {schema}sqlite_master WHERE type = "
                                  "'table' AND name = :name"), {"name": spec.table}).scalar()
        info = conn.exec_driver_sql(f"PRAGMA {schema}table_info({self.quote(spec.table)})")
        keys = [(row.name, row.type) for row in info if row.pk]
        return (len(keys) == 1 and keys[0][0].lower() == column["name"].lower()
                and keys[0][1].upper() == "INTEGER"
                and "WITHOUT ROWID" not in str(table or "").upper())

    def plan_lines(self, conn: Connection, statement: TextClause,
                   params: Mapping[str, Any]) -> list[str]:
        return [str(row.detail) for row in conn.execute(statement, dict(params))]

    def plan_problem(self, plan: str, index: str) -> str | None:
        """A plan that sorts in a temporary tree does not read the index in claim order."""
        if "TEMP B-TREE" in plan:
            return f"the claim's plan sorts (its index {index} is missing or unusable)"
        return super().plan_problem(plan, index)

    def time_types(self) -> tuple[type[Any], ...]:
        return (sqltypes.Float, sqltypes.Numeric, sqltypes.Integer)

    def alter_type_ddl(self, spec: TableSpec, column: ColumnSpec) -> str:
        return (
            f"-- SQLite cannot change a column's type: recreate {spec.table} with "
            f"{self.column_ddl(column)}"
        )

    def ensure_table(self, conn: Connection, spec: TableSpec, create: bool) -> bool:
        """Row mode also needs ids that never repeat: its task ids are derived from them."""
        text_payload = super().ensure_table(conn, spec, create)
        if spec.rows is not None and self.reuses_ids(conn, spec):
            raise SchemaMismatch(
                f"table {spec.table!r}: its id is SQLite's id INTEGER PRIMARY KEY without "
                "AUTOINCREMENT, which gives a new row the id of the last row deleted; row "
                "mode derives each row's Celery task id from its id, so two rows would run "
                "with the same task id (one's result overwriting the other's, a revoke "
                "hitting both). Declare it id INTEGER PRIMARY KEY AUTOINCREMENT (SQLite "
                "cannot alter a column: create the table anew and copy its rows over)")
        return text_payload

    def reuses_ids(self, conn: Connection, spec: TableSpec) -> bool:
        """Whether the id column is the rowid (``INTEGER PRIMARY KEY``) of a table
        declared without AUTOINCREMENT, the one keyword that keeps rowids from repeating."""
        schema = f"{self.quote(spec.schema)}." if spec.schema else ""
        ddl = conn.execute(text(f"SELECT sql FROM {schema}sqlite_master WHERE type = 'table' "
                                "AND name = :name"), {"name": spec.table}).scalar_one()
        keys = [(name, kind) for _, name, kind, _, _, pk in conn.execute(text(
            f"PRAGMA {schema}table_info({self.quote(spec.table)})")) if pk]
        rowid = (len(keys) == 1 and keys[0][0].lower() == spec.name_of(Role.ID).lower()
                 and keys[0][1].upper() == "INTEGER")
        return rowid and not re.search(r"\bAUTOINCREMENT\b", ddl, re.IGNORECASE)

    # -- routing: bindings, the queue registry, transient queues ---------------------------
    seconds_type = "REAL"

    # -- results: the result tables (celery_ext.results) ----------------------------------
    result_time_type = "REAL"

    # -- schedules: the schedule tables (celery_ext.beat) ---------------------------------
    schedule_time_type = "REAL"

    # -- outbox: the outbox's statements (celery_ext.outbox) -------------------------------
    outbox_column_types = {
        "id": "TEXT NOT NULL",
        "task_id": "TEXT",
        "task_name": "TEXT",
        "exchange": "TEXT NOT NULL",
        "routing_key": "TEXT NOT NULL",
        "headers": "TEXT NOT NULL",
        "properties": "TEXT NOT NULL",
        "body": "BLOB NOT NULL",
        "created_at": "REAL NOT NULL",
        "processed_at": "REAL",
        "republished_at": "REAL",
    }

    def outbox_ago(self) -> str:
        return f"{self.now} - :older_than"

    #: deferred: the outbox's transactions start with their write, its reads lock nothing
    outbox_engine_options = {"sqlite_begin": "DEFERRED"}

    def outbox_reads_first(self, conn: Connection) -> Connection:
        return conn.execution_options(sqlite_begin="DEFERRED")

    def outbox_locks_first(self, conn: Connection) -> Connection:
        return conn.execution_options(sqlite_begin="IMMEDIATE")

    @contextmanager
    def outbox_lock_wait(self, conn: Connection, seconds: float) -> Iterator[None]:
        """The busy timeout of ``conn`` set to ``seconds`` on the DBAPI connection before
        the transaction begins, since beginning may already take the lock (BEGIN
        IMMEDIATE), and restored after."""
        raw = conn.connection.dbapi_connection
        assert raw is not None
        (previous,) = raw.execute("PRAGMA busy_timeout").fetchone()
        raw.execute(f"PRAGMA busy_timeout = {int(seconds * 1000)}")
        try:
            yield
        finally:
            raw.execute(f"PRAGMA busy_timeout = {int(previous)}")

    def outbox_lock_timed_out(self, exc: BaseException) -> bool:
        return isinstance(exc, OperationalError) and (
            "locked" in str(exc) or "busy" in str(exc))

    # -- wakeups: wake-ups and advisory key locks ------------------------------------------
    def signal_directory(self) -> str | None:
        """``<database file>-wake``: writers and readers of a file share its host."""
        database = self.engine.url.database if self.engine is not None else None
        if not database or database.startswith("file:"):  # a URI: no plain path to use
            return None
        return os.path.abspath(database) + "-wake"
