"""Per-process state behind every Transport on one database.

Celery opens several kombu connections per process (consumer, producer pool,
events); they all share one :class:`Broker` per URL and options, so the process
has one engine with a bounded pool, one lease keeper and one view of which
queue lives in which table. A forked child (a prefork pool process) starts with
none of it: it opens its own engine when it first publishes.
"""

from __future__ import annotations

import atexit
import logging
import os
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from sqlalchemy import Connection, create_engine, inspect
from sqlalchemy.engine import URL, Engine, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError

from . import binding
from .claims import CLAIM_FORMS, ClaimForm, Held, LeaseKeeper, Settlement, Wakeup
from .codec import convert_payload, dead_letter_headers
from .dialects import ClaimedRow, Dialect, dialect_class, dialect_for
from .errors import ConfigurationError
from .options import QueueOptions, TransportOptions
from .tables import Role, TableSpec, default_table, table_name_for_queue

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True, eq=False)
class QueueTable:
    """A queue as the transport uses it: its table, its settings, how its payload is stored."""

    queue: str
    spec: TableSpec
    options: QueueOptions
    payload_is_text: bool
    created_by_transport: bool
    claims: ClaimForm

    @property
    def fifo(self) -> bool:
        group = self.spec.column(Role.GROUP)
        return group is not None and group.fifo


#: drivers tried, in order, for a URL that names no driver (SQLAlchemy's own default
#: first where it has one installed)
BARE_DRIVERS = {
    "postgresql": (("psycopg", "psycopg"), ("psycopg2", "psycopg2")),
    "mysql": (("MySQLdb", "mysqldb"), ("pymysql", "pymysql")),
    "mariadb": (("MySQLdb", "mysqldb"), ("pymysql", "pymysql")),
}


def sqlalchemy_url(url: str) -> URL:
    """The SQLAlchemy URL behind ``sqlinbox+...``. A URL naming no driver
    (``postgresql://``, ``mysql://``) takes whichever supported driver is installed."""
    try:
        parsed = make_url(url)
    except ArgumentError:
        parsed = None
    if parsed is None or parsed.drivername == "sqlinbox":
        raise ConfigurationError(
            f"broker URL {url!r} is not an SQLAlchemy URL; write e.g. "
            "sqlinbox+postgresql://user@host/db or sqlinbox+sqlite:///jobs.db"
        )
    candidates = BARE_DRIVERS.get(parsed.drivername)
    if candidates is None:
        return parsed
    for module, driver in candidates:
        try:
            __import__(module)
        except ImportError:
            continue
        return parsed.set(drivername=f"{parsed.drivername}+{driver}")
    modules = " or ".join(module for module, _ in candidates)
    raise ConfigurationError(
        f"a {parsed.drivername}:// broker URL needs a driver: install {modules} (the "
        "kombu-sqlinbox extras 'psycopg', 'postgres' and 'mysql' bring one)"
    )


def refuse_memory_database(url: URL) -> None:
    """An SQLite database in memory is one per connection (a shared-cache one, one per
    process): the keeper's acks, other pool connections and every other process (workers,
    the outbox's republisher) would each see tables of their own."""
    if url.get_backend_name() != "sqlite":
        return
    database = url.database or ""
    if not database or ":memory:" in database or url.query.get("mode") == "memory":
        raise ConfigurationError(
            f"URL {url.render_as_string()!r} names an SQLite database in memory, which no "
            "other connection or process can see; use a file: sqlinbox+sqlite:///jobs.db")


def engine_for(url: str | URL, sqlite_begin: str = "IMMEDIATE",
               **engine_options: Any) -> tuple[Engine, Dialect]:
    """An engine set up the way every engine of kombu-sqlinbox is (the transport's and the
    outbox's), with the dialect that serves it."""
    parsed = sqlalchemy_url(url) if isinstance(url, str) else url
    refuse_memory_database(parsed)
    engine_options = {**dialect_class(parsed.get_backend_name()).engine_defaults,
                      **engine_options}
    engine = create_engine(parsed, **engine_options)
    dialect = dialect_for(engine)
    dialect.prepare_engine(engine, sqlite_begin)
    return engine, dialect


def same_database(a: Engine, b: Engine) -> bool:
    """Whether two engines reach one database (drivers and credentials aside)."""
    return (a.url.get_backend_name(), a.url.host, a.url.port, a.url.database) == (
        b.url.get_backend_name(), b.url.host, b.url.port, b.url.database)


