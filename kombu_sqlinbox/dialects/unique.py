"""Unique keys: the column and unique index a queue table gets on its first publish with a
key, the publish that writes nothing when the key is taken, and the look-up of the row
that holds it.

The column holds the key's SHA-256 in hex: any key (a hostile one, a huge one) is 64
ASCII characters, compared byte for byte on every database, MariaDB's case-folding
collations included. A row holds its key while it is in the table (and, where the table
keeps finished rows, not yet processed): a NULL key is never in the index's way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from sqlalchemy import Connection, TextClause, bindparam, inspect, text
from sqlalchemy.exc import DBAPIError

from ..tables import Role, TableSpec
from .schema import SchemaFamily

#: the column the transport adds to a queue table for unique keys
UNIQUE_COLUMN = "sqlinbox_unique"


@dataclass(frozen=True)
class UniqueStatements:
    """A table's unique-key statements: ``insert`` returns the new row's id (none when the
    key is taken); ``find`` the row holding ``:unique_key`` (id, stored envelope, whether a
    lease holds it); ``release`` clears that row's key (fenced by the key)."""

    insert: TextClause
    find: TextClause
    release: TextClause


@dataclass(frozen=True)
class KeyStatements:
    """The timed keys' table (a key held for some seconds from its send, whatever becomes
    of its row): ``ddl``; ``expire`` drops ``:unique_key`` of ``:queue_table`` once expired;
    ``claim`` takes it for ``:seconds`` (a row back when taken); ``holder`` reads its task
    id; ``sweep`` deletes a few expired keys of any queue."""

    ddl: list[str]
    expire: TextClause
    claim: TextClause
    holder: TextClause
    sweep: TextClause


