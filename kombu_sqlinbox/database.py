"""One database as every layer above reaches it: the engine, its dialect, and the
transaction that is retried where retrying is safe.

It knows the dialects and nothing above them, so claim forms and the lease keeper
run on it without a broker.
"""

from __future__ import annotations

import logging
import random
import re
import select
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from inspect import signature as inspect_signature
from typing import Any, TypeVar, cast
from urllib.parse import unquote

from sqlalchemy import Connection, create_engine, event, inspect
from sqlalchemy import util as sa_util
from sqlalchemy.engine import URL, Engine
from sqlalchemy.engine.create import _pool_translate_kwargs as POOL_KEYWORDS
from sqlalchemy.engine.default import DefaultDialect
from sqlalchemy.exc import DBAPIError
from sqlalchemy.pool import Pool

from . import binding
from .clock import key_of
from .dialects import Dialect, RowsInsert, dialect_class, dialect_for
from .errors import ConfigurationError, SchemaMismatch
from .options import TransportOptions, unknown_option
from .tables import TableSpec
from .urls import sqlalchemy_url

logger = logging.getLogger(__name__)

T = TypeVar("T")
#: drivers whose connections show their socket (``fileno()``; PyMySQL's ``_sock``)
SOCKET_DRIVERS = frozenset({"psycopg2", "psycopg", "pymysql"})
#: where a pooled connection keeps the driver cursor :meth:`Database.write` publishes on
PUBLISH_CURSOR = "sqlinbox_publish_cursor"
#: a PostgreSQL driver connection's transaction status outside a transaction (psycopg 2's
#: and 3's ``info.transaction_status``)
IDLE = 0

def refuse_memory_database(url: URL) -> None:
    """An SQLite database in memory is one per connection (a shared-cache one, one per
    process): the keeper's acks, other pool connections and every other process (workers,
    the outbox's republisher) would each see tables of their own."""
    if url.get_backend_name() != "sqlite":
        return
    database = url.database or ""
    if not database or ":memory:" in database or url.query.get("mode") == "memory":
        raise ConfigurationError(
            f"URL {unquote(url.render_as_string())!r} names an SQLite database in memory, "
            "which no other connection or process can see; use a file: "
            "sqlinbox+sqlite:///jobs.db")


def engine_for(url: str | URL, sqlite_begin: str = "IMMEDIATE",
               **engine_options: Any) -> tuple[Engine, Dialect]:
    """An engine set up the way every engine of kombu-sqlinbox is (the transport's and the
    outbox's), with the dialect that serves it."""
    parsed = sqlalchemy_url(url) if isinstance(url, str) else url
    refuse_memory_database(parsed)
    engine_options = {**dialect_class(parsed.get_backend_name()).engine_defaults,
                      **engine_options}
    try:
        engine = create_engine(parsed, **engine_options)
    except (TypeError, ValueError, AttributeError) as exc:
        # a keyword it does not take, or a value of the wrong kind (a pool class by name)
        refused = (refused_engine_option(exc, parsed, engine_options.get("poolclass"))
                   if isinstance(exc, TypeError) else None)
        raise refused or ConfigurationError(
            "transport option engine_options: create_engine() refused it "
            f"({type(exc).__name__}: {exc})") from exc
    dialect = dialect_for(engine)
    dialect.prepare_engine(engine, sqlite_begin)
    return engine, dialect


#: the keywords SQLAlchemy's create_engine() refused, as its TypeError names them
_REFUSED = re.compile(r"^Invalid argument\(s\) (.+?) sent to create_engine\(\)")


def refused_engine_option(exc: TypeError, url: URL, poolclass: type[Pool] | None
                          ) -> ConfigurationError | None:
    """For SQLAlchemy's TypeError on a keyword ``create_engine()`` does not take (which
    names no transport option and no fix), the error naming the option and the closest
    keyword it does take; None for any other TypeError."""
    found = _REFUSED.match(str(exc))
    if found is None:
        return None
    key = re.findall(r"'([^']*)'", found.group(1))[0]
    return unknown_option(f"engine_options[{key!r}]", key, engine_keywords(url, poolclass))


