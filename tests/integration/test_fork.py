"""A process forked beside a SQLite transaction of another thread (a Celery prefork pool
replacing a dead process while the lease keeper writes) can still write to the file."""

from __future__ import annotations

import logging
import os
import threading
import time

import pytest
from sqlalchemy import Connection, text

from kombu_sqlinbox.database import Database
from kombu_sqlinbox.dialects import sqlite as sqlite_dialect
from kombu_sqlinbox.dialects.sqlite import FORK_GATE, SQLiteDialect

pytestmark = pytest.mark.databases("sqlite")  # SQLite keeps its file locks in process memory

#: how long the other thread's transaction holds the write lock
HOLD = 0.5
#: the child's busy timeout: it would wait this long for a lock nobody holds
CHILD_BUSY = 1.0


def child_writes(db_url: str) -> int:
    """In a forked child: 0 when a new connection of the child commits a write, else 1."""
    try:
        database = Database.open(db_url)
        database.run(lambda conn: conn.execute(text("INSERT INTO kill9_rows VALUES (2)")),
                     attempts=1)
        return 0
    except Exception:
        return 1


def wait_child(pid: int) -> int:
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def test_a_child_forked_beside_a_write_transaction_can_write(
        db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(SQLiteDialect, "busy_timeout", CHILD_BUSY)
    database = Database.open(db_url)
    database.run(lambda conn: conn.execute(text("CREATE TABLE kill9_rows (x INTEGER)")))
    holding = threading.Event()

    def hold(conn: Connection) -> None:
        conn.execute(text("INSERT INTO kill9_rows VALUES (1)"))  # the write lock is ours
        holding.set()
        threading.Event().wait(HOLD)  # the transaction's length, not a synchronisation

    writer = threading.Thread(target=database.run, args=(hold,))
    writer.start()
    try:
        assert holding.wait(10), "the writer's transaction never began"
        pid = os.fork()  # while the writer holds the lock: the fork waits for its commit
        if pid == 0:
            os._exit(child_writes(db_url))
        assert wait_child(pid) == 0, "the child found the database locked"
    finally:
        writer.join(10)
        database.engine.dispose()
    with Database.open(db_url).engine.connect() as conn:
        assert conn.execute(text("SELECT COUNT(*) FROM kill9_rows")).scalar_one() == 2


def test_a_thread_that_forks_holding_a_connection_is_not_held_back_but_warned(
        db_url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The forking thread itself holds a connection: the fork does not wait for it."""
    monkeypatch.setattr(FORK_GATE, "limit", 60.0)
    database = Database.open(db_url)
    caplog.set_level(logging.WARNING, logger=sqlite_dialect.__name__)
    try:
        with database.engine.connect():
            started = time.monotonic()
            pid = os.fork()
            if pid == 0:
                os._exit(0)
            assert time.monotonic() - started < 30, "the fork waited for its own thread"
            assert wait_child(pid) == 0
        assert "forking while 1 SQLite connections are in use" in caplog.text
        with database.engine.connect() as conn:  # the gate is open again
            assert conn.execute(text("SELECT 1")).scalar_one() == 1
    finally:
        database.engine.dispose()
