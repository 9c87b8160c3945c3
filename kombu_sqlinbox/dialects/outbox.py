"""The transactional outbox's statements (:mod:`celery_ext.outbox`). Its table arrives as
role -> column name (validated by :mod:`celery_ext.declaration`); names are quoted here,
values bound."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any, ClassVar

from sqlalchemy import Connection, TextClause, text
from sqlalchemy.engine import Engine

from .core import DialectCore
from .driver import _expanding


class OutboxFamily(DialectCore):
    """Every statement of the outbox, and how its transactions begin."""

    #: SQL types of the default outbox layout by role; "id" is the type of an id the
    #: outbox supplies (a UUID), a generated id takes ``generated_id_type``
    outbox_column_types: ClassVar[Mapping[str, str]] = {}
    #: whether the record of a publish outside a caller's transaction is written in
    #: autocommit mode (one round trip instead of BEGIN, INSERT, COMMIT); only where
    #: switching a pooled connection to autocommit costs no round trip of its own
    outbox_autocommit: ClassVar[bool] = False
    #: ``engine_for`` arguments of an engine the outbox makes from a URL
    outbox_engine_options: ClassVar[Mapping[str, Any]] = {}

    def outbox_fields(
        self, table: str, schema: str | None, columns: dict[str, str],
    ) -> dict[str, str]:
        """Template values: ``{table}``, ``{now}`` and one quoted name per declared role."""
        ref = self.quote(table) if schema is None else f"{self.quote(schema)}.{self.quote(table)}"
        return {"table": ref, "now": self.now,
                **{role: self.quote(name) for role, name in columns.items()}}

    def outbox_ago(self) -> str:
        """The database's time ``:older_than`` seconds ago, comparable with its time columns."""
        raise NotImplementedError

    def outbox_returning(self, f: dict[str, str]) -> str:
        """What makes an INSERT return the generated record id (empty: read ``lastrowid``)."""
        return f" RETURNING {f['id']}" if self.capabilities.returning else ""

    def outbox_prune_sql(self, f: dict[str, str]) -> str:
        """Delete up to ``:limit`` records processed before ``:older_than`` seconds ago."""
        return (
            f"DELETE FROM {f['table']} WHERE {f['id']} IN (SELECT {f['id']} FROM {f['table']} "
            f"WHERE {f['processed_at']} < {self.outbox_ago()} LIMIT :limit)"
        )

    def outbox_statements(
        self, table: str, schema: str | None, columns: dict[str, str], generated_id: bool,
    ) -> dict[str, TextClause]:
        """Every outbox statement for one table: insert, mark, processed, due, claim, unclaim,
        prune, status, drop."""
        f = self.outbox_fields(table, schema, columns)
        values = [role for role in ("id", "task_id", "task_name", "exchange", "routing_key",
                                    "headers", "properties", "body") if role in columns]
        if generated_id:
            values.remove("id")
        insert = (
            f"INSERT INTO {f['table']} ({', '.join(f[r] for r in values)}, {f['created_at']}) "
            f"VALUES ({', '.join(':' + r for r in values)}, {self.now})"
        )
        if generated_id:
            insert += self.outbox_returning(f)
        unprocessed = f"{f['processed_at']} IS NULL"
        oldest = f"MIN(CASE WHEN {unprocessed} THEN {f['created_at']} END)"
        statements = {
            "insert": text(insert),
            "mark": text(
                f"UPDATE {f['table']} SET {f['processed_at']} = {self.now} "
                f"WHERE {f['id']} = :id AND {unprocessed}"),
            "processed": text(
                f"SELECT CASE WHEN {unprocessed} THEN 0 ELSE 1 END FROM {f['table']} "
                f"WHERE {f['id']} = :id"),
            # republish: the records due (unprocessed, last sent longer than :older_than
            # ago) after the run's last id, locked so that a republisher running at the
            # same moment skips them ...
            "due": text(
                f"SELECT r.{f['id']}, r.{f['exchange']}, r.{f['routing_key']}, "
                f"r.{f['headers']}, r.{f['properties']}, r.{f['body']} FROM {f['table']} AS r "
                f"WHERE r.{unprocessed} AND COALESCE(r.{f['republished_at']}, "
                f"r.{f['created_at']}) <= {self.outbox_ago()} AND r.{f['id']} > :after "
                f"ORDER BY r.{f['id']} LIMIT :limit {self.lock_clause}"),
            # ... and claimed in the same transaction, before they are sent
            "claim": _expanding(
                f"UPDATE {f['table']} SET {f['republished_at']} = {self.now} "
                f"WHERE {f['id']} IN :ids"),
            # claimed records a broker error kept from being sent: due again at once
            "unclaim": _expanding(
                f"UPDATE {f['table']} SET {f['republished_at']} = NULL WHERE {f['id']} IN :ids"),
            "prune": text(self.outbox_prune_sql(f)),
            "status": text(
                f"SELECT COALESCE(SUM(CASE WHEN {unprocessed} THEN 1 ELSE 0 END), 0), "
                f"COALESCE(SUM(CASE WHEN {unprocessed} THEN 0 ELSE 1 END), 0), "
                f"{self.age(oldest)} FROM {f['table']}"),
            "drop": text(f"DROP TABLE IF EXISTS {f['table']}"),
            # the dashboard's: the records, and the unprocessed ones (on the index), counted
            # no further than :limit; the oldest unprocessed (the first by id) on the index
            "records_upto": text(f"SELECT COUNT(*) FROM (SELECT 1 AS one FROM {f['table']} "
                                 "LIMIT :limit) AS s"),
            "unprocessed_upto": text(f"SELECT COUNT(*) FROM (SELECT 1 AS one FROM {f['table']} "
                                     f"WHERE {unprocessed} LIMIT :limit) AS s"),
            "oldest_unprocessed": text(
                f"SELECT {self.age(f['created_at'])} FROM {f['table']} WHERE {unprocessed} "
                f"ORDER BY {f['processed_at']}, {f['id']} LIMIT 1"),
        }
        estimates = {"records_estimate": self.estimate_of(f"SELECT 1 FROM {f['table']}"),
                     "unprocessed_estimate": self.estimate_of(
                         f"SELECT 1 FROM {f['table']} WHERE {unprocessed}")}
        statements.update({name: found for name, found in estimates.items() if found is not None})
        return {name: self.clocked(statement) for name, statement in statements.items()}

    def outbox_insert(self, conn: Connection, statement: TextClause,
                      params: Mapping[str, Any]) -> Any:
        """Write one record and return the id the database generated for it (from RETURNING,
        or the cursor's ``lastrowid`` where the INSERT returns nothing)."""
        result = conn.execute(statement, dict(params))
        return result.scalar_one() if self.capabilities.returning else result.lastrowid

    def outbox_insert_autocommit(self, engine: Engine, sql: str,
                                 params: Mapping[str, Any]) -> Any:
        """Write one record alone in autocommit mode (``sql``: the INSERT compiled for the
        driver): one round trip instead of BEGIN, INSERT and COMMIT. Only where
        :attr:`outbox_autocommit` says the drivers switch autocommit without a round trip
        of their own. Returns the generated id, None where the outbox supplied it."""
        with engine.connect() as conn:
            dbapi = conn.connection.dbapi_connection
            assert dbapi is not None
            dbapi.autocommit = True
            try:
                result = conn.exec_driver_sql(sql, dict(params))
                return result.scalar_one() if result.returns_rows else None
            finally:
                if not conn.invalidated:
                    dbapi.autocommit = False

    def outbox_reads_first(self, conn: Connection) -> Connection:
        """``conn`` set up for a transaction that reads before it may write (the table
        check): where beginning can take the write lock, it does not."""
        return conn

    def outbox_locks_first(self, conn: Connection) -> Connection:
        """``conn`` set up for a transaction that must hold the write lock before it reads
        (the republish claim): where that is a choice, two such transactions take turns
        instead of both reading."""
        return conn

    def outbox_lock_wait(self, conn: Connection, seconds: float
                         ) -> AbstractContextManager[None]:
        """Around a transaction of ``conn`` (begun inside): how long it waits for the write
        lock, where the database has a single writer that the caller's own transaction may
        hold; unchanged elsewhere."""
        return nullcontext()

    def outbox_lock_timed_out(self, exc: BaseException) -> bool:
        """Whether ``exc`` ended a wait for the single writer's lock
        (:meth:`outbox_lock_wait`)."""
        return False

    def outbox_index_name(self, table: str) -> str:
        digest = hashlib.sha1(table.encode()).hexdigest()[:10]
        return self.quote(f"{table[:40]}_{digest}_outbox")

    def outbox_column_ddl(self, role: str, name: str, generated_id: bool) -> str:
        if role == "id":
            kind = self.generated_id_type if generated_id else (
                self.outbox_column_types["id"] + " PRIMARY KEY")
            return f"{self.quote(name)} {kind}"
        return f"{self.quote(name)} {self.outbox_column_types[role]}"

    def outbox_add_column_ddl(self, table: str, schema: str | None, role: str, name: str,
                              generated_id: bool) -> str:
        """ALTER TABLE adding a missing outbox column (shown to the user, not run)."""
        ref = self.outbox_fields(table, schema, {})["table"]
        return f"ALTER TABLE {ref} ADD COLUMN {self.outbox_column_ddl(role, name, generated_id)}"

    def outbox_create_ddl(
        self, table: str, schema: str | None, columns: dict[str, str], generated_id: bool,
    ) -> list[str]:
        """CREATE TABLE for the outbox, and its index on (processed_at, id), which serves the
        republish scan (unprocessed, by id) and pruning (processed before a moment)."""
        f = self.outbox_fields(table, schema, columns)
        body = ",\n    ".join(
            self.outbox_column_ddl(role, name, generated_id) for role, name in columns.items())
        return [
            f"CREATE TABLE IF NOT EXISTS {f['table']} (\n    {body}\n)",
            f"CREATE INDEX IF NOT EXISTS {self.outbox_index_name(table)} ON {f['table']} "
            f"({f['processed_at']}, {f['id']})",
        ]
