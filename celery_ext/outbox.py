"""The transactional outbox for Celery, with any broker (RabbitMQ, Redis, sqlinbox).

Each tracked task is written to an outbox table of the service's database
*before* the broker sees it; the record id travels in the message header
``outbox_id``. The consumer marks the record processed when the task finishes
(and its message is acked); records left unprocessed longer than a grace period
are sent again, byte for byte, with the same task id and record id.

Where recording lives. ``before_task_publish`` swallows its receivers' errors, so
a record that fails to write would let the task go out untracked. Instead the
outbox wraps ``app.amqp.send_task_message`` and hands it a producer whose
``publish`` writes the record first: a failed write raises :class:`RecordFailed`
out of ``apply_async`` and nothing is sent. The wrapper sees the message exactly
as the broker will (serialized body, final exchange and routing key, headers,
properties), which is what republish needs to send it again unchanged.

Where the duplicate check lives. Signal receivers cannot stop a task either, so
the check wraps each task's ``run`` on the task instance (before Celery builds
its tracer): a delivery whose record is already processed raises
:class:`~celery.exceptions.Ignore` and its body does not run.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import threading
import uuid
import weakref
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any
from weakref import WeakKeyDictionary

from celery import Celery, Task, signals
from celery.exceptions import Ignore, Reject
from celery.states import FAILURE, REJECTED
from celery.utils.time import maybe_make_aware
from kombu import Exchange, Queue
from kombu.exceptions import OperationalError as KombuOperationalError
from kombu.serialization import dumps
from sqlalchemy import Connection, TextClause, inspect
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError

from kombu_sqlinbox.broker import engine_for, same_database
from kombu_sqlinbox.dialects import Dialect, dialect_for
from kombu_sqlinbox.errors import SchemaMismatch, SqlInboxError
from kombu_sqlinbox.transport import Transport as InboxTransport

from . import binding
from .declaration import DEFAULT_TABLE, Declaration, OutboxSpec, as_outbox_spec

__all__ = [
    "HEADER", "Outbox", "OutboxError", "OutboxNotReady", "OutboxStatus", "RecordFailed",
    "Republished", "WriteLockHeld", "install", "mark_processed", "outbox_of",
]

logger = logging.getLogger(__name__)

#: the message header carrying the record id
HEADER = "outbox_id"
#: set to 1 (or true/yes/on) to install nothing, e.g. for tests with task_always_eager
DISABLED_ENV = "CELERY_OUTBOX_DISABLED"
PRUNE_TASK = "celery_ext.outbox.prune"
REPUBLISH_TASK = "celery_ext.outbox.republish"
#: Producer.publish arguments that steer one send and are not part of the message
TRANSIENT = frozenset({"retry", "retry_policy", "declare", "timeout", "confirm_timeout",
                       "serializer", "mandatory", "immediate"})

TaskFilter = Collection[str] | Callable[[str], bool] | None


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
    """Counts of the outbox table; ``oldest_unprocessed_age`` in seconds, None when none."""

    unprocessed: int
    processed: int
    oldest_unprocessed_age: float | None


@dataclass(frozen=True)
class Republished:
    """What one republish run did: how many records it sent again, the ids of those it
    could not send (logged with the reason), and how many it held back for their eta."""

    sent: int
    failed: tuple[Any, ...] = ()
    held: int = 0


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


def disabled_by_env() -> bool:
    return os.environ.get(DISABLED_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def engine_from_url(url: str) -> Engine:
    """An engine for the outbox, set up by its dialect the way the sqlinbox transport sets
    up its own (WAL and explicit transactions on SQLite, READ COMMITTED on MySQL)."""
    return engine_for(url, sqlite_begin="DEFERRED")[0]


class Outbox:
    """The outbox of one Celery app. :func:`install` creates one and hooks it in.

    ``engine_or_url`` may come later (:meth:`bind_engine`, e.g. from ``worker_init``) or
    from ``app.conf.outbox_url``. ``tasks`` is None (all), a collection of task names or
    a predicate on the name; ``queues`` a collection of queue names; with both, a task
    matching either is tracked. ``grace`` (seconds) is how long a record may stay
    unprocessed before republish sends it again; ``retention`` how long processed
    records are kept before :meth:`prune` deletes them.
    """

    def __init__(
        self,
        app: Celery,
        engine_or_url: Engine | str | None = None,
        *,
        table: Declaration = DEFAULT_TABLE,
        tasks: TaskFilter = None,
        queues: Collection[str] | None = None,
        grace: float = 300.0,
        retention: float = 7 * 86400.0,
        create_table: bool = True,
        republish_on_start: bool = True,
        batch: int = 500,
        sqlite_task_busy_timeout: float = 1.0,
    ) -> None:
        self.app = app
        self.spec: OutboxSpec = as_outbox_spec(table)
        self.tasks = tasks
        self.queues = frozenset(queues) if queues is not None else None
        self.grace = grace
        self.retention = retention
        self.create_table = create_table
        self.republish_on_start = republish_on_start
        self.batch = batch
        self.sqlite_task_busy_timeout = sqlite_task_busy_timeout
        self.enabled = False
        self._engine: Engine | None = None
        self._own_engine = False
        self._prepared: WeakKeyDictionary[Engine, Prepared] = WeakKeyDictionary()
        self._lock = threading.Lock()
        self._columns = self.spec.column_names()
        #: the app's task registry class before install hooked it (see _guard_registered)
        self._registry_class: type | None = None
        if engine_or_url is not None:
            self.bind_engine(engine_or_url)

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
        outbox's own, in a deferred transaction (on SQLite it takes no lock). MySQL's DDL
        commits the transaction it runs in, so there the table is always created on that
        connection of the outbox's own.
        """
        dialect = dialect_for(engine)
        spec = self.spec
        with engine.connect() as own, own.execution_options(sqlite_begin="DEFERRED").begin():
            if (conn is None or not dialect.transactional_ddl
                    or inspect(own).has_table(spec.table, schema=spec.schema)):
                self._ensure_table(own, dialect)
                return True
        self._ensure_table(conn, dialect)
        return False

    def _ensure_table(self, conn: Connection, dialect: Dialect) -> None:
        """Create (when allowed) and check the table in ``conn``."""
        spec = self.spec
        args = (spec.table, spec.schema, self._columns)
        inspector = inspect(conn)
        if not inspector.has_table(spec.table, schema=spec.schema):
            ddl = dialect.outbox_create_ddl(*args, spec.generated_id)
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
            ref = dialect.outbox_fields(*args)["table"]
            raise SchemaMismatch("\n".join(
                f"outbox table {spec.table!r}: column {name!r} (role {role}) is missing; add "
                f"it with:\nALTER TABLE {ref} ADD COLUMN "
                f"{dialect.outbox_column_ddl(role, name, spec.generated_id)};"
                for role, name in missing))

    def _statements(self, engine: Engine) -> Prepared:
        dialect = dialect_for(engine)
        spec = self.spec
        statements = dialect.outbox_statements(
            spec.table, spec.schema, self._columns, spec.generated_id)
        lone_insert = (statements["insert"].compile(dialect=engine.dialect).string
                       if dialect.outbox_autocommit else None)
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

    # -- what is tracked ------------------------------------------------------------
    def tracks_task(self, name: str) -> bool:
        if name in (PRUNE_TASK, REPUBLISH_TASK):
            return False
        if self.tasks is None:
            return self.queues is None
        if callable(self.tasks):
            return bool(self.tasks(name))
        return name in self.tasks

    def tracks(self, name: str, routing_key: str, declare: Any) -> bool:
        if self.tracks_task(name):
            return True
        if self.queues is None:
            return False
        names = {q.name for q in declare or () if isinstance(q, Queue)} or {routing_key}
        return not names.isdisjoint(self.queues)

    # -- recording ----------------------------------------------------------------
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
                return self._insert_alone(engine, prepared.lone_insert, params)
            if prepared.dialect.names[0] == "sqlite" and self.app.current_worker_task:
                return self._insert_in_task(engine, prepared, params)
            with engine.begin() as conn:
                return self._insert(conn, prepared, params)
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

    def _insert_alone(self, engine: Engine, sql: str, params: dict[str, Any]) -> Any:
        """The INSERT alone in autocommit mode: one round trip instead of BEGIN, INSERT and
        COMMIT. Only where the dialect says its drivers switch autocommit without a round
        trip of their own (PostgreSQL: psycopg, psycopg2)."""
        with engine.connect() as conn:
            dbapi = conn.connection.dbapi_connection
            assert dbapi is not None
            dbapi.autocommit = True
            try:
                result = conn.exec_driver_sql(sql, params)
                return params["id"] if "id" in params else result.scalar_one()
            finally:
                if not conn.invalidated:
                    dbapi.autocommit = False

    def _insert_in_task(self, engine: Engine, prepared: Prepared,
                        params: dict[str, Any]) -> Any:
        """SQLite inside a running task: wait briefly for the write lock, then fail clearly.

        The task's own delivery transaction may hold SQLite's single write lock; waiting
        for it would hang until the busy timeout (and the task) gives up. The short timeout
        is set on the DBAPI connection before the transaction begins, since beginning may
        already take the lock (BEGIN IMMEDIATE).
        """
        with engine.connect() as conn:
            raw = conn.connection.dbapi_connection
            assert raw is not None
            (previous,) = raw.execute("PRAGMA busy_timeout").fetchone()
            raw.execute(f"PRAGMA busy_timeout = {int(self.sqlite_task_busy_timeout * 1000)}")
            try:
                with conn.begin():
                    return self._insert(conn, prepared, params)
            except OperationalError as exc:
                if "locked" not in str(exc) and "busy" not in str(exc):
                    raise
                raise WriteLockHeld(
                    f"outbox: task {params['task_name']}[{params['task_id']}] was not sent: "
                    f"the SQLite database stayed write-locked for "
                    f"{self.sqlite_task_busy_timeout}s while the running task recorded it. "
                    "SQLite has one writer, and the running task's own transaction most likely "
                    "holds it: publish tracked tasks before that transaction's first write, or "
                    "bind that transaction (celery_ext.bind) so the record is written inside "
                    "it.") from exc
            finally:
                raw.execute(f"PRAGMA busy_timeout = {int(previous)}")

    # -- sending ------------------------------------------------------------------
    def send(self, producer: Any, message: Message, record_id: Any,
             declare: Any = None) -> None:
        """Publish a recorded message with its record id, retrying as Celery's publish does."""
        conf = self.app.conf
        if declare is None:
            queue = self.app.amqp.queues.get(message.routing_key)
            declare = [queue] if queue is not None else []
        producer.publish(
            message.body, exchange=message.exchange, routing_key=message.routing_key,
            headers={**message.headers, HEADER: record_id}, declare=declare,
            retry=conf.task_publish_retry, retry_policy=conf.task_publish_retry_policy,
            **message.properties)

    def send_after_commit(self, message: Message, record_id: Any, declare: Any) -> None:
        """The deferred publish of a record written in the caller's transaction (unbound:
        a Session still bound after its commit must not take the publish in)."""
        try:
            with binding.unbound(), self.app.producer_or_acquire() as producer:
                self.send(producer, message, record_id, declare)
        except Exception:
            logger.exception("outbox: record %s is committed but its message could not be "
                             "sent now; republish will send it", record_id)

    def republish(self, older_than: float | None = None, limit: int | None = None
                  ) -> Republished:
        """Send again the records unprocessed, and not sent, for ``older_than`` seconds
        (default: the grace period), oldest id first, with their task id and record id.

        Each batch is claimed first (its resend time set, in a transaction that locks the
        rows, skipping those another republisher holds), then sent: two republishers never
        send one record, and a record goes out at most once per grace period. A record
        that cannot be sent (say, its stored headers are not JSON) is logged and skipped
        until its next period; the others go on. A task whose eta is still ahead is held
        back (claimed, not sent) until a period after it. A broker error ends the run,
        and the records it kept from being sent are due again at once.
        """
        engine = self.engine
        statements = self.prepared(engine).statements
        grace = self.grace if older_than is None else older_than
        # the run moves on by id: what it claimed may be due again at once (older_than=0)
        after: Any = -1 if self.spec.generated_id else ""
        sent = held = 0
        failed: list[Any] = []
        with self.app.producer_or_acquire() as producer:
            broker_errors = (KombuOperationalError, *producer.connection.connection_errors)
            while limit is None or sent + held + len(failed) < limit:
                size = self.batch if limit is None else min(
                    self.batch, limit - sent - held - len(failed))
                # IMMEDIATE on SQLite: two republishers take turns instead of both reading
                with engine.connect() as conn, conn.execution_options(
                        sqlite_begin="IMMEDIATE").begin():
                    rows = conn.execute(statements["due"], {
                        "older_than": grace, "after": after, "limit": size}).all()
                    if rows:
                        conn.execute(statements["claim"], {"ids": [row[0] for row in rows]})
                        after = rows[-1][0]
                for done, row in enumerate(rows):
                    try:
                        message = Message.from_row(row)
                        if message.eta_ahead():
                            held += 1
                        else:
                            self.send(producer, message, row[0])
                            sent += 1
                    except broker_errors:
                        with engine.begin() as conn:
                            conn.execute(statements["unclaim"],
                                         {"ids": [later[0] for later in rows[done:]]})
                        raise
                    except Exception as exc:
                        logger.error("outbox: record %s could not be sent again (%s: %s); "
                                     "republish tries it again after the grace period",
                                     row[0], type(exc).__name__, exc)
                        failed.append(row[0])
                if len(rows) < size:
                    break
        if sent or failed or held:
            logger.info("outbox: republished %d record(s) of %s, %d failed, %d held back "
                        "for their eta", sent, self.spec.table, len(failed), held)
        return Republished(sent, tuple(failed), held)

    # -- the consumer side ------------------------------------------------------------
    def mark_processed(self, conn: Connection, record_id: Any) -> bool:
        """Mark a record processed in ``conn``'s transaction (e.g. a transactional task's);
        True when this call marked it, False when it was already processed or is gone."""
        statement = self.prepared(conn.engine, conn).statements["mark"]
        return bool(conn.execute(statement, {"id": record_id}).rowcount)

    def mark_for_task(self, conn: Connection, task: Task, record_id: Any) -> None:
        """Mark ``task``'s record processed in ``conn``'s transaction; raise Ignore when it
        was processed already. A record this outbox does not hold (another service's, or
        pruned) is no duplicate: the task runs, untracked."""
        if self.mark_processed(conn, record_id):
            return
        processed = conn.execute(self.prepared(conn.engine, conn).statements["processed"],
                                 {"id": record_id}).scalar()
        if processed:
            raise duplicate(task, record_id)

    def is_processed(self, record_id: Any) -> bool:
        engine = self.engine
        with engine.connect() as conn:
            found = conn.execute(
                self.prepared(engine).statements["processed"], {"id": record_id}).scalar()
        return bool(found)

    @contextmanager
    def transaction(self) -> Iterator[Connection]:
        """The running task's transaction on the outbox database, with its record marked
        processed inside it: the task's writes and the mark commit together, so a duplicate
        delivery finds the record processed and is skipped (raises Ignore). Tracked tasks
        sent inside are recorded in this transaction and sent after it commits."""
        task = self.app.current_worker_task
        record_id = getattr(task.request, HEADER, None) if task is not None else None
        if not self.tracked_id(record_id):  # none, or not ours: the task runs untracked
            record_id = None
        with self.engine.begin() as conn:
            if record_id is not None:
                self.mark_for_task(conn, task, record_id)
            with binding.bind(conn):
                yield conn
        if record_id is not None:  # committed: the worker need not mark it again
            task.request.outbox_marked = True

    def tracked_id(self, record_id: Any) -> bool:
        """Whether ``record_id`` can name a record of this outbox: an integer where the
        database generates the ids, else a string (a UUID). A header of another kind (from
        another service, or hand-made) cannot, and is never looked up."""
        if self.spec.generated_id:
            return isinstance(record_id, int) and not isinstance(record_id, bool)
        return isinstance(record_id, str)

    def guard(self, task: Task) -> None:
        """Skip a delivery of ``task`` whose record is already processed (see module doc).

        A record id this outbox cannot have written runs the task untracked (logged). A
        lookup that fails on the connection (the database down, a deadlock) requeues the
        delivery: the record stays unprocessed, nothing is lost and the body has not run.
        """
        if getattr(task, "_outbox_guarded", False):
            return
        run = task.run

        @functools.wraps(run)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            request = task.request
            record_id = getattr(request, HEADER, None)
            if record_id is None or request.called_directly or request.is_eager:
                return run(*args, **kwargs)
            if not self.tracked_id(record_id):
                logger.warning("outbox: task %s[%s] runs untracked: its %s %r cannot name a "
                               "record of %s", task.name, request.id, HEADER, record_id,
                               self.spec.table)
            elif self._processed_or_requeue(task, record_id):
                raise duplicate(task, record_id)
            return run(*args, **kwargs)

        task.run = guarded
        task._outbox_guarded = True

    def _processed_or_requeue(self, task: Task, record_id: Any) -> bool:
        """Whether the record is processed; a lookup that failed on the connection raises
        the Reject that requeues the delivery."""
        try:
            return self.is_processed(record_id)
        except DBAPIError as exc:
            if not (exc.connection_invalidated
                    or isinstance(exc, (OperationalError, InterfaceError))):
                raise
            logger.warning("outbox: could not look up record %s of %s[%s], delivery "
                           "requeued: %s", record_id, task.name, task.request.id, exc.orig)
            raise Reject(f"outbox record {record_id} could not be looked up: {exc.orig}",
                         requeue=True) from exc

    def _guard_registered(self) -> None:
        """Guard every task of the app, now and whenever one is registered later.

        Celery has no signal for a task registered after the app is finalized (a late
        import), so the registry becomes a subclass of its own class that guards each
        task put into it.
        """
        registry = self.app._tasks
        outbox = self

        class GuardingRegistry(type(registry)):  # type: ignore[misc]
            def __setitem__(self, name: str, task: Task) -> None:
                super().__setitem__(name, task)
                outbox.guard(task)

        self._registry_class = type(registry)
        registry.__class__ = GuardingRegistry
        for task in list(registry.values()):
            self.guard(task)

    def _on_postrun(self, sender: Task | None = None, state: str | None = None,
                    **_: Any) -> None:
        """Mark the record once the task finished in a state whose message is acked."""
        if sender is None or sender.app is not self.app:
            return
        request = sender.request
        record_id = getattr(request, HEADER, None)
        if (record_id is None or request.called_directly or request.is_eager
                or getattr(request, "outbox_marked", False) or state == REJECTED
                or not self.tracked_id(record_id)):
            return
        acks_late = getattr(request, "acks_late", None) or sender.acks_late
        if state == FAILURE and acks_late and not (
                sender.acks_on_failure_or_timeout):
            return
        try:
            with self.engine.begin() as conn:
                self.mark_processed(conn, record_id)
        except Exception:
            logger.exception("outbox: could not mark record %s processed; it will be sent "
                             "again after the grace period", record_id)

    def _on_worker_init(self, sender: Any = None, **_: Any) -> None:
        """Create or check the table at worker start, before any task runs: a mismatch shows
        up at once, and no task's first tracked publish waits on DDL."""
        if getattr(sender, "app", None) is not self.app:
            return
        try:
            self.create()
        except OutboxNotReady:
            logger.debug("outbox: no database at worker_init; the table is checked on first use")
        except Exception:
            logger.exception("outbox: table %r is not usable", self.spec.table)

    def _on_worker_ready(self, sender: Any = None, **_: Any) -> None:
        if getattr(sender, "app", None) is not self.app or not self.republish_on_start:
            return
        threading.Thread(target=self._republish_logged, name="outbox-republish",
                         daemon=True).start()

    def _republish_logged(self) -> None:
        try:
            self.republish()
        except Exception:
            logger.exception("outbox: republish at worker start failed")

    # -- maintenance -----------------------------------------------------------------
    def prune(self, older_than: float | None = None) -> int:
        """Delete records processed more than ``older_than`` seconds ago (default: the
        retention), in batches; returns how many."""
        engine = self.engine
        statement = self.prepared(engine).statements["prune"]
        age = self.retention if older_than is None else older_than
        removed = 0
        while True:
            with engine.begin() as conn:
                count = conn.execute(statement, {"older_than": age, "limit": self.batch}).rowcount
            removed += count
            if count < self.batch:
                return removed

    def status(self) -> OutboxStatus:
        engine = self.engine
        with engine.connect() as conn:
            unprocessed, processed, age = conn.execute(
                self.prepared(engine).statements["status"]).one()
        return OutboxStatus(int(unprocessed), int(processed),
                            None if age is None else max(0.0, float(age)))

    def beat_schedule(self, prune_every: float = 3600.0,
                      republish_every: float | None = None) -> dict[str, dict[str, Any]]:
        """Entries for ``app.conf.beat_schedule``: pruning, and optionally republish."""
        entries: dict[str, dict[str, Any]] = {
            "outbox-prune": {"task": PRUNE_TASK, "schedule": prune_every}}
        if republish_every is not None:
            entries["outbox-republish"] = {"task": REPUBLISH_TASK, "schedule": republish_every}
        return entries

    # -- installing -----------------------------------------------------------------
    def install(self) -> Outbox:
        """Hook the outbox into its app; does nothing when CELERY_OUTBOX_DISABLED is set."""
        if disabled_by_env():
            logger.info("outbox: disabled by %s", DISABLED_ENV)
            return self
        app = self.app
        if app in _INSTALLED:
            raise OutboxError(f"an outbox is already installed on {app!r}")
        _INSTALLED[app] = self
        self.enabled = True
        _wrap_sender(self)

        def prune_outbox() -> int:
            return self.prune()

        def republish_outbox() -> dict[str, Any]:
            done = self.republish()
            return {"sent": done.sent, "failed": list(done.failed), "held": done.held}

        app.task(name=PRUNE_TASK, shared=False, ignore_result=True)(prune_outbox)
        app.task(name=REPUBLISH_TASK, shared=False, ignore_result=True)(republish_outbox)
        self._guard_registered()
        signals.task_postrun.connect(self._on_postrun, weak=False)
        signals.worker_init.connect(self._on_worker_init, weak=False)
        signals.worker_ready.connect(self._on_worker_ready, weak=False)
        _forget_engine_after_fork(self)
        return self

    def uninstall(self) -> None:
        """Undo :meth:`install` for publishing and signals (tests)."""
        _INSTALLED.pop(self.app, None)
        self.enabled = False
        if self._registry_class is not None:
            self.app._tasks.__class__ = self._registry_class
        signals.task_postrun.disconnect(self._on_postrun)
        signals.worker_init.disconnect(self._on_worker_init)
        signals.worker_ready.disconnect(self._on_worker_ready)

    def close(self) -> None:
        """Dispose the engine the outbox created from a URL."""
        if self._own_engine and self._engine is not None:
            self._engine.dispose()


