"""Work the garbage collector does in whichever thread collects.

A collection runs in the thread whose allocation set it off, so whatever it frees (a
driver cursor, a finalizer's callback) runs there, in the middle of that thread's own
work: holding its locks, inside its transaction. Nothing freed that way may wait for what
the collecting thread may hold.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError

from .conftest import Connect
from .support import broker_of, get_within, publish, quoted, rows, table_of


def collected_in(collect: Callable[[], object], seconds: float) -> bool:
    """Whether ``collect`` ended within ``seconds`` in a thread of its own."""
    thread = threading.Thread(target=collect, daemon=True)
    thread.start()
    thread.join(seconds)
    return not thread.is_alive()


@contextmanager
def collection_left_to_us() -> Iterator[None]:
    """No automatic collection in the block: the cycles it makes wait for ours."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


@contextmanager
def a_statement_held_on(pool: Any) -> Iterator[None]:
    """A statement running, for the block, on the one connection checked in to ``pool``
    (held inside a SQLite function of ours, so it holds the connection's mutex)."""
    assert pool.checkedin() == 1  # the one a failed statement used
    entered, release = threading.Event(), threading.Event()

    def hold() -> int:
        entered.set()
        release.wait(30)
        return 1

    def run_a_held_statement() -> None:
        pooled = pool.connect()
        driver: Any = pooled.dbapi_connection
        try:
            driver.create_function("hold", 0, hold)
            driver.execute("SELECT hold()").fetchone()
        finally:
            pooled.close()

    holder = threading.Thread(target=run_a_held_statement, daemon=True)
    holder.start()
    try:
        assert entered.wait(10), "the held statement never began"
        yield
    finally:
        release.set()
        holder.join(10)


@contextmanager
def refused_inserts(engine: Engine, table: str) -> Iterator[None]:
    """Every INSERT into ``table`` fails as it runs (a trigger aborts it)."""
    with engine.begin() as db:
        db.exec_driver_sql(f"CREATE TRIGGER refuse BEFORE INSERT ON {table} "
                           "BEGIN SELECT RAISE(ABORT, 'refused'); END")
    try:
        yield
    finally:
        with engine.begin() as db:
            db.exec_driver_sql("DROP TRIGGER refuse")


@pytest.mark.databases("sqlite")
def test_a_failed_publish_leaves_no_statement_for_another_threads_collection_to_wait_on(
        connect: Connect, engine: Engine, table_prefix: str) -> None:
    """A publish whose INSERT fails is raised, and the driver cursor it failed on is
    closed at once. The raised error's traceback keeps that cursor in a reference cycle:
    left to the collector, SQLite resets its statement from whichever thread collects,
    which waits for the connection's mutex while another thread runs a statement on it.
    A collecting thread holding the write lock, while that statement waited for the
    lock, stalled both for the busy timeout (a consumer's renewal and its publisher,
    30 s)."""
    conn = connect()
    publish(conn, "jobs", {"n": 0})
    with refused_inserts(engine, quoted(engine, table_of("jobs", table_prefix))), \
            collection_left_to_us():
        with pytest.raises(DBAPIError, match="refused"):
            conn.Producer().publish({"n": 1}, routing_key="jobs", retry=False)
        with a_statement_held_on(broker_of(conn).engine.pool):
            assert collected_in(gc.collect, 5), "the collection waited for the connection"
    publish(conn, "jobs", {"n": 2})
    assert [get_within(conn, "jobs").payload["n"] for _ in range(2)] == [0, 2]


@pytest.mark.databases("sqlite")
def test_a_failed_statement_of_a_run_leaves_no_statement_for_another_threads_collection(
        connect: Connect, engine: Engine, table_prefix: str) -> None:
    """The same through SQLAlchemy's error path: a failed statement of
    :meth:`Database.run` is raised through a frame that keeps the error in a cycle with
    its traceback, the failed cursor's frame included; SQLAlchemy closes that cursor as
    it raises, so the collection has no statement to reset."""
    conn = connect()
    publish(conn, "jobs", {"n": 0})
    broker = broker_of(conn)
    table = quoted(engine, table_of("jobs", table_prefix))
    with refused_inserts(engine, table), collection_left_to_us():
        with pytest.raises(DBAPIError, match="refused"):
            broker.database.run(lambda db: db.exec_driver_sql(
                f"INSERT INTO {table} (payload) VALUES (x'00')"), attempts=1)
        with a_statement_held_on(broker.database.engine.pool):
            assert collected_in(gc.collect, 5), "the collection waited for the connection"


@pytest.mark.databases("sqlite")
def test_a_dropped_messages_release_collected_under_the_keepers_lock_does_not_wait_for_it(
        connect: Connect, engine: Engine, table_prefix: str) -> None:
    """After kombu collects a failed connection (Celery's reconnect path), a message the
    consumer still references keeps its row; once the message is freed, its finalizer
    has the row released. A message in a reference cycle (a failed task's traceback
    keeps its request and message in one) is freed by a collection, in whichever thread
    allocates: a keeper thread allocating under the keeper's lock ran the release, whose
    settlement waited for that lock, held by its own thread, for ever, and every ack of
    the process behind it. The finalizer now hands the release over; a flush (or the
    consumer's next round) runs it."""
    conn = connect()
    publish(conn, "jobs", {"n": "dropped"})
    keeper = broker_of(conn).keeper
    dropped = get_within(conn, "jobs")
    stuck = False

    def collect_holding_the_keepers_lock() -> None:
        try:
            with keeper._lock:  # as a keeper thread holds it while it allocates
                gc.collect()
        except RuntimeError:  # released for it below, after it was found waiting
            pass

    with collection_left_to_us():
        try:
            conn.collect()  # the release of the row is now the message's finalizer
            cycle: list[object] = [dropped]
            cycle.append(cycle)
            del dropped, cycle
            stuck = not collected_in(collect_holding_the_keepers_lock, 5)
        finally:
            if stuck:
                keeper._lock.release()  # a Lock has no owner: lets the release go on
    assert not stuck, "the finalizer waited for the keeper's lock its own thread held"
    assert keeper.flush(timeout=10)
    assert [row["locked_until"] is None for row in rows(engine, table_of(
        "jobs", table_prefix))] == [True]