class UniqueFamily(SchemaFamily):
    """The statements of publishes with a unique key."""

    #: the key column's type: a SHA-256 in hex
    unique_type: ClassVar[str] = "TEXT"
    #: how the look-up of a key's holder reads the latest committed row, where a caller's
    #: snapshot (REPEATABLE READ) could hide the row the unique index found
    unique_find_lock: ClassVar[str] = ""
    #: how long (seconds) the key column's DDL waits for a lock on the table: a bound
    #: caller whose transaction read the table holds one until it ends, after the DDL
    unique_ddl_wait: ClassVar[int] = 10

    def unique_index(self, spec: TableSpec) -> str:
        return self.index_name(spec, "unique")

    def unique_scope(self, spec: TableSpec) -> str:
        """Which rows the index covers: those with a key (and not yet processed)."""
        column = self.quote(UNIQUE_COLUMN)
        covered = f"{column} IS NOT NULL"
        if spec.has(Role.PROCESSED_AT):
            covered += f" AND {self.quote(spec.name_of(Role.PROCESSED_AT))} IS NULL"
        return covered

    def unique_refusal(self, spec: TableSpec) -> str | None:
        """Why this database cannot hold unique keys in ``spec``'s table, or None."""
        return None

    def unique_ddl(self, spec: TableSpec) -> list[str]:
        """What a queue table needs for unique keys: the column, then its partial unique
        index (the ALTER comes first: on PostgreSQL its lock makes a second process's DDL
        wait for the first's to commit, then find it done)."""
        table = self.table_ref(spec)
        return [f"ALTER TABLE {table} ADD COLUMN IF NOT EXISTS {self.quote(UNIQUE_COLUMN)} "
                f"{self.unique_type}",
                f"CREATE UNIQUE INDEX IF NOT EXISTS {self.unique_index(spec)} ON {table} "
                f"({self.quote(UNIQUE_COLUMN)}) WHERE {self.unique_scope(spec)}"]

    def has_unique(self, conn: Connection, spec: TableSpec) -> bool:
        """Whether the table has the key column and its unique index."""
        inspector = inspect(conn)
        columns = {c["name"].lower() for c in inspector.get_columns(spec.table,
                                                                     schema=spec.schema)}
        if UNIQUE_COLUMN not in columns:
            return False
        index = self.unique_index(spec).strip('"`')
        return any(found["name"] == index and found["unique"]
                   for found in inspector.get_indexes(spec.table, schema=spec.schema))

    def add_unique(self, conn: Connection, spec: TableSpec, bounded: bool = True) -> None:
        """Run :meth:`unique_ddl`, waiting at most :attr:`unique_ddl_wait` for the table
        (``bounded``: in a transaction of the transport's own); a
        statement that fails because another process added the same at that moment (a
        duplicate column) is fine once the table is found ready. The statement's own error
        is raised, not the savepoint's (MariaDB's DDL ends it)."""
        bound, undo = self.ddl_wait_statements(self.unique_ddl_wait) if bounded else ([], [])
        for statement in bound:
            conn.exec_driver_sql(statement)
        failed: list[DBAPIError] = []
        try:
            with conn.begin_nested():
                for statement in self.unique_ddl(spec):
                    try:
                        conn.exec_driver_sql(statement)
                    except DBAPIError as exc:
                        failed.append(exc)
                        raise
        except DBAPIError as exc:
            if not self.has_unique(conn, spec):
                raise (failed or [exc])[0] from None
        finally:
            for statement in undo:
                conn.exec_driver_sql(statement)

    def ddl_wait_statements(self, seconds: int) -> tuple[list[str], list[str]]:
        """What bounds the wait of DDL in this transaction for a table's lock, and what
        undoes that after it (none where a writer waits for no other)."""
        return [], []

    def is_lock_timeout(self, exc: BaseException) -> bool:
        """Whether ``exc`` is the end of the wait :meth:`ddl_wait_statements` bounds."""
        return False

    def unique_statements(self, spec: TableSpec) -> UniqueStatements:
        f = self.fields(spec)
        column = self.quote(UNIQUE_COLUMN)
        stored = f["headers"] if spec.has(Role.HEADERS) else f["payload"]
        held = f"{f['locked_until']} > {self.now}" if spec.has(Role.LOCKED_UNTIL) else "1 = 0"
        scope = self.unique_scope(spec)
        find = text(f"SELECT {f['id']}, {stored}, CASE WHEN {held} THEN 1 ELSE 0 END "
                    f"FROM {f['table']} WHERE {column} = :unique_key AND {scope}"
                    f"{self.unique_find_lock}")
        release = text(f"UPDATE {f['table']} SET {column} = NULL "
                       f"WHERE {f['id']} = :id AND {column} = :unique_key")
        return UniqueStatements(self.clocked(self.unique_insert(spec)), self.clocked(find),
                                release)

    def unique_values(self, spec: TableSpec) -> tuple[str, str]:
        """The default publish statement's INSERT with the key column, as (head, VALUES)."""
        pairs = [*self._publish_values(spec), (self.quote(UNIQUE_COLUMN), ":unique_key")]
        head, _, values = self._insert(spec, pairs).partition(" VALUES ")
        return head, values

    def unique_insert(self, spec: TableSpec) -> TextClause:
        """The INSERT that writes nothing when the key is taken, returning the new id."""
        head, values = self.unique_values(spec)
        return text(f"{head} VALUES {values} ON CONFLICT ({self.quote(UNIQUE_COLUMN)}) "
                    f"WHERE {self.unique_scope(spec)} DO NOTHING "
                    f"RETURNING {self.quote(spec.name_of(Role.ID))}")

    #: the timed keys table's column types: queue table name, key, task id, expiry
    key_types: ClassVar[tuple[str, str, str, str]] = ("TEXT", "TEXT", "TEXT",
                                                       "TIMESTAMPTZ")

    def key_statements(self, prefix: str) -> KeyStatements:
        table = self.quote(f"{prefix}unique_keys")
        queue_type, key_type, task_type, time_type = self.key_types
        held = "queue_table = :queue_table AND unique_key = :unique_key"
        return KeyStatements(
            ddl=self.key_ddl(table, [
                f"queue_table {queue_type} NOT NULL", f"unique_key {key_type} NOT NULL",
                f"task_id {task_type}", f"expires_at {time_type} NOT NULL",
                "PRIMARY KEY (queue_table, unique_key)"],
                self.quote(f"{prefix}unique_keys_expiry")),
            expire=self.clocked(text(f"DELETE FROM {table} WHERE {held} "
                                     f"AND expires_at <= {self.now}")),
            claim=self.clocked(text(self.key_claim(table))),
            holder=text(f"SELECT task_id FROM {table} WHERE {held}{self.unique_find_lock}"),
            sweep=self.clocked(text(self.key_sweep(table))))

    def key_ddl(self, table: str, columns: list[str], index: str) -> list[str]:
        return [f"CREATE TABLE IF NOT EXISTS {table} ({', '.join(columns)})",
                f"CREATE INDEX IF NOT EXISTS {index} ON {table} (expires_at)"]

    def key_claim(self, table: str) -> str:
        return (f"INSERT INTO {table} (queue_table, unique_key, task_id, expires_at) "
                f"VALUES (:queue_table, :unique_key, :task_id, {self.later(':seconds')}) "
                "ON CONFLICT (queue_table, unique_key) DO NOTHING RETURNING task_id")

    def key_sweep(self, table: str) -> str:
        return (f"DELETE FROM {table} WHERE (queue_table, unique_key) IN (SELECT queue_table, "
                f"unique_key FROM {table} WHERE expires_at <= {self.now} LIMIT 16)")

    def claim_key(self, conn: Connection, statement: TextClause,
                  params: dict[str, Any]) -> bool:
        """Take a timed key; False when it is held."""
        return conn.execute(statement, params).first() is not None

    def insert_unique(self, conn: Connection, spec: TableSpec, statement: TextClause,
                      params: dict[str, Any]) -> bool:
        """Publish one row with its key; False (nothing written) when the key is taken."""
        return conn.execute(statement, params).first() is not None


def notified(statement: TextClause, channel: str) -> TextClause:
    """``statement`` (an INSERT ... RETURNING) NOTIFYing ``channel`` when it wrote, in the
    same statement: a row per row written, none when the key was taken."""
    return text(f"WITH published AS ({statement.text}) "
                "SELECT pg_notify(:channel, '') FROM published").bindparams(
        bindparam("channel", value=channel))