class Broker:
    """One database as a message broker, for this process."""

    def __init__(self, url: str, options: TransportOptions) -> None:
        self.options = options
        parsed = sqlalchemy_url(url)
        engine_options: dict[str, Any] = {"pool_size": 5, "max_overflow": 10}
        if parsed.get_backend_name() == "sqlite":
            engine_options.clear()
        engine_options.update(options.engine_options)
        self.engine, self.dialect = engine_for(parsed, **engine_options)
        self._tables: dict[str, QueueTable] = {}
        self._tables_lock = threading.Lock()
        self.dialect.notify = options.notify and self.dialect.notify
        self.forms = {name: form(self) for name, form in CLAIM_FORMS.items()}
        self.keeper = LeaseKeeper(self)
        self.wakeup = Wakeup(self)
        self.pid = os.getpid()
        self.closed = False

    # -- running work --------------------------------------------------------
    def run(self, work: Callable[[Connection], T], attempts: int = 10,
            read_only: bool = False, durable: bool = True, repeatable: bool = False) -> T:
        """Run ``work`` in one transaction; retry deadlocks, busy databases and a connection
        that broke before the commit (a server restart, a connection found dead in the
        pool): the transaction then did not happen. Other errors propagate.

        A connection that breaks during the COMMIT leaves it unknown whether the commit
        landed, so ``work`` runs again only when it is ``repeatable`` (reads, fenced
        statements on held rows, claims); anything else, a publish above all, raises
        the connection error for kombu's and Celery's retry policies to handle.

        ``read_only`` work begins a deferred transaction on SQLite, so it never waits for
        the write lock (held, say, by the caller's own transaction it publishes into).
        Work that is not ``durable`` (claims, lease extensions, settlements: losing one in
        a server crash means a redelivery, never a lost message) skips the commit's wait
        for the disk where the database allows it."""
        options = {"sqlite_begin": "DEFERRED"} if read_only else {}
        for attempt in range(1, attempts + 1):
            committing = False
            try:
                with self.engine.connect() as conn:
                    transaction = conn.execution_options(**options).begin()
                    if not durable and self.dialect.relaxed_commit:
                        conn.exec_driver_sql(self.dialect.relaxed_commit)
                    result = work(conn)
                    committing = True
                    transaction.commit()
                    return result
            except DBAPIError as exc:
                unknown = committing and exc.connection_invalidated
                if unknown and not (repeatable or read_only):
                    raise
                retry = exc.connection_invalidated or self.dialect.is_transient(exc)
                if not retry or attempt == attempts:
                    raise
                # racing claimers deadlock in bursts on MariaDB: back off, jittered
                time.sleep(random.uniform(0.005, 0.02) * attempt)
        raise AssertionError("unreachable")

    def bound_caller(self) -> Connection | None:
        """The bound caller's transaction (:mod:`.binding`) when it is on this database."""
        caller = binding.current()
        return caller if caller is not None and same_database(caller.engine, self.engine) \
            else None

    def read(self, table: QueueTable, work: Callable[[Connection], T]) -> T:
        """Run read-only ``work`` on ``table`` in a deferred transaction of our own; in the
        bound caller's when the table was created in that transaction (not yet remembered
        by :meth:`table`), the one place it exists until the caller commits."""
        caller = self.bound_caller()
        if caller is not None and self._tables.get(table.queue) is not table:
            return work(caller)
        return self.run(work, read_only=True)

    def ping(self) -> None:
        self.run(lambda conn: conn.exec_driver_sql("SELECT 1"), attempts=1, read_only=True)

    # -- queues --------------------------------------------------------------
    def table(self, queue: str) -> QueueTable:
        """The queue's table, created or checked on first use in this process, together
        with every table it may move messages to (its dead-letter queue's, and so on): a
        missing one fails now, not when the first message is parked.

        A missing table, while a caller's transaction on this database is bound (a bound
        publish or queue declaration, a transactional task), is created in that
        transaction where the database's DDL joins one: a second connection could wait on
        the caller's own locks (SQLite has one writer). It is remembered once it is seen
        committed (the caller may roll back).
        """
        found = self._tables.get(queue)
        if found is not None:
            return found
        caller = self.bound_caller()
        with self._tables_lock:
            chain: dict[str, tuple[QueueTable, bool]] = {}
            name: str | None = queue
            while name is not None and name not in self._tables and name not in chain:
                chain[name] = self._resolve(name, caller)
                name = chain[name][0].options.dead_letter_queue
            # none of them unless all of them passed
            self._tables.update({name: table for name, (table, lasting) in chain.items()
                                 if lasting})
            return self._tables.get(queue) or chain[queue][0]

    def _resolve(self, queue: str, caller: Connection | None) -> tuple[QueueTable, bool]:
        options = self.options.for_queue(queue)
        spec = self.spec_for(queue)
        created = options.table is None
        form = self.forms[options.claim]
        form.check(queue)
        spec.require(Role.LOCKED_UNTIL, f"claim={options.claim!r}", queue)
        spec.require(Role.ATTEMPT, f"claim={options.claim!r} (attempt is the fencing token)",
                     queue)
        id_column = spec.column(Role.ID)
        if id_column is not None and not id_column.generated:
            raise ConfigurationError(
                f"queue {queue!r}: table {spec.table!r} has a non-generated id; the transport "
                "can only publish into a table whose id the database generates"
            )
        def ensure(conn: Connection) -> bool:
            return self.dialect.ensure_table(conn, spec, self.options.create_tables)

        def committed(conn: Connection) -> bool:
            return inspect(conn).has_table(spec.table, schema=spec.schema)

        if (caller is not None and self.dialect.transactional_ddl
                and not self.run(committed, read_only=True)):
            return QueueTable(queue, spec, options, ensure(caller), created, form), False
        try:
            payload_is_text = self.run(ensure, read_only=True)
        except DBAPIError:
            # another process created the table at the same moment (PostgreSQL reports
            # a duplicate type); the second look finds and checks it
            payload_is_text = self.run(ensure, read_only=True)
        return QueueTable(queue, spec, options, payload_is_text, created, form), True

    def forget_table(self, queue: str) -> None:
        with self._tables_lock:
            self._tables.pop(queue, None)

    def spec_for(self, queue: str) -> TableSpec:
        """The queue's declared table, or the default layout under the table prefix."""
        return self.options.for_queue(queue).table or default_table(
            table_name_for_queue(queue, self.options.table_prefix))

    def known_table(self, queue: str) -> bool:
        spec = self.spec_for(queue)
        return self.run(lambda conn: inspect(conn).has_table(spec.table, schema=spec.schema),
                        read_only=True)

    # -- message operations ----------------------------------------------------
    def publish(self, table: QueueTable, params: dict[str, Any],
                caller: Connection | None = None) -> None:
        """Insert one message: in the caller's bound transaction when there is one (it
        then exists only if the caller commits), else in a transaction of our own."""
        if caller is not None:
            self.check_same_database(caller, table.queue)
            self.dialect.publish(caller, table.spec, [params])
            return
        self.run(lambda conn: self.dialect.publish(conn, table.spec, [params]))
        self.wakeup.poke()

    def check_same_database(self, caller: Connection, queue: str) -> None:
        if not same_database(self.engine, caller.engine):
            raise ConfigurationError(
                f"queue {queue!r}: the bound transaction is on {caller.engine.url}, the broker "
                f"on {self.engine.url}; a transactional enqueue needs both on one database")

    def claim(self, table: QueueTable, limit: int, skip: Sequence[Any] = ()) -> list[ClaimedRow]:
        return table.claims.claim(table, limit, skip)

    def dead_letter(
        self, held: Held, row: ClaimedRow, reason: str, undecodable: bool = False,
    ) -> None:
        """Move a held row to its queue's dead-letter queue (or delete it) in one transaction,
        fenced: a row no longer held here is left alone."""
        source = held.table
        target_name = source.options.dead_letter_queue
        target = self.table(target_name) if target_name else None
        death = {
            "queue": source.queue,
            "reason": reason,
            "attempts": held.attempt,
            "id": held.id,
            "at": time.time(),
        }
        if undecodable:  # start a clean envelope so the dead letter itself decodes
            death["original_headers"] = row.headers
        headers = dead_letter_headers(None if undecodable else row.headers, death)
        payload = row.payload
        if target is not None:
            payload = convert_payload(payload, target.payload_is_text)
        statements = self.dialect.statements(source.spec)
        tokens = {held.attempt: [held.id]}

        def work(conn: Connection) -> bool:
            # moved rows leave the table; dropped ones end as an ack would. The fenced
            # statement finds nothing when the row was claimed again after its lease
            # lapsed: it is the new holder's, so no copy is parked
            if not self.dialect.settle(conn, statements.complete if target is None else
                                       statements.delete, tokens):
                return False
            if target is not None:
                self.dialect.publish(conn, target.spec, [self.dialect.insert_params(
                    payload, headers, 0, None)])
            return True

        if not source.claims.run_held(held, work):
            logger.info("sqlinbox: message %s of queue %r was claimed again elsewhere before "
                        "it could be parked (%s); left to its new holder",
                        held.id, source.queue, reason)
            return
        logger.warning("sqlinbox: message %s of queue %r %s: %s", held.id, source.queue,
                       f"moved to {target_name!r}" if target_name else "dropped", reason)

    def settle(self, how: Settlement, held: Held, delay: float = 0.0) -> None:
        held.table.claims.settle(how, held, delay)

    def close(self) -> None:
        self.closed = True
        self.keeper.stop()
        self.wakeup.close()
        self.engine.dispose()


_BROKERS: dict[tuple[str, str], Broker] = {}
_BROKERS_LOCK = threading.Lock()


def broker_for(url: str, options: TransportOptions) -> Broker:
    """The process's broker for this URL and options."""
    key = (url, repr(options))
    with _BROKERS_LOCK:
        found = _BROKERS.get(key)
        if found is None or found.pid != os.getpid() or found.closed:
            found = _BROKERS[key] = Broker(url, options)
        return found


def close_all() -> None:
    """Write what is pending and close every broker of this process; also run at the
    process's exit, so acks made just before a normal exit are not delivered again."""
    with _BROKERS_LOCK:
        brokers = list(_BROKERS.values())
        _BROKERS.clear()
    for broker in brokers:
        broker.close()


def _forget_after_fork() -> None:
    """A forked child must not use the parent's pooled connections or held rows."""
    for broker in _BROKERS.values():
        broker.engine.dispose(close=False)
    _BROKERS.clear()


os.register_at_fork(after_in_child=_forget_after_fork)
atexit.register(close_all)