def engine_keywords(url: URL, poolclass: type[Pool] | None = None) -> set[str]:
    """The keywords ``create_engine()`` takes for ``url``, read from SQLAlchemy as it reads
    them: its own (its typed signature, which Python 3.10 cannot read), the dialect's,
    the driver import's, the pool's (under their ``pool_`` names) and the Engine's."""
    dialect = cast("type[DefaultDialect]", url.get_dialect())  # every dialect is one
    pool = poolclass or dialect.get_pool_class(url)
    names = {*sa_util.get_cls_kwargs(dialect), *sa_util.get_func_kwargs(dialect.import_dbapi),
             *(POOL_KEYWORDS.get(name, name) for name in sa_util.get_cls_kwargs(pool)),
             *sa_util.get_cls_kwargs(Engine)}
    if sys.version_info >= (3, 11):
        from typing import get_overloads

        names.update(name for overload in get_overloads(create_engine)
                     for name in inspect_signature(overload).parameters)
    return {name for name in names if not name.startswith("_")} - {"url", "kwargs", "cls"}


def open_database(url: str, options: TransportOptions) -> Database:
    """The broker's database for ``url`` and the options' engine options; nothing
    connects yet, so a worker's start-up check makes one to find every mistake in them."""
    parsed = sqlalchemy_url(url)
    engine_options: dict[str, Any] = {"pool_size": 5, "max_overflow": 10}
    if parsed.get_backend_name() == "sqlite":
        engine_options.clear()
    engine_options.update(options.engine_options)
    return Database.open(parsed, **engine_options)


def closed_by_server(connection: Any) -> bool:
    """Whether an idle driver connection has something to read: the server closed it (a
    restart or a terminated backend sends its goodbye, then the end of the stream)."""
    fileno = getattr(connection, "fileno", None) or connection._sock.fileno
    return bool(select.select([fileno()], [], [], 0)[0])


def same_database(a: Engine, b: Engine) -> bool:
    """Whether two engines reach one database (drivers and credentials aside)."""
    return key_of(a.url) == key_of(b.url)


