"""MySQL 8 and MariaDB 10.6+: every statement the transport runs there.

Sessions run in UTC (``time_zone = '+00:00'``) so ``FROM_UNIXTIME`` and
``UTC_TIMESTAMP`` agree, in a strict ``sql_mode`` (a value a column cannot hold is an
error, never cut), and in READ COMMITTED so a claim's SKIP LOCKED scan does not keep gap
locks on rows it passed over.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import Connection, TextClause, inspect, text
from sqlalchemy import types as sqltypes
from sqlalchemy.exc import DBAPIError

from ..tables import ColumnSpec, Role, TableSpec
from .base import Dialect
from .core import Capabilities
from .driver import _expanding
from .mysql_ids import MySQLIdIndexes
from .mysql_unique import MySQLUniqueKeys
from .results import FINAL, HISTORY_COLUMNS, RESULT_ID_BYTES, Names
from .routing import TRANSIENT_ORDER, RoutingStatements
from .wakeups import no_wakeups

NOW = "UTC_TIMESTAMP(6)"
#: column types that hold at most 64 KiB: too small for a Celery message
SMALL_LOB_TYPES = ("TINYBLOB", "BLOB", "TINYTEXT", "TEXT", "VARCHAR", "VARBINARY", "CHAR")
#: the roles a Celery message fills, and the type that holds any message
LONG_TYPES = {Role.PAYLOAD: "LONGBLOB", Role.HEADERS: "LONGTEXT"}


#: the bytes the MySQL drivers escape in a bound value (sent as two bytes each)
ESCAPED = (b"\0", b"\n", b"\r", b"\x1a", b"'", b'"', b"\\")


class Utf8Name(sqltypes.TypeDecorator[str]):
    """A name bound as its UTF-8 bytes (:attr:`MySQLDialect.name_bind`)."""

    impl = sqltypes.LargeBinary
    cache_ok = True

    def process_bind_param(self, value: str | None, dialect: Any) -> bytes | None:
        return None if value is None else value.encode("utf-8")


class MySQLDialect(MySQLIdIndexes, MySQLUniqueKeys, Dialect):
    # -- core: time, identifiers, capabilities ---------------------------------------------
    names = ("mysql", "mariadb")
    capabilities = Capabilities(row_locks=True, skip_locked=True, key_locks=True)
    lock_clause = "FOR UPDATE SKIP LOCKED"
    now = NOW
    #: SYSDATE, unlike NOW, is read when evaluated (the session's time zone is UTC)
    instant = "SYSDATE(6)"
    pinned_now = "FROM_UNIXTIME(:sqlinbox_now)"
    eta_value = f"COALESCE(FROM_UNIXTIME(:eta), {NOW})"
    generated_id_type = "BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY"
    column_types = {
        Role.ID: "BIGINT NOT NULL",
        Role.PAYLOAD: "LONGBLOB NOT NULL",
        Role.HEADERS: "LONGTEXT",
        Role.GROUP: "VARCHAR(191)",
        Role.PARTITION_KEY: "VARCHAR(191)",
        Role.ATTEMPT: "INT NOT NULL DEFAULT 0",
        Role.LOCKED_UNTIL: "DATETIME(6) NULL",
        Role.AVAILABLE_AT: f"DATETIME(6) NOT NULL DEFAULT ({NOW})",
        Role.PRIORITY: "SMALLINT NOT NULL DEFAULT 0",
        Role.PROCESSED_AT: "DATETIME(6) NULL",
    }

    def quote(self, name: str) -> str:
        return "`" + name + "`"

    def later(self, seconds: str) -> str:
        return f"{self.now} + INTERVAL ({seconds} * 1000000) MICROSECOND"

    def envelope_header(self, column: str, header: str) -> str:
        return f"JSON_UNQUOTE(JSON_EXTRACT({column}, '$.headers.{header}'))"

    def limit_key_of(self, column: str) -> str:
        return self.envelope_header(column, "limit_key")

    def exact_key(self, key: str) -> str:
        """Byte for byte: JSON_UNQUOTE's collation ignores trailing spaces (and may
        ignore case), which would pass over ``Tenant `` with ``Tenant`` full, or
        ``proj.call_api `` with ``proj.call_api`` spent."""
        return f"CAST({key} AS BINARY)"

    def epoch(self, moment: str) -> str:
        return f"UNIX_TIMESTAMP({moment})"

    def age(self, moment: str) -> str:
        return f"TIMESTAMPDIFF(MICROSECOND, {moment}, {self.now}) / 1000000.0"

    # -- driver: engines, sessions, driver SQL, error codes --------------------------------
    #: the isolation level is set once per connection by SQLAlchemy, which also restores
    #: it after a transaction that asked for another (a queue's ``isolation_level``);
    #: every transaction of ours ends in COMMIT or ROLLBACK, so the pool's extra ROLLBACK
    #: on return (a round trip with pymysql) is skipped, and so is SQLAlchemy's ROLLBACK of
    #: a connection in autocommit (:meth:`.Database.alone`), which the server would ignore
    engine_defaults = {"isolation_level": "READ COMMITTED", "pool_reset_on_return": None,
                       "skip_autocommit_rollback": True}
    #: PyMySQL and MySQLdb send ``SET AUTOCOMMIT`` to switch; the server commits a lone
    #: statement before its reply (durable with ``innodb_flush_log_at_trx_commit=1``)
    autocommit_kept = True
    #: deadlock found, lock wait timeout
    transient_codes = frozenset({1213, 1205})

    def driver_error_code(self, exc: BaseException) -> Any:
        """The server's error number: PyMySQL also carries the SQLSTATE, which many
        errors share (23000 for every integrity error), so it cannot tell them apart."""
        orig = exc.orig if isinstance(exc, DBAPIError) else None
        return orig.args[0] if orig is not None and orig.args else None

    def is_transient(self, exc: BaseException) -> bool:
        return self.driver_error_code(exc) in self.transient_codes

    def is_unique_violation(self, exc: BaseException) -> bool:
        return bool(self.driver_error_code(exc) == 1062)  # ER_DUP_ENTRY

    def on_connect(self, dbapi_connection: Any) -> None:
        cursor = dbapi_connection.cursor()
        cursor.execute("SET time_zone = '+00:00'")
        # strict whatever the server's default: a value a column cannot hold is an error,
        # never cut or converted; the server's other modes stay as they are
        cursor.execute("SET SESSION sql_mode = CONCAT_WS(',', NULLIF(@@SESSION.sql_mode, ''), "
                       "'STRICT_ALL_TABLES')")
        cursor.execute("SELECT @@max_allowed_packet")
        (self.max_statement_bytes,) = cursor.fetchone()
        cursor.close()
        escape = getattr(dbapi_connection, "escape", None)  # PyMySQL's (mysqlclient: none)
        self.hex_binary = escape is not None and "X'" in escape(b"'")

    # -- selection: a claim's row selection ------------------------------------------------
    floor_time = "FROM_UNIXTIME(:{})"

    def above_floor(self, spec: TableSpec, alias: str = "r") -> str:
        """The floor as the start of an index range: InnoDB walks every delete-marked entry
        a range holds, so the floor must bound the range, not filter it. Behind the
        priority (the index's first column) it bounds only the default priority's range
        (0, where nearly every row is); the other priorities are read whole."""
        floor = super().above_floor(spec, alias)
        if not floor or not spec.has(Role.PRIORITY):
            return floor
        priority = f"{alias}.{self.quote(spec.name_of(Role.PRIORITY))}"
        return (f" AND ({priority} > 0 OR {priority} < 0 OR ({priority} = 0"
                f"{floor}))")

    def group_heads(self, spec: TableSpec) -> str:
        """MySQL's own loose index scan ("Using index for group-by"): the first row of
        each group read from the ``(group, id)`` index, a probe per group (a recursive
        CTE's correlated probe here reads the whole index)."""
        f = self.fields(spec)
        return (f"SELECT MIN(x.{f['id']}) AS id FROM {f['table']} AS x "
                f"WHERE x.{f['group']} IS NOT NULL{self.unfinished(spec, 'x')} "
                f"GROUP BY x.{f['group']}")

    # -- queue: the hot path: claims and settlements ---------------------------------------
    def claim_statements(self, spec: TableSpec, selection: str) -> tuple[TextClause, ...]:
        """No UPDATE ... RETURNING here: lock the rows, then lease them, same transaction.

        An ordered selection picks its candidates (``:candidates`` of them) in a plain
        read, and only those are locked, by id: a locking read visits the row of every
        delete-marked index entry it passes, which a plain read skips, and while purge
        lags (a snapshot held open) those entries pile up ahead of the ready rows. The
        candidates are checked again under the lock; one another claim holds is passed
        over, so a claim racing others may take fewer than ``:limit``."""
        f = self.fields(spec)
        ordered = f"ORDER BY {self.claim_order(spec, 'r')} LIMIT :limit"
        rows = f"{f['table']} AS r{self.index_hint(spec, 'PRIMARY')}"
        if selection.endswith(ordered):
            candidates = (f"SELECT r.{f['id']} FROM {f['table']} AS r{self.index_hint(spec)} "
                          f"{selection.removesuffix(':limit')}:candidates")
            # STRAIGHT_JOIN: the candidates first, whatever the table's statistics say (a
            # table that looks small would otherwise be scanned whole)
            rows = (f"({candidates}) AS c STRAIGHT_JOIN {rows} ON r.{f['id']} = c.{f['id']}")
            selection = f"WHERE {self.ready_filter(spec)} {ordered}"
        select = (f"SELECT {self.returned_columns(spec, 'r')} FROM {rows} "
                  f"{selection} {self.lock_clause}")
        lease = (
            f"UPDATE {self.by_id(spec)[0]} SET {f['locked_until']} = {self.later(':lease')}, "
            f"{f['attempt']} = {f['attempt']} + 1 WHERE {f['id']} IN :ids"
        )
        return (_expanding(select), _expanding(lease))

    # -- schema: DDL, table checks, the claim's plan ---------------------------------------
    id_generator_ddl = "ALTER TABLE {table} MODIFY {column} BIGINT NOT NULL AUTO_INCREMENT"

    def plan_problem(self, plan: str, index: str) -> str | None:
        """A full scan (``type=ALL``) or a filesort: the claim index does not serve it."""
        if "type=ALL" in plan or "filesort" in plan:
            return f"the claim's plan scans the table or sorts (its index {index} is missing)"
        return super().plan_problem(plan, index)

    def create_ddl(self, spec: TableSpec) -> list[str]:
        """MySQL has no CREATE INDEX IF NOT EXISTS: the claim index goes inside CREATE TABLE."""
        create = super().create_ddl(spec)[0]
        processed = ""
        if spec.has(Role.PROCESSED_AT):
            processed = f"{self.quote(spec.name_of(Role.PROCESSED_AT))}, "
        indexes = "".join(
            f",\n    INDEX {self.index_name(spec, suffix)} ({processed}{columns})"
            for suffix, columns in self.index_columns(spec).items()
        )
        return [create[: -len("\n)")] + indexes + "\n) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4"]

    def id_generated(self, conn: Connection, spec: TableSpec, column: Mapping[str, Any]
                     ) -> bool:
        """Also a default SQLAlchemy does not reflect: MariaDB's ``DEFAULT NEXT VALUE FOR
        <sequence>`` (shown as ``nextval(...)``), MySQL's expression defaults."""
        if super().id_generated(conn, spec, column):
            return True
        default = conn.execute(text(
            "SELECT COLUMN_DEFAULT FROM information_schema.COLUMNS WHERE TABLE_SCHEMA = "
            "COALESCE(:schema, DATABASE()) AND TABLE_NAME = :table AND COLUMN_NAME = :column"
        ), {"schema": spec.schema, "table": spec.table, "column": column["name"]}).scalar()
        return default is not None and str(default).upper() != "NULL"

    def type_problem(self, role: Role, reflected: sqltypes.TypeEngine[Any]) -> str | None:
        problem = super().type_problem(role, reflected)
        small = type(reflected).__name__.upper() in SMALL_LOB_TYPES
        if problem is None and small and role in LONG_TYPES:
            return f"has type {reflected}, which holds at most 64 KiB; use {LONG_TYPES[role]}"
        return problem

    def alter_type_ddl(self, spec: TableSpec, column: ColumnSpec) -> str:
        return f"ALTER TABLE {self.table_ref(spec)} MODIFY COLUMN {self.column_ddl(column)}"

    #: MySQL commits the open transaction before any DDL
    transactional_ddl = False

    # -- operations: the dashboard's estimates --------------------------------------------
    def estimate_of(self, select: str) -> TextClause | None:
        """The plan's rows: InnoDB's running count of the table's rows."""
        return text(f"EXPLAIN {select}")

    def estimated_rows(self, conn: Connection, statement: TextClause) -> int:
        return int(conn.execute(statement).mappings().one()["rows"] or 0)

    # -- routing: bindings, the queue registry, transient queues ---------------------------
    #: names compare byte for byte, as kombu compares them: binary strings (255 characters
    #: of UTF-8), since no text collation MySQL and MariaDB share does (the default folds
    #: case; ``utf8mb4_bin`` ignores trailing spaces, so ``'alice' = 'alice '``)
    name_type = "VARBINARY(1020)"
    seconds_type = "DOUBLE"
    body_type = "LONGBLOB"
    #: 255 characters of emoji make a pattern of 1277 bytes: more than a name column holds
    pattern_type = "BLOB"
    #: names are bound as their UTF-8 bytes: a binary column stores a string as the bytes
    #: of the connection's character set, so a process whose URL names another
    #: (``?charset=latin1``) would write names no other process's match
    name_bind = Utf8Name()

    def name_text(self, column: str) -> str:
        """A name read back as text (the driver returns a binary string as bytes)."""
        return f"CONVERT({column} USING utf8mb4)"

    def matches(self, value: str, pattern: str) -> str:
        """Both sides read as text: MySQL 8.0.22 and later refuse a binary string in REGEXP
        (MariaDB takes it); ``utf8mb4_bin`` keeps the match case-sensitive."""
        return (f"{self.name_text(value)} COLLATE utf8mb4_bin REGEXP "
                f"{self.name_text(pattern)} COLLATE utf8mb4_bin")

    def routing_problems(self, conn: Connection,
                         names: Sequence[str]) -> list[tuple[str, str]]:
        """Routing tables made when names were text: its collation ignores trailing spaces
        (``'alice' = 'alice '``: one queue's messages go to the other). Changing the
        columns to binary strings keeps every name as it is. Also a transient messages'
        headers column of at most 64 KiB (made by an earlier version)."""
        inspector = inspect(conn)
        problems = []
        for table, columns in zip(names, RoutingStatements.name_columns, strict=True):
            if not inspector.has_table(table):
                continue
            found = {column["name"]: column["type"] for column in inspector.get_columns(table)}
            text_columns = [name for name in columns
                            if name in found and not isinstance(found[name], sqltypes._Binary)]
            if text_columns:
                modify = ", ".join(
                    f"MODIFY {self.quote(column)} "
                    f"{self.pattern_type if column == 'pattern' else self.name_type} NOT NULL"
                    for column in text_columns)
                problems.append((table, (
                    f"column(s) {', '.join(text_columns)} hold names as text, whose "
                    "comparison may ignore trailing spaces ('alice' = 'alice '); make them "
                    "binary strings once no process of an earlier version uses them (it "
                    "would read the names as bytes and route nothing through them) with:"
                    f"\nALTER TABLE {self.quote(table)} {modify};")))
            if table == names[2] and type(found.get("headers")).__name__ in SMALL_LOB_TYPES:
                problems.append((table, (
                    "column headers holds at most 64 KiB: a message with larger headers "
                    "is refused, or cut short and lost on a server that is not strict; "
                    f"make it LONGTEXT with:\nALTER TABLE {self.quote(table)} "
                    f"MODIFY headers {self.column_types[Role.HEADERS]};")))
        return problems

    def upsert(self, table: str, keys: Sequence[str], values: Sequence[str],
               added: Sequence[str] = ()) -> str:
        columns = [*keys, *values, *added]
        updates = ", ".join([*(f"{c} = VALUES({c})" for c in values or ([] if added else keys[:1])),
                             *(f"{c} = {c} + VALUES({c})" for c in added)])
        return (f"INSERT INTO {table} ({', '.join(columns)}) "
                f"VALUES ({', '.join(':' + c for c in columns)}) "
                f"ON DUPLICATE KEY UPDATE {updates}")

    def delete_some(self, table: str, condition: str) -> str:
        return f"DELETE FROM {table} WHERE {condition} LIMIT :limit"

    def prune_rows(self, budget: str) -> str:
        """One statement, in key order (no subquery of the table a DELETE writes)."""
        return self.delete_some(budget, "name = :name AND window_no < :window "
                                "ORDER BY window_no, shard")

    def transient_claim(self, messages: str, fresh: str) -> tuple[TextClause, ...]:
        return (text(f"SELECT id, payload, headers, priority FROM {messages} "
                     f"WHERE queue = :queue AND {fresh} ORDER BY {TRANSIENT_ORDER} "
                     f"LIMIT :limit {self.lock_clause}"),
                _expanding(f"DELETE {messages} FROM {messages} FORCE INDEX (PRIMARY) "
                           "WHERE id IN :ids"))

    def transient_claim_alone(self, messages: str, fresh: str) -> tuple[TextClause, TextClause]:
        """MariaDB's DELETE returns the rows it deleted (MySQL's does not)."""
        return (text(f"SELECT id FROM {messages} WHERE queue = :queue AND {fresh} "
                     f"ORDER BY {TRANSIENT_ORDER} LIMIT :limit"),
                _expanding(f"DELETE FROM {messages} WHERE id IN :ids "
                           "RETURNING id, payload, headers, priority"))

    def routing_ddl(self, queues: str, bindings: str, messages: str,
                    names: tuple[str, str, str]) -> list[str]:
        return _indexes_inside(super().routing_ddl(queues, bindings, messages, names))

    def limit_ddl(self, statements: list[str]) -> list[str]:
        return _indexes_inside(statements)

    # -- results: the result tables (celery_ext.results) ----------------------------------
    #: ids compared byte for byte, as Celery compares them
    result_id_type = f"VARBINARY({RESULT_ID_BYTES})"
    result_text_type = "VARCHAR(255)"
    result_text_chars = 255
    result_meta_type = "LONGBLOB"
    result_meta_bytes = (1 << 32) - 1
    result_time_type = "DOUBLE"

    #: the driver sends a bound bytes value in hex (PyMySQL 1.1 and later: twice its
    #: size); else escaped (each of :data:`ESCAPED` as two bytes)
    hex_binary = False

    def sent_bytes(self, value: bytes | str) -> int:
        """PyMySQL and mysqlclient put a bound value in the statement's text: bytes in
        hex (PyMySQL) or escaped, text escaped."""
        if isinstance(value, bytes) and self.hex_binary:
            return 2 * len(value)
        data = value.encode("utf-8") if isinstance(value, str) else value
        return len(data) + sum(data.count(byte) for byte in ESCAPED)

    def result_upsert(self, table: str, key: str, values: Sequence[tuple[str, str]],
                      guarded: bool) -> str:
        """ON DUPLICATE KEY UPDATE, each assignment guarded by the state as the earlier
        ones left it (``status`` comes last)."""
        columns = ", ".join(column for column, _ in values)
        given = ", ".join(value for _, value in values)
        updates = ", ".join(
            f"{column} = IF(status = '{FINAL}', {column}, VALUES({column}))" if guarded
            else f"{column} = VALUES({column})" for column, _ in values if column != key)
        return (f"INSERT INTO {table} ({columns}) VALUES ({given}) "
                f"ON DUPLICATE KEY UPDATE {updates}")

    def result_expire_sql(self, table: str, key: str) -> str:
        """MySQL takes no LIMIT in an IN subquery, but DELETE itself takes one."""
        return (f"DELETE FROM {table} WHERE date_done < {self.epoch(self.now)} - :expires "
                f"ORDER BY date_done LIMIT :limit")

    def result_ddl(self, quoted: Names, names: Names) -> list[str]:
        return _indexes_inside(super().result_ddl(quoted, names))

    def result_name(self, value: str) -> str:
        """Compared and grouped byte for byte: the column's collation ignores case and
        trailing spaces, which would count ``Shop.Pay`` as ``shop.pay``."""
        return f"CAST({value} AS BINARY)"

    def history_index(self, tasks: str, name: str) -> str:
        """MySQL has no CREATE INDEX IF NOT EXISTS (the store looks for it first)."""
        return f"CREATE INDEX {self.quote(name)} ON {tasks} {HISTORY_COLUMNS}"

    # -- schedules: the schedule tables (celery_ext.beat) ---------------------------------
    #: a name compared byte for byte, as the routing tables' (:attr:`name_type`)
    schedule_name_type = name_type
    #: JSON of any size the server takes (TEXT holds 64 KiB)
    schedule_text_type = "LONGTEXT"
    schedule_time_type = "DOUBLE"
    schedule_table_suffix = " ENGINE=InnoDB DEFAULT CHARSET=utf8mb4"

    def schedule_guard(self, seconds: int) -> tuple[list[str], list[str]]:
        """The server waits ``wait_timeout`` for a session's next statement, inside a
        transaction too (MySQL has no idle-in-transaction limit); restored after."""
        return ([f"SET SESSION wait_timeout = {seconds}"],
                ["SET SESSION wait_timeout = DEFAULT"])

    def insert_new(self, table: str, columns: str, values: str, key: str,
                   only_if: str = "") -> str:
        """INSERT IGNORE: a taken key writes nothing and counts no row (ON DUPLICATE KEY
        UPDATE would count one, the driver reporting rows found)."""
        rows = f"SELECT {values} FROM DUAL WHERE {only_if}" if only_if else f"VALUES ({values})"
        return f"INSERT IGNORE INTO {table} ({columns}) {rows}"

    # -- outbox: the outbox's statements (celery_ext.outbox) -------------------------------
    outbox_column_types = {
        "id": "VARCHAR(64) NOT NULL",
        "task_id": "VARCHAR(255)",
        "task_name": "VARCHAR(255)",
        "exchange": "VARCHAR(255) NOT NULL",
        "routing_key": "VARCHAR(255) NOT NULL",
        "headers": "LONGTEXT NOT NULL",
        "properties": "LONGTEXT NOT NULL",
        "body": "LONGBLOB NOT NULL",
        "created_at": "DATETIME(6) NOT NULL",
        "processed_at": "DATETIME(6) NULL",
        "republished_at": "DATETIME(6) NULL",
    }

    def outbox_ago(self) -> str:
        return f"{self.now} - INTERVAL (:older_than * 1000000) MICROSECOND"

    def outbox_prune_sql(self, f: dict[str, str]) -> str:
        """MySQL takes no LIMIT in an IN subquery, but DELETE itself takes one."""
        return (
            f"DELETE FROM {f['table']} WHERE {f['processed_at']} < {self.outbox_ago()} "
            f"ORDER BY {f['processed_at']} LIMIT :limit"
        )

    def outbox_create_ddl(
        self, table: str, schema: str | None, columns: dict[str, str], generated_id: bool,
    ) -> list[str]:
        """No CREATE INDEX IF NOT EXISTS here: the index goes inside CREATE TABLE."""
        create, _ = super().outbox_create_ddl(table, schema, columns, generated_id)
        f = self.outbox_fields(table, schema, columns)
        index = (f",\n    INDEX {self.outbox_index_name(table)} "
                 f"({f['processed_at']}, {f['id']})\n)")
        return [create[: -len("\n)")] + index + " ENGINE=InnoDB DEFAULT CHARSET=utf8mb4"]

    # -- wakeups: wake-ups and advisory key locks ------------------------------------------
    def signal_directory(self) -> str | None:
        """MariaDB has no NOTIFY: consumers on the publisher's host are woken through
        ``<temp dir>/sqlinbox-<uid>/<server and database>``, those elsewhere poll.

        The root must be this user's alone (a stranger who made it first could watch or
        remove the sockets): otherwise a warning, and polling."""
        if self.engine is None:
            return None
        root = os.path.join(tempfile.gettempdir(), f"sqlinbox-{os.getuid()}")
        try:
            os.makedirs(root, mode=0o700, exist_ok=True)
            mode = os.lstat(root)
        except OSError as exc:
            no_wakeups(root, exc)
            return None
        if (not stat.S_ISDIR(mode.st_mode) or mode.st_uid != os.getuid()
                or mode.st_mode & 0o077):
            no_wakeups(root, "not a directory of this user's alone")
            return None
        url = self.engine.url
        server = f"{url.host or 'localhost'}:{url.port or 3306}/{url.database or ''}"
        return os.path.join(root, hashlib.sha256(server.encode()).hexdigest()[:16])

    def lock_names(self, space: int, keys: Sequence[str]) -> dict[str, str]:
        """GET_LOCK names (at most 64 characters): the table's space and a digest of the key."""
        prefix = f"sqlinbox:{space & 0xFFFFFFFF:08x}:"
        return {f"k{n}": prefix + hashlib.sha1(key.encode()).hexdigest()
                for n, key in enumerate(keys)}

    def try_key_locks(self, conn: Connection, space: int, keys: Sequence[str]) -> list[bool]:
        names = self.lock_names(space, keys)
        calls = ", ".join(f"GET_LOCK(:{name}, 0)" for name in names)
        row = conn.execute(text(f"SELECT {calls}"), names).one()
        return [value == 1 for value in row]

    def release_key_locks(self, conn: Connection, space: int, keys: Sequence[str]) -> None:
        names = self.lock_names(space, keys)
        calls = ", ".join(f"RELEASE_LOCK(:{name})" for name in names)
        conn.execute(text(f"SELECT {calls}"), names)


def _indexes_inside(statements: Sequence[str]) -> list[str]:
    """MySQL has no CREATE INDEX IF NOT EXISTS: each table's indexes go inside its
    CREATE TABLE (the statement before them)."""
    tables: list[str] = []
    for statement in statements:
        match = re.match(r"CREATE INDEX (?:IF NOT EXISTS )?(\S+) ON \S+ \((.*)\)$", statement)
        if match is None:
            tables.append(statement)
        else:
            tables[-1] = f"{tables[-1][:-1]}, INDEX {match[1]} ({match[2]}))"
    return [f"{table} ENGINE=InnoDB DEFAULT CHARSET=utf8mb4" for table in tables]
