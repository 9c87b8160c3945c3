"""The record store: the outbox table of one outbox, and every read and write of it.

The statements come from the database's dialect; the store creates or checks the
table once per database, writes records (in the caller's bound transaction, or
committed on a connection of its own), marks them processed, claims the due ones
for republish, prunes and counts.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any
from weakref import WeakKeyDictionary

from celery import Celery
from celery.utils.time import maybe_make_aware
from sqlalchemy import Connection, TextClause, inspect
from sqlalchemy.engine import Engine

from kombu_sqlinbox.broker import engine_for, same_database, sqlalchemy_url
from kombu_sqlinbox.dialects import Dialect, dialect_class, dialect_for
from kombu_sqlinbox.errors import SchemaMismatch, SqlInboxError

from .. import binding
from ..declaration import OutboxSpec

__all__ = [
    "Message", "OutboxError", "OutboxNotReady", "OutboxStatus", "Prepared", "RecordFailed",
    "RecordStore", "WriteLockHeld", "engine_from_url",
]


class OutboxError(SqlInboxError):
    """Base of the outbox's own errors."""


class OutboxNotReady(OutboxError):
    """A tracked publish or an operation needs the database, and none was given yet."""


class RecordFailed(OutboxError):
    """The record could not be written, so the task was not sent."""


class WriteLockHeld(RecordFailed):
    """On SQLite, the record waited for a write lock the running task's own transaction
    most likely holds (SQLite has one writer); waiting longer would hang."""


@dataclass(frozen=True)
class OutboxStatus:
    """Counts of the outbox table; ``oldest_unprocessed_age`` in seconds, None when none;
    ``about``: the counts are the planner's estimates (the table was too large to count)."""

    unprocessed: int
    processed: int
    oldest_unprocessed_age: float | None
    about: bool = False


@dataclass(frozen=True)
class Message:
    """A message as recorded: what ``Producer.publish`` needs to send it again unchanged."""

    body: bytes
    exchange: str
    routing_key: str
    headers: dict[str, Any]
    properties: dict[str, Any]

    @classmethod
    def from_row(cls, row: Sequence[Any]) -> Message:
        _, exchange, routing_key, headers, properties, body = row
        return cls(bytes(body), exchange, routing_key, json.loads(headers),
                   json.loads(properties))

    def eta_ahead(self) -> bool:
        """Whether the task's eta is still ahead: its first message then waits for it on a
        worker, and a copy sent now would run beside it at the eta."""
        eta = self.headers.get("eta")
        if not eta:
            return False
        return bool(maybe_make_aware(datetime.fromisoformat(eta)) > datetime.now(timezone.utc))


@dataclass(frozen=True)
class Prepared:
    """One database's compiled statements for the outbox table."""

    dialect: Dialect
    statements: dict[str, TextClause]
    #: the INSERT as driver SQL, where the dialect writes a lone record in autocommit mode
    lone_insert: str | None


def engine_from_url(url: str) -> Engine:
    """An engine for the outbox, set up by its dialect the way the sqlinbox transport sets
    up its own (WAL and explicit transactions on SQLite, READ COMMITTED on MySQL), with
    the outbox's own settings on top."""
    parsed = sqlalchemy_url(url)
    options = dialect_class(parsed.get_backend_name()).outbox_engine_options
    return engine_for(parsed, **options)[0]


