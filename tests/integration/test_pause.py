"""Paused queues: claims stop at the consumer's next wake-up (or within
``pause_check_interval`` without one), publishes go on and wait, resume wakes the
consumers; names compare exactly; bad names are refused before anything is written."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from kombu import Connection, Consumer, Message, Queue

from kombu_sqlinbox.errors import ConfigurationError, SchemaMismatch
from kombu_sqlinbox.operations import Operations
from kombu_sqlinbox.options import parse_options

from .conftest import Connect
from .support import broker_of, get, get_within, publish, wait_for


@pytest.fixture
def ops(broker_url: str, table_prefix: str) -> Iterator[Operations]:
    made = Operations(broker_url, parse_options({"table_prefix": table_prefix}),
                      ["jobs", "Jobs"])
    yield made
    made.close()


def consuming(conn: Connection, queue: str, got: list[Any]) -> Consumer:
    """A consumer of ``queue`` that acks and keeps each body, having waited once (its
    wake-ups are set up then: the LISTEN connection, the same-host socket)."""
    def keep(body: Any, message: Message) -> None:
        got.append(body)
        message.ack()

    consumer = Consumer(conn, [Queue(queue, routing_key=queue)], callbacks=[keep])
    consumer.consume()
    broker_of(conn).wakeup.sources()
    return consumer


def drain(conn: Connection, seconds: float) -> None:
    """Drain events for ``seconds`` (what arrives meanwhile is delivered)."""
    until = time.monotonic() + seconds
    while (left := until - time.monotonic()) > 0:
        try:
            conn.drain_events(timeout=left)
        except TimeoutError:
            return


def test_a_pause_reaches_a_consumer_by_its_wake_up_and_resume_drains_the_backlog(
        connect: Connect, ops: Operations) -> None:
    """With ``pause_check_interval`` at a minute, only the wake-up (NOTIFY, the same-host
    signal) can tell the consumer in time."""
    conn = connect(pause_check_interval=60.0)
    got: list[Any] = []
    with consuming(conn, "jobs", got):
        publish(conn, "jobs", {"n": 1})
        wait_for(lambda: conn.drain_events(timeout=0.2) or got, "the first message")
        kept, made = ops.pause("jobs", reason="incident 42", by="alice")
        assert made and (kept.queue, kept.reason, kept.by) == ("jobs", "incident 42", "alice")
        pauses = broker_of(conn).pauses
        wait_for(lambda: pauses.paused("jobs"), "the consumer told of the pause", 5.0)
        for n in (2, 3):
            publish(conn, "jobs", {"n": n})  # publishes go on
        drain(conn, 1.5)
        assert got == [{"n": 1}]
        assert ops.figures()[0].ready == 2
        assert ops.resume("jobs")
        wait_for(lambda: conn.drain_events(timeout=0.2) or len(got) == 3, "the backlog",
                 10.0)
    assert sorted(body["n"] for body in got) == [1, 2, 3]


def test_without_a_wake_up_a_pause_counts_within_the_check_interval(
        connect: Connect, ops: Operations) -> None:
    """No NOTIFY, no same-host signal (``notify`` off): the consumer reads the paused
    queues again each ``pause_check_interval``."""
    conn = connect(notify=False, pause_check_interval=0.5)
    publish(conn, "jobs", {"n": 1})
    get_within(conn, "jobs").ack()
    ops.pause("jobs")
    paused_at = time.monotonic()
    publish(conn, "jobs", {"n": 2})
    while get(conn, "jobs") is not None:  # claimed before it was read again: bounded
        assert time.monotonic() - paused_at < 0.5 + 0.5, "claims went on past the bound"
    assert time.monotonic() - paused_at < 0.5 + 0.5
    time.sleep(0.6)  # a whole interval more: still nothing
    assert get(conn, "jobs") is None


def test_queue_names_compare_exactly(connect: Connect, ops: Operations) -> None:
    """Pausing ``Jobs`` leaves ``jobs`` alone (MariaDB's collations would not)."""
    conn = connect(pause_check_interval=0.1)
    for name in ("jobs", "Jobs"):
        publish(conn, name, {"queue": name})
    ops.pause("Jobs")
    assert [found.queue for found in ops.paused()] == ["Jobs"]
    assert get_within(conn, "jobs").payload == {"queue": "jobs"}
    assert get(conn, "Jobs") is None
    assert not ops.resume("jobs")
    assert ops.resume("Jobs")
    assert get_within(conn, "Jobs").payload == {"queue": "Jobs"}


def test_a_second_pause_keeps_the_first_record(ops: Operations) -> None:
    first, made = ops.pause("jobs", reason="first", by="alice")
    again, made_again = ops.pause("jobs", reason="second", by="bob")
    assert made and not made_again
    assert again == first
    assert [f.paused for f in ops.figures() if f.queue == "jobs"] == [first]


def test_bad_names_are_refused_before_anything_is_written(
        connect: Connect, ops: Operations) -> None:
    with pytest.raises(ConfigurationError, match="did you mean 'jobs'"):
        ops.pause("jbos")
    with pytest.raises(ConfigurationError, match="NUL"):
        ops.pause("jobs\x00; DROP TABLE x")
    with pytest.raises(ConfigurationError, match="at most 500"):
        ops.pause("jobs", reason="x" * 501)
    connect().default_channel.queue_declare("replies", durable=False, auto_delete=True)
    with pytest.raises(ConfigurationError, match="transient"):
        ops.pause("replies", force=True)
    assert ops.paused() == []
    kept, _ = ops.pause("later", force=True)  # a queue not declared yet
    assert [found.queue for found in ops.paused()] == [kept.queue] == ["later"]


def test_without_the_table_and_create_tables_off_nothing_is_paused(
        connect: Connect, broker_url: str, table_prefix: str) -> None:
    """An installation that predates pausing and creates no tables: consumers claim as
    before; a pause says which DDL to run."""
    conn = connect(create_tables=True)
    publish(conn, "jobs", {"n": 1})
    strict = connect(create_tables=False, pause_check_interval=0.1)
    assert get_within(strict, "jobs").payload == {"n": 1}
    ops = Operations(broker_url, parse_options({"table_prefix": table_prefix,
                                                "create_tables": False}), ["jobs"])
    try:
        with pytest.raises(SchemaMismatch, match="CREATE TABLE IF NOT EXISTS"):
            ops.pause("jobs")
        assert ops.paused() == []
    finally:
        ops.close()