_INSTALLED: WeakKeyDictionary[Celery, Outbox] = WeakKeyDictionary()


def duplicate(task: Task, record_id: Any) -> Ignore:
    """The Ignore that skips a delivery whose record is already processed (logged, since
    Celery logs an ignored task without its reason)."""
    logger.info("outbox: record %s already processed: duplicate delivery of %s[%s] skipped",
                record_id, task.name, task.request.id)
    return Ignore(f"outbox record {record_id} is already processed")


def install(app: Celery, engine_or_url: Engine | str | None = None, **options: Any) -> Outbox:
    """Create the app's :class:`Outbox` and hook it in, in one call."""
    return Outbox(app, engine_or_url, **options).install()


def outbox_of(app: Celery) -> Outbox:
    try:
        return _INSTALLED[app]
    except KeyError:
        raise OutboxError(f"no outbox is installed on {app!r}") from None


def mark_processed(conn: Connection, record_id: Any, app: Celery | None = None) -> bool:
    """Mark ``record_id`` processed in ``conn``'s transaction, with the outbox of ``app``
    (default: the current app); see :meth:`Outbox.mark_processed`."""
    from celery import current_app

    return outbox_of(app or current_app._get_current_object()).mark_processed(conn, record_id)


def _forget_engine_after_fork(outbox: Outbox) -> None:
    """A forked pool process must not share the parent's pooled connections."""
    ref = weakref.ref(outbox)

    def forget() -> None:
        found = ref()
        if found is not None and found._engine is not None:
            found._engine.dispose(close=False)

    os.register_at_fork(after_in_child=forget)


