"""An auto-delete transient queue whose last consumer here goes (the reply queue of every
``app.control.ping``): gone for this process at once, its rows deleted by the renewal
thread, off the cancelling call's way; a failed delete is tried again, and a queue
declared again meanwhile keeps its rows. On PostgreSQL its NOTIFY channel is dropped
from the LISTEN session."""

from __future__ import annotations

import contextlib
import logging
import socket
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from kombu import Connection, Exchange, Queue
from sqlalchemy import text
from sqlalchemy.engine import Engine

from .conftest import Connect
from .support import broker_of, quoted, wait_for

REPLIES = Exchange("replies", type="direct", durable=False)


def replies(name: str) -> Queue:
    return Queue(name, REPLIES, routing_key=name, durable=False, auto_delete=True)


def count(engine: Engine, prefix: str, table: str) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text(f"SELECT COUNT(*) FROM {quoted(engine, prefix + table)}"))
                   .scalar_one())


@contextmanager
def bindings_away(engine: Engine, prefix: str) -> Iterator[None]:
    """The bindings table renamed for the block: every delete of a queue fails."""
    name, away = (quoted(engine, prefix + suffix) for suffix in ("bindings", "bindings_away"))
    with engine.begin() as conn:
        conn.execute(text(f"ALTER TABLE {name} RENAME TO {away}"))
    try:
        yield
    finally:
        with engine.begin() as conn:
            conn.execute(text(f"ALTER TABLE {away} RENAME TO {name}"))


def consume_once(conn: Connection, queue: Queue) -> None:
    """Consume ``queue`` (declared a moment ago: no write) and cancel: the cancel of its
    last consumer deletes it."""
    with conn.Consumer([queue], callbacks=[lambda body, message: None]):
        pass


@contextmanager
def delete_failed(conn: Connection, engine: Engine, prefix: str,
                  caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """Queue ``r1`` deleted while every delete fails: in the block, the renewal thread's
    round has failed, and waits to try again; deletes fail until the block ends."""
    replies("r1")(conn.default_channel).declare()
    with (caplog.at_level(logging.WARNING, logger="kombu_sqlinbox.renewal"),
          bindings_away(engine, prefix)):
        consume_once(conn, replies("r1"))
        wait_for(lambda: "deleting auto-deleted queues" in caplog.text, "the failed delete")
        yield


def test_a_failed_delete_is_tried_again_until_it_lands(
    connect: Connect, engine: Engine, table_prefix: str, caplog: pytest.LogCaptureFixture,
) -> None:
    with delete_failed(connect(), engine, table_prefix, caplog):
        assert count(engine, table_prefix, "queues") == 1
    wait_for(lambda: count(engine, table_prefix, "queues") == 0, "the delete tried again")
    assert count(engine, table_prefix, "bindings") == 0


def test_a_queue_declared_again_before_its_delete_keeps_its_rows(
    connect: Connect, engine: Engine, table_prefix: str, caplog: pytest.LogCaptureFixture,
) -> None:
    """Two queues left to the renewal thread while their deletes fail; one is declared
    again, and the round that deletes the other leaves it whole."""
    conn = connect()
    for name in ("r1", "r2"):
        replies(name)(conn.default_channel).declare()
    with caplog.at_level(logging.WARNING, logger="kombu_sqlinbox.renewal"):
        with bindings_away(engine, table_prefix):
            consume_once(conn, replies("r1"))
            consume_once(conn, replies("r2"))
            wait_for(lambda: "deleting auto-deleted queues" in caplog.text, "the failed delete")
        replies("r1")(conn.default_channel).declare()
    wait_for(lambda: count(engine, table_prefix, "queues") == 1, "the other queue's delete")
    assert count(engine, table_prefix, "bindings") == 1
    conn.Producer().publish({"n": 1}, exchange=REPLIES, routing_key="r1")
    message = wait_for(lambda: conn.default_channel.basic_get("r1"), "the message")
    assert message.payload == {"n": 1}


@pytest.mark.databases("postgresql")
def test_the_listen_session_drops_the_channels_of_deleted_queues(connect: Connect) -> None:
    """Five reply queues, one after another, each consumed until a claim: the session
    UNLISTENs a deleted queue's channel with the next channel it adds, so it listens on
    the last alone, not on every reply queue since it connected."""
    conn = connect()
    for n in range(5):
        queue = replies(f"r{n}")
        queue(conn.default_channel).declare()
        with conn.Consumer([queue], callbacks=[lambda body, message: None]), \
                contextlib.suppress(socket.timeout, TimeoutError):
            conn.drain_events(timeout=0.05)  # a claim: the LISTEN session is made
    cursor = broker_of(conn).wakeup._listener.cursor()
    cursor.execute("SELECT pg_listening_channels()")
    assert len(cursor.fetchall()) == 1


def test_deletes_left_to_the_renewal_thread_are_done_as_the_broker_closes(
    connect: Connect, engine: Engine, table_prefix: str, caplog: pytest.LogCaptureFixture,
) -> None:
    """A process that exits right after its last ping (``celery inspect``) leaves no rows
    of its reply queue: the close deletes what the thread has not (here: it waits to try
    again after a failed round)."""
    with delete_failed(conn := connect(), engine, table_prefix, caplog):
        pass
    broker_of(conn).close()
    assert count(engine, table_prefix, "queues") == 0
    assert count(engine, table_prefix, "bindings") == 0


def test_a_delete_that_fails_as_the_broker_closes_is_logged_not_raised(
    connect: Connect, engine: Engine, table_prefix: str, caplog: pytest.LogCaptureFixture,
) -> None:
    """The queue is left to expire, as a crash leaves it."""
    with delete_failed(conn := connect(), engine, table_prefix, caplog):
        broker_of(conn).close()
    assert "left to expire" in caplog.text
    assert count(engine, table_prefix, "queues") == 1