class Database:
    """An engine and the dialect that serves it, with the transactions run on them."""

    def __init__(self, engine: Engine, dialect: Dialect) -> None:
        self.engine = engine
        self.dialect = dialect
        #: durable publishes commit as one statement in autocommit (drivers whose socket
        #: shows a connection the server closed: see :meth:`write`)
        self.switch_autocommit = dialect.autocommit_switch and engine.driver in SOCKET_DRIVERS
        #: fenced work's transactions begin with their settings in one round trip
        self.relaxed_begin = dialect.relaxed_begin if self.switch_autocommit else None
        #: where switching costs round trips, publishes check out connections of this pool,
        #: put in autocommit once as they open (the engine's pool settings and connect
        #: hooks): no other work ever sees one in autocommit
        self.publish_pool: Pool | None = None
        if dialect.autocommit_kept and engine.driver in SOCKET_DRIVERS:
            self.publish_pool = engine.pool.recreate()
            event.listen(self.publish_pool, "connect", lambda dbapi, record:
                         engine.dialect.set_isolation_level(dbapi, "AUTOCOMMIT"))

    @classmethod
    def open(cls, url: str | URL, **engine_options: Any) -> Database:
        """A database on an engine made by :func:`engine_for`."""
        return cls(*engine_for(url, **engine_options))

    def dispose(self, close: bool = True) -> None:
        """Drop every pooled connection, closing them unless ``close`` is false (a forked
        child, whose parent still uses them); the pools open fresh ones on demand."""
        self.engine.dispose(close=close)
        if self.publish_pool is not None:
            if close:
                self.publish_pool.dispose()
            self.publish_pool = self.publish_pool.recreate()

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
        relaxed_begin = None if durable else self.relaxed_begin
        for attempt in range(1, attempts + 1):
            committing = False
            try:
                with self.engine.connect() as conn:
                    if relaxed_begin is not None:
                        with self._outside_transaction(conn):
                            conn.exec_driver_sql(relaxed_begin)
                            result = work(conn)
                            committing = True
                            conn.exec_driver_sql("COMMIT")
                            return result
                    transaction = conn.execution_options(**options).begin()
                    if not durable and self.dialect.relaxed_commit:
                        conn.exec_driver_sql(self.dialect.relaxed_commit)
                    result = work(conn)
                    committing = True
                    transaction.commit()
                    return result
            except DBAPIError as exc:
                self._retry_or_raise(exc, committing and not (repeatable or read_only),
                                     attempt, attempts)
        raise AssertionError("unreachable")

    def look(self, work: Callable[[Connection], T], attempts: int = 10) -> T:
        """Run ``work``, reads whose statements need no snapshot in common (each sees the
        database as it is when it runs, as under read committed), outside a transaction
        where the switch to autocommit sends nothing (:attr:`switch_autocommit`) or a
        connection stays in it (:meth:`alone`): each statement is one round trip, without
        a BEGIN's and a COMMIT's; elsewhere as :meth:`run` runs reads. Retried as reads
        are."""
        if self.publish_pool is not None:
            return self.alone(work, attempts)
        if not self.switch_autocommit:
            return self.run(work, attempts, read_only=True)
        for attempt in range(1, attempts + 1):
            try:
                with self.engine.connect() as conn, self._outside_transaction(conn):
                    return work(conn)
            except DBAPIError as exc:
                self._retry_or_raise(exc, False, attempt, attempts)
        raise AssertionError("unreachable")

    @contextmanager
    def _outside_transaction(self, conn: Connection) -> Iterator[None]:
        """``conn``'s driver in autocommit for the block (:attr:`switch_autocommit`): a
        statement is a transaction of its own unless the block sends a BEGIN. What the
        block left open on the server (a statement failed before the COMMIT) is rolled
        back, so the connection goes back to the pool as it came."""
        driver: Any = conn.connection.dbapi_connection
        driver.autocommit = True
        try:
            yield
        finally:
            if not conn.invalidated:  # a lost connection's driver is gone with it
                if driver.info.transaction_status != IDLE:
                    conn.exec_driver_sql("ROLLBACK")
                driver.autocommit = False

    def alone(self, work: Callable[[Connection], T], attempts: int = 10,
              repeatable: bool = True, durable: bool = True) -> T:
        """Run ``work``, whose statements need nothing in common (reads, or one write), on
        a connection of :attr:`publish_pool`: each statement commits as it runs, one
        round trip, no BEGIN or COMMIT. Retried as :meth:`run` retries; a write that is
        not ``repeatable`` is raised when its connection broke as it ran (it may have
        landed), and first checks that its connection was not closed by the server (a
        statement could not tell that from a reply lost). Without that pool, as
        :meth:`run` runs it."""
        kept = self.publish_pool
        if kept is None:
            return self.run(work, attempts, durable=durable, repeatable=repeatable)
        for attempt in range(1, attempts + 1):
            try:
                pooled = self._checkout(kept)
            except DBAPIError as refused:  # nothing sent: run again, whatever the work
                self._retry_or_raise(refused, False, attempt, attempts)
                continue
            if not repeatable and attempt < attempts and closed_by_server(
                    pooled.dbapi_connection):
                pooled.invalidate()
                pooled.close()
                continue
            try:
                with Connection(self.engine, connection=pooled) as conn:
                    return work(conn)
            except DBAPIError as exc:
                self._retry_or_raise(exc, not repeatable, attempt, attempts)
        raise AssertionError("unreachable")

    def _checkout(self, pool: Pool) -> Any:
        """A connection of ``pool``; one that cannot be made raises as the engine's own
        would (SQLAlchemy's error, a lost server marked as such): retried as :meth:`run`
        retries a connection refused."""
        try:
            return pool.connect()
        except self.engine.dialect.loaded_dbapi.Error as error:
            dialect = self.engine.dialect
            raise DBAPIError.instance(
                None, None, error, dialect.loaded_dbapi.Error, dialect=dialect,
                connection_invalidated=dialect.is_disconnect(error, None, None)) from error

    def run_fenced(self, work: Callable[[Connection], T]) -> T:
        """Run fenced ``work`` (claims, settlements, sweeps: run again after a lost commit
        reply, it finds its rows gone) whose loss in a server crash means a redelivery,
        never a lost message: repeatable, its commit not waiting for the disk."""
        return self.run(work, durable=False, repeatable=True)

    def _retry_or_raise(self, exc: DBAPIError, committing: bool, attempt: int,
                        attempts: int) -> None:
        """Back off before the next attempt, or raise ``exc``: a transaction that may have
        committed (``committing``, its connection lost) or an error no attempt cures."""
        if committing and exc.connection_invalidated:
            raise exc
        retry = exc.connection_invalidated or self.dialect.is_transient(exc)
        if not retry or attempt == attempts:
            raise exc
        # racing claimers deadlock in bursts on MariaDB: back off, jittered
        time.sleep(random.uniform(0.005, 0.02) * attempt)

    def rows_insert(self, spec: TableSpec) -> RowsInsert | None:
        """The table's publish statement for this engine's driver (see
        :meth:`.Dialect.rows_insert`)."""
        return self.dialect.rows_insert(spec, self.engine.dialect.paramstyle,
                                        self.engine.dialect.driver)

    def write(self, insert: RowsInsert, rows: Sequence[Mapping[str, Any]],
              attempts: int = 10, durable: bool = True) -> None:
        """Insert ``rows`` in one transaction of their own, through a pooled connection's
        driver cursor (no SQLAlchemy statement machinery on the way: a publish costs the
        round trips a bare driver loop makes): one statement the database commits itself
        where the dialect allows (:attr:`.Dialect.autocommit_write`, a connection of
        :attr:`publish_pool`, and for durable rows :attr:`.Dialect.autocommit_switch`),
        else BEGIN (where the dialect needs one), INSERT, COMMIT. Retried as :meth:`run`
        retries work that is not repeatable; driver errors are raised as SQLAlchemy's, as
        :meth:`run` raises.
        Rows that are not ``durable`` skip the commit's wait for the disk, as in :meth:`run`."""
        sql = insert.sql(len(rows))
        switch = durable and self.switch_autocommit
        kept = self.publish_pool
        alone = self.dialect.autocommit_write or switch or kept is not None
        for attempt in range(1, attempts + 1):
            committing = switched = False
            try:
                pooled = self.engine.raw_connection() if kept is None else self._checkout(kept)
            except DBAPIError as refused:
                self._retry_or_raise(refused, False, attempt, attempts)
                continue
            cursor = None
            try:
                # one cursor per connection for its publishes (forgotten with the connection):
                # a cursor made per publish is a good part of the client's time
                cursor = pooled.info.get(PUBLISH_CURSOR)
                if cursor is None:
                    cursor = pooled.info[PUBLISH_CURSOR] = pooled.cursor()
                driver: Any = pooled.dbapi_connection
                if switch or kept is not None:
                    if attempt < attempts and closed_by_server(driver):
                        # its statement could not tell a connection that was dead before
                        # it from a commit whose reply was lost: take a fresh one first
                        pooled.invalidate()
                        continue
                    if switch:
                        driver.autocommit = switched = True
                if alone:
                    committing = True  # the statement is the commit
                    if switched and insert.apart is not None:  # the wake-up after it
                        plain, wake, values = insert.apart
                        cursor.execute(plain.sql(len(rows)), plain.parameters(rows))
                        if not self._wake_after_commit(pooled, cursor, wake, values):
                            return
                    else:
                        cursor.execute(sql, insert.parameters(rows))
                    if switched:
                        driver.autocommit = False
                    return
                if self.dialect.begin_write:
                    cursor.execute(self.dialect.begin_write)
                if not durable and self.dialect.relaxed_commit:
                    cursor.execute(self.dialect.relaxed_commit)
                cursor.execute(sql, insert.parameters(rows))
                committing = True
                pooled.commit()
                return
            except self.engine.dialect.loaded_dbapi.Error as driver_error:
                exc = self._driver_failure(driver_error, pooled, cursor, sql)
                if switched and not exc.connection_invalidated:
                    driver.autocommit = False  # back to the pool as it came
                self._retry_or_raise(exc, committing, attempt, attempts)
            finally:
                pooled.close()

    def _wake_after_commit(self, pooled: Any, cursor: Any, wake: str,
                           values: Sequence[Any]) -> bool:
        """Send a committed publish's wake-up; whether its connection is still usable. A
        failure loses the wake-up, not the row (its consumers find it at their next poll):
        the publish is not raised as failed, which a caller would retry, writing it twice."""
        try:
            cursor.execute(wake, values)
        except self.engine.dialect.loaded_dbapi.Error as driver_error:
            exc = self._driver_failure(driver_error, pooled, cursor, wake)
            logger.warning("A published row's wake-up was not sent (%s); the row is "
                           "committed, its consumers find it at their next poll",
                           exc.orig)
            return not exc.connection_invalidated
        return True

    def _driver_failure(self, error: Any, pooled: Any, cursor: Any, sql: str) -> DBAPIError:
        """A publish cursor's driver error as SQLAlchemy raises it; a connection it shows
        dead is invalidated (so the pool opens a fresh one, its cursors closed with it),
        any other is rolled back.

        The cursor is not reused, and on a live connection it is closed here, by the
        thread holding the connection: the raised error's traceback keeps it in a
        reference cycle, and SQLite resets a failed statement when its cursor is freed,
        which waits for the connection's mutex. Freed by a garbage collection in another
        thread (one holding the write lock) while this connection's next statement waits
        for that lock, the two would wait on each other until the busy timeout."""
        dialect = self.engine.dialect
        lost = dialect.is_disconnect(error, pooled.dbapi_connection, cursor)
        pooled.info.pop(PUBLISH_CURSOR, None)
        if lost:
            pooled.invalidate(error)
        else:
            if cursor is not None:
                cursor.close()
            pooled.rollback()
        wrapped = DBAPIError.instance(sql, None, error, dialect.loaded_dbapi.Error,
                                      connection_invalidated=lost, dialect=dialect)
        assert isinstance(wrapped, DBAPIError)  # a driver error always wraps as one
        return wrapped

    def bound_caller(self) -> Connection | None:
        """The bound caller's transaction (:mod:`.binding`) when it is on this database."""
        caller = binding.current()
        return caller if caller is not None and same_database(caller.engine, self.engine) \
            else None

    def ping(self) -> None:
        self.run(lambda conn: conn.exec_driver_sql("SELECT 1"), attempts=1, read_only=True)

    def has_table(self, spec: TableSpec, attempts: int = 10) -> bool:
        """Whether ``spec``'s table exists, committed."""
        return self.run(lambda conn: inspect(conn).has_table(spec.table, schema=spec.schema),
                        attempts=attempts, read_only=True)

    def ensure_table(self, name: str, ddl: Sequence[str], create: bool,
                     missing: Callable[[], str]) -> None:
        """A table of the transport's own (paused queues, rate budget): there, or made by
        ``ddl`` where the transport creates tables (a race with another process making
        it is run again), else :class:`SchemaMismatch` saying ``missing()``."""
        if self.run(lambda conn: inspect(conn).has_table(name), read_only=True):
            return
        if not create:
            raise SchemaMismatch(missing())

        def make(conn: Connection) -> None:
            for statement in ddl:
                conn.exec_driver_sql(statement)

        try:
            self.run(make)
        except DBAPIError:  # another process created it at the same moment
            self.run(make)
