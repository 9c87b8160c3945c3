"""Helpers the behaviour suite shares: publishing, bounded waits, looking at the table."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from multiprocessing.synchronize import Event
from typing import Any, TypeVar

import pytest
from kombu import Connection, Consumer, Queue
from kombu.message import Message
from sqlalchemy import TextClause, event, text
from sqlalchemy.engine import Engine

from kombu_sqlinbox import TableBuilder
from kombu_sqlinbox.broker import Broker
from kombu_sqlinbox.codec import DEATH_HEADER
from kombu_sqlinbox.dialects.base import DriverSql
from kombu_sqlinbox.rates import RateLimits
from kombu_sqlinbox.tables import TableSpec, table_name_for_queue
from tests.processes import wait_until

T = TypeVar("T")
#: what a consumer process's task notes in the ledger before its start and end
Task = Callable[[Any, Message], tuple[Any, ...]]

#: the type MariaDB/MySQL routing tables gave names before they were binary strings: a
#: collation that ignores trailing spaces when it compares
PADDED_NAME_TYPE = "VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin"


def earlier_routing_ddl(ddl: list[str]) -> list[str]:
    """MariaDB/MySQL routing tables as an earlier version made them: names and patterns
    as text (:data:`PADDED_NAME_TYPE`), transient headers in a TEXT (64 KiB)."""
    return [statement.replace("VARBINARY(1020)", PADDED_NAME_TYPE)
            .replace("pattern BLOB", f"pattern {PADDED_NAME_TYPE}")
            .replace("headers LONGTEXT", "headers TEXT") for statement in ddl]
#: transport options giving queue "jobs" the dead-letter queue "jobs.dead"
DEAD_LETTERS: dict[str, Any] = {"queues": {"jobs": {"dead_letter_queue": "jobs.dead"}}}


def broker_of(conn: Connection) -> Broker:
    """The per-process broker behind a kombu connection (its keeper, dialect, tables)."""
    broker: Broker = conn.default_channel.broker
    return broker


def database_now(rates: RateLimits) -> float:
    """The database's clock (epoch seconds) as a rate budget's statements read it."""
    return float(rates.database.run(
        lambda conn: conn.execute(rates.sql.now).scalar_one(), read_only=True))


def publish(conn: Connection, queue: str, body: Any, **kwargs: Any) -> None:
    """Declare ``queue`` and publish one message to it through the default exchange."""
    conn.default_channel.queue_declare(queue)
    conn.Producer().publish(body, routing_key=queue, **kwargs)


def wait_for(predicate: Callable[[], T | None], what: str, timeout: float = 10.0,
             interval: float = 0.05) -> T:
    """:func:`tests.processes.wait_until` with the short default timeout of in-process
    tests."""
    value: T = wait_until(predicate, timeout, what, interval=interval)
    return value


def get(conn: Connection, queue: str) -> Message | None:
    """One ``basic_get`` on the connection's default channel."""
    message: Message | None = conn.default_channel.basic_get(queue)
    return message


def get_within(conn: Connection, queue: str, timeout: float = 10.0) -> Message:
    """The next message of ``queue``, polled until ``timeout``."""
    return wait_for(lambda: get(conn, queue), f"a message on {queue!r}", timeout)


def never_delivered(rival: Connection, queues: list[str], seconds: float) -> None:
    """Fail if ``rival`` (another consumer, as in another process) receives a message of
    ``queues`` within ``seconds``: rows held elsewhere must stay there."""
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        for queue in queues:
            assert get(rival, queue) is None, f"a held row of {queue!r} was delivered again"
        time.sleep(0.1)


def settled(conn: Connection) -> None:
    """Wait for the lease keeper to write every pending ack/requeue (it batches them)."""
    assert broker_of(conn).keeper.flush(timeout=10), "lease keeper did not settle in 10 s"


def run_prepared(statement: TextClause) -> str:
    """How a session that prepared ``statement`` (psycopg2's LISTEN connection and the
    lease keeper's own) sends it: ``EXECUTE`` and the name it was prepared under."""
    return DriverSql.prepared(statement, "pyformat").sql.partition(" (")[0]


def table_of(queue: str, prefix: str) -> str:
    return table_name_for_queue(queue, prefix)


def quoted(engine: Engine, name: str) -> str:
    return str(engine.dialect.identifier_preparer.quote(name))


