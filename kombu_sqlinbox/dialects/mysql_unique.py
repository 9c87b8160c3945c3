"""MariaDB/MySQL's unique keys (:mod:`.unique`): no partial index and no CREATE INDEX IF
NOT EXISTS, a taken key being the duplicate-key error of a plain INSERT."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, TextClause, text
from sqlalchemy.exc import DBAPIError

from ..tables import Role, TableSpec
from .unique import UNIQUE_COLUMN, UniqueFamily


class MySQLUniqueKeys(UniqueFamily):
    """The unique-key statements of :class:`~.mysql.MySQLDialect`."""

    #: a SHA-256 in hex, compared byte for byte whatever the table's collation
    unique_type = "CHAR(64) CHARACTER SET ascii COLLATE ascii_bin NULL"
    #: a locking read sees the holder a REPEATABLE READ caller's snapshot predates (a
    #: consistent read would not, and the send would look for it for ever)
    unique_find_lock = " LOCK IN SHARE MODE"

    def unique_refusal(self, spec: TableSpec) -> str | None:
        """No partial index: a processed row would hold its key for ever."""
        if spec.has(Role.PROCESSED_AT):
            return (f"table {spec.table!r} keeps processed rows (processed_at): unique keys "
                    "on MariaDB/MySQL need a table that deletes its finished rows")
        return None

    def unique_ddl(self, spec: TableSpec) -> list[str]:
        """One ALTER adds the column and a unique index on it: InnoDB's unique index lets
        any number of NULLs through, so it covers the rows with a key (no partial index
        here, nor CREATE INDEX IF NOT EXISTS on MySQL)."""
        column = self.quote(UNIQUE_COLUMN)
        return [f"ALTER TABLE {self.table_ref(spec)} ADD COLUMN {column} {self.unique_type}, "
                f"ADD UNIQUE INDEX {self.unique_index(spec)} ({column})"]

    def ddl_wait_statements(self, seconds: int) -> tuple[list[str], list[str]]:
        """The session's metadata lock wait (a day by default), reset after the DDL."""
        return ([f"SET SESSION lock_wait_timeout = {int(seconds)}"],
                ["SET SESSION lock_wait_timeout = DEFAULT"])

    def is_lock_timeout(self, exc: BaseException) -> bool:
        return bool(self.driver_error_code(exc) == 1205)  # ER_LOCK_WAIT_TIMEOUT

    def unique_insert(self, spec: TableSpec) -> TextClause:
        """A plain INSERT: a taken key is the unique index's duplicate-key error (never
        INSERT IGNORE, which would hide every other error as a warning)."""
        head, values = self.unique_values(spec)
        return text(f"{head} VALUES {values}")

    key_types = ("VARBINARY(255)", "CHAR(64) CHARACTER SET ascii COLLATE ascii_bin",
                 "TEXT", "DATETIME(6)")

    def key_ddl(self, table: str, columns: list[str], index: str) -> list[str]:
        """No CREATE INDEX IF NOT EXISTS here: the index goes inside CREATE TABLE."""
        return [f"CREATE TABLE IF NOT EXISTS {table} ({', '.join(columns)}, "
                f"INDEX {index} (expires_at)) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4"]

    def key_claim(self, table: str) -> str:
        """A plain INSERT: a held key is the primary key's duplicate-key error."""
        return super().key_claim(table).split(" ON CONFLICT")[0]

    def key_sweep(self, table: str) -> str:
        """No LIMIT in an IN subquery here; DELETE takes one itself."""
        return f"DELETE FROM {table} WHERE expires_at <= {self.now} LIMIT 16"

    def claim_key(self, conn: Connection, statement: TextClause,
                  params: dict[str, Any]) -> bool:
        try:
            conn.execute(statement, params)
        except DBAPIError as exc:
            if self.is_unique_violation(exc) and "PRIMARY" in str(exc.orig):
                return False
            raise
        return True

    def insert_unique(self, conn: Connection, spec: TableSpec, statement: TextClause,
                      params: dict[str, Any]) -> bool:
        """InnoDB undoes the failed statement alone: the transaction (a caller's) goes on."""
        try:
            conn.execute(statement, params)
        except DBAPIError as exc:
            if self.is_unique_violation(exc) and self.unique_index(spec).strip("`") in str(
                    exc.orig):
                return False
            raise
        return True
