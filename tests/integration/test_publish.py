"""A publish outside a binding: its INSERT on the pooled driver connection's cursor.

A busy database is retried (the row lands once); a driver whose parameter style the
transport does not rewrite publishes through SQLAlchemy instead. On MariaDB publishes
keep connections of their own in autocommit. A lost COMMIT reply is in test_lost_commits.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
from kombu import Connection
from sqlalchemy import Connection as SAConnection
from sqlalchemy import text
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError

from kombu_sqlinbox.brokers import close_all
from kombu_sqlinbox.database import closed_by_server
from kombu_sqlinbox.dialects.sqlite import SQLiteDialect

from .conftest import Connect
from .support import (
    broker_of,
    count_rows,
    get_within,
    publish,
    quoted,
    rows_locked,
    table_of,
    wait_for,
)

BUSY = 0.2


@pytest.mark.databases("sqlite")
def test_a_publish_finding_the_write_lock_held_is_retried_and_lands_once(
        connect: Connect, engine: Engine, table_prefix: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(SQLiteDialect, "busy_timeout", BUSY)  # locked in BUSY s, not 30
    conn = connect()
    publish(conn, "jobs", {"n": 0})
    table = table_of("jobs", table_prefix)
    took: list[float] = []

    def publish_timed() -> None:
        started = time.monotonic()
        publish(conn, "jobs", {"n": 1})
        took.append(time.monotonic() - started)

    publisher = threading.Thread(target=publish_timed)
    with rows_locked(engine, table):
        publisher.start()
        publisher.join(3 * BUSY)  # the lock is held this long: the first attempts fail
    publisher.join(10)
    assert took and took[0] >= 2 * BUSY, f"the publish never waited out the lock: {took}"
    assert count_rows(engine, table) == 2
    assert [get_within(conn, "jobs").payload["n"] for _ in range(2)] == [0, 1]


@pytest.mark.databases("sqlite")
def test_a_driver_of_another_parameter_style_publishes_and_consumes_through_sqlalchemy(
        connect: Connect, engine: Engine, table_prefix: str) -> None:
    conn = connect(engine_options={"paramstyle": "named"})
    publish(conn, "jobs", {"n": 1})
    broker = broker_of(conn)
    assert broker.database.rows_insert(broker.table("jobs").spec) is None
    assert count_rows(engine, table_of("jobs", table_prefix)) == 1
    message = get_within(conn, "jobs")  # claimed by SQLAlchemy's statement
    assert message.payload == {"n": 1}
    message.ack()
    assert broker.keeper.flush(timeout=10)  # settled by SQLAlchemy's statement
    assert count_rows(engine, table_of("jobs", table_prefix)) == 0


@pytest.mark.databases("postgresql")
def test_a_failed_publish_returns_its_connection_out_of_autocommit(
        connect: Connect, engine: Engine, table_prefix: str) -> None:
    """A durable publish on PostgreSQL runs its INSERT in autocommit; one that fails (its
    table gone) leaves no connection in the pool in autocommit, where the transport's
    own transactions would commit statement by statement."""
    conn = connect()
    publish(conn, "jobs", {"n": 0})
    with engine.begin() as drop:
        drop.exec_driver_sql(f'DROP TABLE "{table_of("jobs", table_prefix)}"')
    with pytest.raises(DBAPIError):
        conn.Producer().publish({"n": 1}, routing_key="jobs", retry=False)
    pool = broker_of(conn).engine.pool
    pooled = [pool.connect() for _ in range(pool.checkedin())]
    try:
        assert pooled and not any(p.dbapi_connection.autocommit for p in pooled)
    finally:
        for p in pooled:
            p.close()


@pytest.mark.databases("sqlite")
def test_a_channel_that_outlives_its_closed_broker_publishes_into_no_other_file(
        connect: Connect, engine: Engine, table_prefix: str) -> None:
    """``close_all`` (a test's or a process's end) closes the broker a channel still holds.
    A publish on that channel lands, and its wake-up writes nothing to the descriptors the
    broker's pipe had, which by then belong to another file; closing again closes none of
    them."""
    conn = connect()
    publish(conn, "jobs", {"n": 0})
    broker = broker_of(conn)
    wakeup = broker.wakeup
    wakeup.listen(None)  # a consumer of this process: a publish pokes its pipe
    old_read, old_write = wakeup._read, wakeup._write
    close_all()
    other_read, other_write = os.pipe()
    os.dup2(other_write, old_write)  # another file takes the pipe's numbers
    os.dup2(other_read, old_read)
    try:
        publish(conn, "jobs", {"n": 1})
        os.set_blocking(other_read, False)
        with pytest.raises(BlockingIOError):
            os.read(other_read, 16)
        broker.close()  # again: the other file's descriptors stay open
        os.fstat(old_read)
        os.fstat(old_write)
    finally:
        for fd in {old_read, old_write, other_read, other_write}:  # often the same numbers
            os.close(fd)
    assert count_rows(engine, table_of("jobs", table_prefix)) == 2


class Oops(Exception):
    pass


def publish_connection_id(conn: Connection) -> int:
    """The server's id of the connection a publish takes next (the one a single thread's
    publishes left in the broker's publish pool)."""
    pool = broker_of(conn).database.publish_pool
    assert pool is not None, "no publish pool on this driver"
    pooled = pool.connect()
    try:
        cursor = pooled.cursor()
        cursor.execute("SELECT CONNECTION_ID()")
        found = cursor.fetchone()
        cursor.close()
        assert found is not None
        return int(found[0])
    finally:
        pooled.close()