def rows(engine: Engine, table: str) -> list[dict[str, Any]]:
    """Every row of a default-layout queue table, by id."""
    with engine.connect() as conn:
        result = conn.execute(text(
            f"SELECT id, attempt, locked_until, payload, headers FROM {quoted(engine, table)} "
            "ORDER BY id"))
        return [dict(row._mapping) for row in result]


def count_rows(engine: Engine, table: str) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text(f"SELECT COUNT(*) FROM {quoted(engine, table)}")).scalar_one())


@contextmanager
def rows_locked(engine: Engine, table: str) -> Iterator[None]:
    """Hold every row of ``table`` in an open write transaction of another connection, so
    a settlement of them waits until the block ends (SQLite: the database's write lock)."""
    with engine.connect() as conn:
        conn.begin()
        conn.execute(text(f"UPDATE {quoted(engine, table)} SET attempt = attempt"))
        try:
            yield
        finally:
            conn.rollback()


def death(message: Message) -> dict[str, Any]:
    """The record the transport adds to a dead-lettered message."""
    record: dict[str, Any] = message.headers[DEATH_HEADER]
    return record


@contextmanager
def statements_run(engine: Engine,
                   keep: Callable[[str], bool] = lambda sql: True) -> Iterator[list[str]]:
    """The SQL of the statements ``engine``'s connections run inside the block (those
    ``keep`` accepts), as they run."""
    seen: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if keep(statement):
            seen.append(statement)

    event.listen(engine, "before_cursor_execute", record)
    try:
        yield seen
    finally:
        event.remove(engine, "before_cursor_execute", record)


