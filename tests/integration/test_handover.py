"""The release of a dropped message's row, handed over by its finalizer after kombu
collected a failed connection (Celery's reconnect path): run, once, by a consumer whose
prefetch is full, by a process that no longer consumes, never by a forked child; a
row-lock release whose connection was lost fails neither a round nor a close.

(The finalizer run under the keeper's lock is in test_garbage_collection.)"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import pytest
from kombu import Connection, Consumer, Queue
from kombu.message import Message
from sqlalchemy.engine import Engine

from tests.tcp_proxy import Proxy

from .conftest import Connect
from .support import broker_of, get_within, publish, rows, table_of, wait_for


@contextmanager
def a_row_lock_release_handed_over_after_its_connection_was_lost(
        db_url: str, table_prefix: str, proxy: Proxy) -> Iterator[Connection]:
    """claim='row_lock' through ``proxy``: a message taken, every connection of the
    process cut (the server went away), kombu's clean-up of the failed connection
    (Celery's reconnect path) keeping the row, then the message dropped and freed: its
    release is handed over. Yields a new connection on the same broker (the reconnect)."""
    url = "sqlinbox+" + proxy.url(db_url)
    options = {"table_prefix": table_prefix, "polling_interval": 0.05, "claim": "row_lock"}
    conn = Connection(url, transport_options=options)
    again = Connection(url, transport_options=options)
    try:
        publish(conn, "jobs", {"n": "dropped"})
        publish(conn, "jobs", {"n": "next"})
        dropped = get_within(conn, "jobs")
        proxy.cut()  # the failure: every connection of the process is gone
        conn.collect()  # kombu's clean-up: the row stays with the message
        del dropped
        gc.collect()  # freed: its release is handed over
        yield again
    finally:
        for each in (again, conn):
            with suppress(Exception):  # a close failing is what a test below asserts against
                each.release()


@pytest.mark.databases("postgresql", "mysql")  # SQLite has no row locks
def test_a_handed_over_row_lock_release_whose_connection_was_lost_does_not_fail_a_round(
        db_url: str, table_prefix: str, proxy: Proxy) -> None:
    """The release is the rollback and close of the row's own connection, which fails on
    the lost connection (the row is free anyway: its session ended). Run at the start of
    the consumer's next round, that failure must not be raised out of the round (in a
    Celery worker a connection error: another reconnect, per dropped message), as it
    was not while the finalizer ran the release itself."""
    with a_row_lock_release_handed_over_after_its_connection_was_lost(
            db_url, table_prefix, proxy) as again:
        got = get_within(again, "jobs")
        assert got.payload["n"] in ("dropped", "next")


@pytest.mark.databases("postgresql", "mysql")  # SQLite has no row locks
def test_a_handed_over_row_lock_release_whose_connection_was_lost_does_not_fail_a_close(
        db_url: str, table_prefix: str, proxy: Proxy) -> None:
    """The same release run by a flush: closing the broker (a worker's shutdown, the
    process's exit) must neither raise nor stop half way (its wake-up, throughput
    thread and engine left open)."""
    with a_row_lock_release_handed_over_after_its_connection_was_lost(
            db_url, table_prefix, proxy) as again:
        broker = broker_of(again)
        broker.close()


def test_a_handed_over_release_runs_while_the_consumers_prefetch_is_full(
        connect: Connect, engine: Engine, table_prefix: str) -> None:
    """After the reconnect the consumer's prefetch slots are all taken (prefetch 1, a
    long task): kombu's rounds do not reach ``_get`` (the channel cannot consume), so a
    dropped message's handed-over release waits for a free slot; its row stays held
    (the keeper extends it) for as long as the task runs, where the finalizer released
    it at once before."""
    conn = connect()
    publish(conn, "jobs", {"n": "dropped"})
    publish(conn, "jobs", {"n": "long task"})
    dropped = get_within(conn, "jobs")
    conn.collect()
    again = connect()
    received: list[Message] = []
    channel = again.channel()
    consumer = Consumer(channel, [Queue("jobs")], callbacks=[
        lambda body, message: received.append(message)], prefetch_count=1)
    consumer.consume()

    def drain() -> None:
        with suppress(TimeoutError):
            again.drain_events(timeout=0.1)

    wait_for(lambda: drain() or received, "the long task's message")
    del dropped
    gc.collect()  # freed: its release is handed over
    table = table_of("jobs", table_prefix)

    def released() -> bool:
        drain()  # the consumer's rounds go on
        return rows(engine, table)[0]["locked_until"] is None

    try:
        wait_for(released, "the dropped message's row to go back", timeout=5)
    finally:
        received[0].ack()


@pytest.mark.databases("sqlite")  # one database is enough: the child's own state
def test_a_forked_child_does_not_run_what_its_parent_handed_over(
        connect: Connect, tmp_path: Path) -> None:
    """Work handed over in the parent, not run yet, when a child is forked (a prefork
    pool process): the child's rounds and flushes never run it (the keeper begins again
    in the child, with a hand-over of its own: the parent's releases are the parent's
    rows); the parent runs it (its flush, or its keeper's thread first)."""
    conn = connect()
    publish(conn, "jobs", {"n": "a held row: the keeper's threads run"})
    keeper = broker_of(conn).keeper
    held = get_within(conn, "jobs")
    ran = tmp_path / "ran"

    def record_the_process() -> None:
        with ran.open("a") as out:
            out.write(f"{os.getpid()}\n")

    keeper.handed_over.put(record_the_process)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            keeper.handed_over.run()
            code = 0 if keeper.flush(timeout=5) else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert keeper.flush(timeout=10)
    assert ran.read_text().split() == [str(os.getpid())]
    held.ack()


#: a short lease: the keeper extends what it holds every third of it
SHORT_LEASE = 1.5


def test_a_handed_over_release_runs_in_a_process_that_no_longer_consumes(
        connect: Connect, engine: Engine, table_prefix: str) -> None:
    """After the reconnect the process does not consume again (or not for a long time:
    its consumer was cancelled, it only publishes now): the dropped message's release,
    handed over, is never run, and the keeper extends its row for as long as the process
    lives, where the finalizer released it at once before. Bounded here by three
    leases (the keeper thread wakes every third of one)."""
    conn = connect(visibility_timeout=SHORT_LEASE)
    publish(conn, "jobs", {"n": "dropped"})
    dropped = get_within(conn, "jobs")
    conn.collect()
    del dropped
    gc.collect()  # freed: its release is handed over
    table = table_of("jobs", table_prefix)
    wait_for(lambda: rows(engine, table)[0]["locked_until"] is None,
             "the dropped message's row to go back", timeout=3 * SHORT_LEASE)