def kill_publish_connection(conn: Connection, engine: Engine) -> int:
    """Kill the idle connection the next publish takes (as ``KILL`` or ``wait_timeout``
    would) and wait until its socket shows it closed; its server id."""
    pool = broker_of(conn).database.publish_pool
    assert pool is not None
    pooled = pool.connect()
    driver = pooled.dbapi_connection
    pooled.close()
    killed = publish_connection_id(conn)
    with engine.connect() as admin:
        admin.exec_driver_sql(f"KILL {killed}")
    wait_for(lambda: closed_by_server(driver), "the killed connection's end")
    return killed


def connected(engine: Engine, connection_id: int) -> bool:
    with engine.connect() as conn:
        return bool(conn.execute(
            text("SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE ID = :id"),
            {"id": connection_id}).scalar_one())


@pytest.mark.databases("mysql")
def test_publishes_in_autocommit_leave_the_transactions_of_the_pool_whole(
        connect: Connect, engine: Engine, table_prefix: str) -> None:
    """Publishes on MariaDB keep connections of their own in autocommit: a transaction
    run after them (on the connection an earlier publish of the thread would have taken)
    is still one transaction, which a failure rolls back whole."""
    conn = connect()
    for n in range(3):
        publish(conn, "jobs", {"n": n})
    publisher = publish_connection_id(conn)
    table = quoted(engine, table_of("jobs", table_prefix))
    seen: list[tuple[int, int]] = []

    def delete_then_fail(session: SAConnection) -> None:
        row = session.exec_driver_sql("SELECT CONNECTION_ID(), @@autocommit").one()
        seen.append((int(row[0]), int(row[1])))
        session.exec_driver_sql(f"DELETE FROM {table}")
        raise Oops

    with pytest.raises(Oops):
        broker_of(conn).database.run(delete_then_fail)
    assert seen[0][0] != publisher and seen[0][1] == 0
    assert count_rows(engine, table_of("jobs", table_prefix)) == 3
    publish(conn, "jobs", {"n": 3})
    assert publish_connection_id(conn) == publisher  # kept, in autocommit
    assert count_rows(engine, table_of("jobs", table_prefix)) == 4


@pytest.mark.databases("mysql")
def test_a_publish_on_a_connection_the_server_killed_takes_a_fresh_one_and_lands_once(
        connect: Connect, engine: Engine, table_prefix: str) -> None:
    """A publish connection killed while idle (KILL, wait_timeout) is seen closed before
    the publish sends anything: the publish goes on, once, on a fresh connection."""
    conn = connect()
    publish(conn, "jobs", {"n": 0})
    killed = kill_publish_connection(conn, engine)
    conn.Producer().publish({"n": 1}, routing_key="jobs", retry=False)
    assert count_rows(engine, table_of("jobs", table_prefix)) == 2
    assert publish_connection_id(conn) != killed


@pytest.mark.databases("mysql")
def test_closing_the_broker_closes_its_publish_connections(
        connect: Connect, engine: Engine) -> None:
    conn = connect()
    publish(conn, "jobs", {"n": 0})
    publisher = publish_connection_id(conn)
    assert connected(engine, publisher)
    close_all()
    wait_for(lambda: not connected(engine, publisher), "the publish connection's end")


@pytest.mark.databases("mysql")
def test_a_forked_child_publishes_on_connections_of_its_own(
        connect: Connect, engine: Engine, table_prefix: str) -> None:
    """A child forked after publishes (a prefork pool process) opens its own publish
    connection; the parent's stays the parent's and goes on publishing."""
    conn = connect()
    publish(conn, "jobs", {"n": 0})
    parent = publish_connection_id(conn)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            publish(conn, "jobs", {"n": 1})
            os.write(write, str(publish_connection_id(conn)).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read) as reader:
        child = reader.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert int(child) != parent
    publish(conn, "jobs", {"n": 2})
    assert publish_connection_id(conn) == parent
    assert count_rows(engine, table_of("jobs", table_prefix)) == 3


@pytest.mark.databases("sqlite")
def test_a_publish_retry_policy_leaves_a_connection_that_connects_again(
        connect: Connect) -> None:
    """kombu's ``publish(retry=True, retry_policy=...)`` copies the policy into the
    connection's transport options, Celery's ``task_publish_retry_policy`` with its
    ``retry_errors`` too: the connection opened again after it closed (as kombu does after
    a connection error), and its clones, take those keys as kombu's own."""
    conn = connect()
    policy = {"max_retries": 2, "interval_start": 0, "retry_errors": (TimeoutError,),
              "errback": lambda exc, interval: None, "on_revive": lambda channel: None}
    publish(conn, "jobs", {"n": 1}, retry=True, retry_policy=policy)
    assert "retry_errors" in conn.transport_options  # what kombu did to the options
    conn.close()
    publish(conn, "jobs", {"n": 2})
    clone = conn.clone()
    try:
        assert [get_within(clone, "jobs").payload["n"] for _ in range(2)] == [1, 2]
    finally:
        clone.release()