def exit_code_within(pid: int, seconds: float) -> int | None:
    """A child's exit code, or None (and the child killed) when it has not ended in time."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)  # polling a child's exit: there is no event to wait on
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None


def fifo_jobs(connect: Callable[..., Connection], table_prefix: str) -> Connection:
    """A connection whose queue "jobs" is a FIFO table, holding messages 1 and 2 of one
    group."""
    spec = (TableBuilder(f"{table_prefix}jobs").id().payload().headers()
            .group("grp", fifo=True).available_at().locked_until().attempt().build())
    conn = connect(queues={"jobs": {"table": spec}})
    for n in (1, 2):
        publish(conn, "jobs", {"n": n}, headers={"group_key": "g"})
    return conn


@contextmanager
def session_ended_after(engine: Engine, admin: Engine,
                        marker: Callable[[str], bool]) -> Iterator[list[str]]:
    """End, for real, the session of the first of ``engine``'s connections that runs a
    statement ``marker`` accepts, just after it ran (its transaction open): PostgreSQL
    and MariaDB by ``pg_terminate_backend`` / ``KILL`` from ``admin`` (waited for until the
    server dropped it), SQLite by closing the driver's connection. Yields the statements
    after which a session ended."""
    ended: list[str] = []

    def end(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if ended or not marker(statement):
            return
        ended.append(statement)
        driver = cursor.connection
        if engine.dialect.name == "sqlite":
            driver.close()
            return
        postgresql = engine.dialect.name == "postgresql"
        own = driver.cursor()
        own.execute("SELECT pg_backend_pid()" if postgresql else "SELECT CONNECTION_ID()")
        backend = int(own.fetchone()[0])
        own.close()
        kill, alive = (("SELECT pg_terminate_backend(:id)",
                        "SELECT COUNT(*) FROM pg_stat_activity WHERE pid = :id")
                       if postgresql else
                       ("KILL :id", "SELECT COUNT(*) FROM information_schema.PROCESSLIST "
                        "WHERE ID = :id"))
        with admin.begin() as session:
            session.execute(text(kill), {"id": backend})

        def gone() -> bool:  # a transaction each: PostgreSQL's statistics hold still in one
            with admin.connect() as session:
                return not session.execute(text(alive), {"id": backend}).scalar_one()

        wait_for(gone, "the ended session to go")

    event.listen(engine, "after_cursor_execute", end)
    try:
        yield ended
    finally:
        event.remove(engine, "after_cursor_execute", end)


def consume(broker_url: str, options: dict[str, Any], queue: str, prefetch: int, task: Task,
            ready: Event, stop: Event,
            ledger: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    """A consumer process: consume ``queue`` until ``stop`` (``ready`` once consuming);
    each message runs ``task`` (a module's function: it crosses to a spawned process),
    which notes what it returns, its start and its end (one host clock) in ``ledger``,
    then is acknowledged."""
    with Connection(broker_url, transport_options=options) as conn:
        def run(body: Any, message: Message) -> None:
            start = time.monotonic()
            noted = task(body, message)
            ledger.put((*noted, start, time.monotonic()))
            message.ack()

        conn.default_channel.queue_declare(queue)
        with Consumer(conn, [Queue(queue, routing_key=queue)], callbacks=[run],
                      prefetch_count=prefetch):
            ready.set()
            while not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    conn.drain_events(timeout=0.2)


@contextmanager
def consumer_processes(count: int, broker_url: str, options: dict[str, Any], queue: str,
                       prefetch: int, task: Task, wait: float = 60.0,
                       ) -> Iterator[multiprocessing.Queue]:  # type: ignore[type-arg]
    """``count`` spawned processes racing over ``queue`` (see :func:`consume`), each
    consuming before this yields their ledger; stopped after (each within ``wait``, else
    killed), and each must have exited cleanly."""
    context = multiprocessing.get_context("spawn")
    stop, ledger = context.Event(), context.Queue()
    readies = [context.Event() for _ in range(count)]
    children = [context.Process(target=consume, args=(
        broker_url, options, queue, prefetch, task, ready, stop, ledger)) for ready in readies]
    for child in children:
        child.start()
    try:
        for ready in readies:
            assert ready.wait(wait), "a consumer process did not start"
        yield ledger
    finally:
        stop.set()
        for child in children:
            child.join(wait)
            if child.is_alive():
                child.kill()
    assert all(child.exitcode == 0 for child in children), [c.exitcode for c in children]


@contextmanager
def spawned(target: Callable[..., None], arguments: list[tuple[Any, ...]],
            wait: float = 60.0) -> Iterator[list[Any]]:
    """One spawned process per tuple of ``arguments``, each running ``target(*args, ready,
    stop, results)`` and started (``ready`` set) before this yields; on the way out each
    is stopped, puts one result in ``results`` (collected, in the list yielded), and is
    joined within ``wait`` (else killed); each must have exited cleanly."""
    context = multiprocessing.get_context("spawn")
    stop, results = context.Event(), context.Queue()
    readies = [context.Event() for _ in arguments]
    children = [context.Process(target=target, args=(*args, ready, stop, results))
                for args, ready in zip(arguments, readies, strict=True)]
    for child in children:
        child.start()
    collected: list[Any] = []
    try:
        for ready in readies:
            assert ready.wait(wait), "a process did not start"
        yield collected
    finally:
        stop.set()
        collected += [results.get(timeout=wait) for _ in children]
        for child in children:
            child.join(wait)
            if child.is_alive():
                child.kill()
    assert all(child.exitcode == 0 for child in children), [c.exitcode for c in children]


def partitioned_table(engine: Engine, name: str) -> TableSpec:
    """A declared PostgreSQL queue table ``name`` partitioned by id, rows 1-2 in one
    partition and the rest in another (so rows 1 and 3 lie at the same tuple id)."""
    with engine.begin() as db:
        db.execute(text(f'CREATE SEQUENCE "{name}_seq"'))
        db.execute(text(
            f'CREATE TABLE "{name}" (id BIGINT NOT NULL DEFAULT nextval(\'"{name}_seq"\'), '
            "payload BYTEA NOT NULL, headers TEXT, priority SMALLINT NOT NULL DEFAULT 0, "
            "available_at TIMESTAMPTZ NOT NULL DEFAULT now(), locked_until TIMESTAMPTZ, "
            "attempt INTEGER NOT NULL DEFAULT 0, PRIMARY KEY (id)) PARTITION BY RANGE (id)"))
        db.execute(text(f'ALTER SEQUENCE "{name}_seq" OWNED BY "{name}".id'))
        db.execute(text(f'CREATE TABLE "{name}_a" PARTITION OF "{name}" '
                        "FOR VALUES FROM (MINVALUE) TO (3)"))
        db.execute(text(f'CREATE TABLE "{name}_b" PARTITION OF "{name}" '
                        "FOR VALUES FROM (3) TO (MAXVALUE)"))
    return (TableBuilder(name).id().payload().headers().priority().available_at()
            .locked_until().attempt().build())


#: a PostgreSQL test run through each driver (with the ``driver_url`` and ``pooled`` fixtures)
DRIVERS = pytest.mark.parametrize("driver", ["psycopg", "psycopg2"])
#: the statement that names the session's server process
BACKEND = "SELECT pg_backend_pid()"
