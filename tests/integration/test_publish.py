"""A publish outside a binding: its INSERT on the pooled driver connection's cursor.

A busy database is retried (the row lands once); a driver whose parameter style the
transport does not rewrite publishes through SQLAlchemy instead. A lost COMMIT reply
is in test_lost_commits.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError

from kombu_sqlinbox.broker import close_all
from kombu_sqlinbox.dialects.sqlite import SQLiteDialect

from .conftest import Connect
from .support import broker_of, count_rows, get_within, publish, rows_locked, table_of

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