class RecordStore:
    """The table of one outbox on its database (see the module doc).

    ``task_write_wait`` (seconds) bounds how long a record written by a running task
    waits for a single writer's lock its own transaction may hold.
    """

    def __init__(self, app: Celery, spec: OutboxSpec, *, create_table: bool,
                 retention: float, batch: int, task_write_wait: float) -> None:
        self.app = app
        self.spec = spec
        self.create_table = create_table
        self.retention = retention
        self.batch = batch
        self.task_write_wait = task_write_wait
        self._engine: Engine | None = None
        self._own_engine = False
        self._prepared: WeakKeyDictionary[Engine, Prepared] = WeakKeyDictionary()
        self._lock = threading.Lock()
        self._columns = spec.column_names()

    def use_spec(self, spec: OutboxSpec) -> None:
        """Use another table: its statements are made, and it is checked, on next use."""
        with self._lock:
            self.spec, self._columns = spec, spec.column_names()
            self._prepared.clear()

    # -- the database ------------------------------------------------------------
    def bind_engine(self, engine_or_url: Engine | str) -> Engine:
        """Give the outbox its database: an Engine of the service, or a URL."""
        if isinstance(engine_or_url, str):
            engine, own = engine_from_url(engine_or_url), True
        else:
            engine, own = engine_or_url, False
        with self._lock:
            if self._own_engine and self._engine is not None:
                self._engine.dispose()
            self._engine, self._own_engine = engine, own
        return engine

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            url = self.app.conf.get("outbox_url")
            if not url:
                raise OutboxNotReady(
                    "the outbox has no database yet: pass engine_or_url to install(), call "
                    "outbox.bind_engine(engine) at start-up (e.g. from worker_init), or set "
                    "app.conf.outbox_url")
            self.bind_engine(url)
        assert self._engine is not None
        return self._engine

    def close(self) -> None:
        """Dispose the engine the outbox created from a URL."""
        if self._own_engine and self._engine is not None:
            self._engine.dispose()

    def forget_connections(self) -> None:
        """In a forked process: drop the parent's pooled connections without closing them,
        and take a new lock (a thread of the parent, which the child has not, may hold its
        copy for ever: the republish on start holds it while it looks at the table)."""
        self._lock = threading.Lock()
        if self._engine is not None:
            self._engine.dispose(close=False)

    # -- the table ------------------------------------------------------------------
    def prepared(self, engine: Engine, conn: Connection | None = None) -> Prepared:
        """The statements for ``engine``; the table is created or checked once per database.

        ``conn`` is a transaction of the caller's on that database (a bound send, a
        transactional task's mark): a missing table is then created in it, never on a
        second connection, which could wait on the caller's own locks (SQLite has one
        writer).
        """
        found = self._prepared.get(engine)
        if found is None:
            with self._lock:
                found = self._prepared.get(engine)
                if found is None:
                    checked = any(same_database(engine, seen) for seen in self._prepared)
                    found = self._statements(engine)
                    if checked or self._check_table(engine, conn):
                        self._prepared[engine] = found
        return found

    def _check_table(self, engine: Engine, conn: Connection | None) -> bool:
        """Create the table if missing (when allowed) and check its columns; False when it
        was created in the caller's transaction ``conn``, which may still roll it back:
        it is remembered once seen committed. The look runs on a connection of the
        outbox's own, in a transaction that takes no write lock to begin. Where DDL
        commits the transaction it runs in (MySQL), the table is always created on that
        connection of the outbox's own.
        """
        dialect = dialect_for(engine)
        spec = self.spec
        with engine.connect() as own, dialect.outbox_reads_first(own).begin():
            if (conn is None or not dialect.transactional_ddl
                    or inspect(own).has_table(spec.table, schema=spec.schema)):
                self._ensure_table(own, dialect)
                return True
        self._ensure_table(conn, dialect)
        return False

    def _ensure_table(self, conn: Connection, dialect: Dialect) -> None:
        """Create (when allowed) and check the table in ``conn``."""
        spec = self.spec
        inspector = inspect(conn)
        if not inspector.has_table(spec.table, schema=spec.schema):
            ddl = dialect.outbox_create_ddl(
                spec.table, spec.schema, self._columns, spec.generated_id)
            if not self.create_table:
                raise SchemaMismatch(
                    f"outbox table {spec.table!r} does not exist (create_table is off); "
                    "create it with:\n" + ";\n".join(ddl) + ";")
            for statement in ddl:
                conn.exec_driver_sql(statement)
            inspector = inspect(conn)
        found = {c["name"].lower() for c in inspector.get_columns(spec.table, spec.schema)}
        missing = [(role, name) for role, name in self._columns.items()
                   if name.lower() not in found]
        if missing:
            raise SchemaMismatch("\n".join(
                f"outbox table {spec.table!r}: column {name!r} (role {role}) is missing; add "
                "it with:\n" + dialect.outbox_add_column_ddl(
                    spec.table, spec.schema, role, name, spec.generated_id) + ";"
                for role, name in missing))

    def _statements(self, engine: Engine) -> Prepared:
        dialect = dialect_for(engine)
        spec = self.spec
        statements = dialect.outbox_statements(
            spec.table, spec.schema, self._columns, spec.generated_id)
        # a pinned clock's time is a bound value the raw driver call would not supply
        lone_insert = (statements["insert"].compile(dialect=engine.dialect).string
                       if dialect.outbox_autocommit and dialect.clock is None else None)
        return Prepared(dialect, statements, lone_insert)

    def create(self) -> None:
        """Create (or check) the table now, e.g. at start-up, instead of on first use."""
        self.prepared(self.engine)

    def drop(self) -> None:
        """Drop the outbox table (tests and tear-downs)."""
        engine = self.engine
        with engine.begin() as conn:
            conn.execute(self.prepared(engine).statements["drop"])
        self._prepared.clear()

    # -- records ------------------------------------------------------------------
    def tracked_id(self, record_id: Any) -> bool:
        """Whether ``record_id`` can name a record of this outbox: an integer where the
        database generates the ids, else a string (a UUID). A header of another kind (from
        another service, or hand-made) cannot, and is never looked up."""
        if self.spec.generated_id:
            return isinstance(record_id, int) and not isinstance(record_id, bool)
        return isinstance(record_id, str)

    def bound_connection(self) -> Connection | None:
        """The bound transaction (:func:`celery_ext.bind`) when it is on the outbox's
        database (or the outbox has none yet): records go into it. A transaction on
        another database cannot hold the record, so the send is then not tied to it."""
        conn = binding.current()
        if conn is None or (self._engine is None and not self.app.conf.get("outbox_url")):
            return conn
        return conn if same_database(conn.engine, self.engine) else None

    def record(self, message: Message, task_id: str | None, task_name: str,
               bound: Connection | None = None) -> Any:
        """Write the record of ``message`` and return its id: in the ``bound`` transaction
        when given, else committed on a connection of the outbox's own."""
        params: dict[str, Any] = {
            "task_id": task_id, "task_name": task_name, "exchange": message.exchange,
            "routing_key": message.routing_key, "body": message.body,
        }
        try:
            params["headers"] = json.dumps(message.headers)
            params["properties"] = json.dumps(message.properties)
            if not self.spec.generated_id:
                params["id"] = uuid.uuid4().hex
            if bound is not None:
                return self._insert(bound, self.prepared(bound.engine, bound), params)
            engine = self.engine
            prepared = self.prepared(engine)
            if prepared.lone_insert is not None:
                generated = prepared.dialect.outbox_insert_autocommit(
                    engine, prepared.lone_insert, params)
                return params.get("id", generated)
            return self._insert_own(engine, prepared, params)
        except OutboxError:
            raise
        except Exception as exc:
            raise RecordFailed(
                f"outbox: could not record task {task_name}[{task_id}], so it was not "
                f"sent: {exc}") from exc

    def _insert(self, conn: Connection, prepared: Prepared, params: dict[str, Any]) -> Any:
        statement = prepared.statements["insert"]
        if "id" in params:
            conn.execute(statement, params)
            return params["id"]
        return prepared.dialect.outbox_insert(conn, statement, params)

    def _insert_own(self, engine: Engine, prepared: Prepared, params: dict[str, Any]) -> Any:
        """The record committed on a connection of the outbox's own.

        Inside a running task, where the database has a single writer, the task's own
        delivery transaction may hold its lock: waiting for it would hang until the busy
        timeout (and the task) gives up, so the wait is short and then fails clearly.
        """
        dialect = prepared.dialect
        with engine.connect() as conn:
            if not self.app.current_worker_task:
                with conn.begin():
                    return self._insert(conn, prepared, params)
            try:
                with dialect.outbox_lock_wait(conn, self.task_write_wait), conn.begin():
                    return self._insert(conn, prepared, params)
            except Exception as exc:
                if not dialect.outbox_lock_timed_out(exc):
                    raise
                raise WriteLockHeld(
                    f"outbox: task {params['task_name']}[{params['task_id']}] was not sent: "
                    f"the SQLite database stayed write-locked for {self.task_write_wait}s "
                    "while the running task recorded it. SQLite has one writer, and the "
                    "running task's own transaction most likely holds it: publish tracked "
                    "tasks before that transaction's first write, or bind that transaction "
                    "(celery_ext.bind) so the record is written inside it.") from exc

    def mark_processed(self, conn: Connection, record_id: Any) -> bool:
        """Mark a record processed in ``conn``'s transaction (e.g. a transactional task's);
        True when this call marked it, False when it was already processed or is gone."""
        statement = self.prepared(conn.engine, conn).statements["mark"]
        return bool(conn.execute(statement, {"id": record_id}).rowcount)

    def discard(self, record_id: Any, conn: Connection | None = None) -> None:
        """Mark a record whose task is never to be sent processed (a unique task whose
        key another task held): in ``conn``'s transaction, else in one of its own."""
        if conn is not None:
            self.mark_processed(conn, record_id)
            return
        with self.engine.begin() as own:
            self.mark_processed(own, record_id)

    def processed_in(self, conn: Connection, record_id: Any) -> bool:
        """Whether the record is processed, as ``conn``'s transaction sees it (False when
        there is none)."""
        return bool(conn.execute(self.prepared(conn.engine, conn).statements["processed"],
                                 {"id": record_id}).scalar())

    def is_processed(self, record_id: Any) -> bool:
        engine = self.engine
        statement = self.prepared(engine).statements["processed"]
        with engine.connect() as conn:
            return bool(conn.execute(statement, {"id": record_id}).scalar())

    # -- republish's part -----------------------------------------------------------
    def claim_due(self, older_than: float, after: Any, limit: int) -> list[Any]:
        """Claim up to ``limit`` records due (unprocessed, last sent ``older_than`` seconds
        ago or longer) with ids after ``after``: their resend time is set in a transaction
        that locks them, skipping those another republisher holds. Returns their rows
        (id, then what :meth:`Message.from_row` reads), by id."""
        engine = self.engine
        prepared = self.prepared(engine)
        statements = prepared.statements
        with engine.connect() as conn, prepared.dialect.outbox_locks_first(conn).begin():
            rows = conn.execute(statements["due"], {
                "older_than": older_than, "after": after, "limit": limit}).all()
            if rows:
                conn.execute(statements["claim"], {"ids": [row[0] for row in rows]})
        return list(rows)

    def unclaim(self, ids: Sequence[Any]) -> None:
        """Records claimed but not sent (a broker error): due again at once."""
        engine = self.engine
        with engine.begin() as conn:
            conn.execute(self.prepared(engine).statements["unclaim"], {"ids": list(ids)})

    # -- maintenance -----------------------------------------------------------------
    def prune(self, older_than: float | None = None,
              progress: Callable[[int], None] | None = None) -> int:
        """Delete records processed more than ``older_than`` seconds ago (default: the
        retention), in batches (``progress`` is told each one's count); returns how many."""
        engine = self.engine
        statement = self.prepared(engine).statements["prune"]
        age = self.retention if older_than is None else older_than
        removed = 0
        while True:
            with engine.begin() as conn:
                count = conn.execute(statement, {"older_than": age, "limit": self.batch}).rowcount
            removed += count
            if progress is not None:
                progress(count)
            if count < self.batch:
                return removed

    def status(self, exact_upto: int | None = None) -> OutboxStatus:
        """The table's counts; with ``exact_upto``, a table of more records than that is
        not counted: its counts are the planner's estimates (where the database gives
        them), and the oldest unprocessed record is the first by id."""
        engine = self.engine
        prepared = self.prepared(engine)
        statements = prepared.statements
        with engine.connect() as conn:
            if exact_upto is not None and "records_estimate" in statements:
                records = int(conn.execute(statements["records_upto"],
                                           {"limit": exact_upto + 1}).scalar_one())
                if records > exact_upto:
                    return self._estimated(conn, prepared, exact_upto, records)
            unprocessed, processed, age = conn.execute(statements["status"]).one()
        return OutboxStatus(int(unprocessed), int(processed),
                            None if age is None else max(0.0, float(age)))

    @staticmethod
    def _estimated(conn: Connection, prepared: Prepared, exact_upto: int,
                   counted: int) -> OutboxStatus:
        """The estimates, never below the ``counted`` records the bound read: a planner
        that last looked when the table was smaller (or never did) says fewer."""
        statements, dialect = prepared.statements, prepared.dialect
        records = max(counted, dialect.estimated_rows(conn, statements["records_estimate"]))
        unprocessed = int(conn.execute(statements["unprocessed_upto"],
                                       {"limit": exact_upto + 1}).scalar_one())
        if unprocessed > exact_upto:
            unprocessed = max(unprocessed, dialect.estimated_rows(
                conn, statements["unprocessed_estimate"]))
        age = conn.execute(statements["oldest_unprocessed"]).scalar()
        return OutboxStatus(unprocessed, max(0, records - unprocessed),
                            None if age is None else max(0.0, float(age)), about=True)