# -- the publish hook ---------------------------------------------------------------
def _wrap_sender(outbox: Outbox) -> None:
    """Replace ``app.amqp.send_task_message`` with one that records tracked tasks.

    Celery builds the original from the configuration on first use, so the wrapper builds
    it lazily too: installing early does not freeze settings configured later.
    """
    amqp = outbox.app.amqp
    original: Callable[..., Any] | None = None

    def send_task_message(producer: Any, name: str, message: Any, **options: Any) -> Any:
        nonlocal original
        if original is None:
            original = amqp._create_task_sender()
        if outbox.enabled and (outbox.queues is not None or outbox.tracks_task(name)):
            producer = RecordingProducer(outbox, producer, name, message[0])
        return original(producer, name, message, **options)

    amqp.send_task_message = send_task_message


class RecordingProducer:
    """A producer whose first publish of the task's message records it before sending.

    Other publishes through it (the task-sent event) pass straight through; a publish
    retried after a connection error sends the already recorded message again.
    """

    def __init__(self, outbox: Outbox, producer: Any, name: str,
                 task_headers: dict[str, Any]) -> None:
        self._outbox = outbox
        self._producer = producer
        self._name = name
        self._headers = task_headers
        self._recorded: tuple[bytes, dict[str, Any]] | None = None

    def __getattr__(self, attribute: str) -> Any:
        return getattr(self._producer, attribute)

    def publish(self, body: Any, **kwargs: Any) -> Any:
        if kwargs.get("headers") is not self._headers:
            return self._producer.publish(body, **kwargs)
        if self._recorded is not None:
            data, publish_kwargs = self._recorded
            return self._producer.publish(data, **publish_kwargs)
        outbox = self._outbox
        exchange = kwargs.get("exchange") or ""
        exchange = exchange.name if isinstance(exchange, Exchange) else str(exchange)
        routing_key = str(kwargs.get("routing_key") or "")
        if not outbox.tracks(self._name, routing_key, kwargs.get("declare")):
            return self._producer.publish(body, **kwargs)
        data, kwargs = self._serialize(body, kwargs)
        headers = kwargs["headers"]
        headers.pop(HEADER, None)  # a retried task's request headers carry the old id
        properties = {k: v for k, v in kwargs.items()
                      if k not in TRANSIENT and k not in ("exchange", "routing_key", "headers")}
        message = Message(data, exchange, routing_key, dict(headers), properties)
        task_id = headers.get("id") or (body.get("id") if isinstance(body, dict) else None)
        bound = outbox.bound_connection()
        record_id = outbox.record(message, task_id, self._name, bound)
        headers[HEADER] = record_id
        if bound is not None and not isinstance(self._producer.connection.transport,
                                                InboxTransport):
            binding.after_commit(functools.partial(
                outbox.send_after_commit, message, record_id, kwargs.get("declare")))
            return None
        # unbound, or the sqlinbox transport, whose publish joins the bound transaction
        self._recorded = (data, kwargs)
        return self._producer.publish(data, **kwargs)

    def _serialize(self, body: Any, kwargs: dict[str, Any]) -> tuple[bytes, dict[str, Any]]:
        """Serialize as kombu would, so the recorded body is the exact bytes sent."""
        kwargs = dict(kwargs)
        serializer = kwargs.pop("serializer", None) or self._producer.serializer
        content_type = kwargs.get("content_type")
        encoding = kwargs.get("content_encoding")
        if not content_type:
            content_type, encoding, body = dumps(body, serializer=serializer)
        if isinstance(body, str):
            encoding = encoding or "utf-8"
            body = body.encode(encoding)
        kwargs["content_type"] = content_type
        kwargs["content_encoding"] = encoding or "binary"
        return bytes(body), kwargs

