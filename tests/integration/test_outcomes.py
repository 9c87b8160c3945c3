"""Outcomes: ack, requeue in place, reject, dead letters, max_attempts."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest
from kombu import Consumer, Queue
from kombu.message import Message
from sqlalchemy import text
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError

from kombu_sqlinbox.wakeups import Wakeup

from .conftest import Connect
from .support import (
    DEAD_LETTERS,
    broker_of,
    death,
    get,
    get_within,
    publish,
    quoted,
    rows,
    settled,
    table_of,
    wait_for,
)

#: what a driver returns for a payload, a headers column, a time: every variant
pytestmark = pytest.mark.drivers


def test_ack_deletes_the_row(connect: Connect, engine: Engine, table_prefix: str) -> None:
    conn = connect()
    publish(conn, "jobs", {"n": 1})
    table = table_of("jobs", table_prefix)
    message = get_within(conn, "jobs")
    assert len(rows(engine, table)) == 1
    message.ack()
    settled(conn)
    assert rows(engine, table) == []


def test_requeue_puts_the_row_back_in_place_and_counts_the_attempt(
    connect: Connect, engine: Engine, table_prefix: str,
) -> None:
    conn = connect()
    publish(conn, "jobs", {"n": "first"})
    publish(conn, "jobs", {"n": "second"})
    table = table_of("jobs", table_prefix)
    first = get_within(conn, "jobs")
    assert first.delivery_info["redelivered"] is False
    before = rows(engine, table)[0]
    first.requeue()
    settled(conn)
    after = rows(engine, table)[0]
    assert (after["id"], after["attempt"], after["locked_until"]) == (before["id"], 1, None)
    again = get_within(conn, "jobs")
    assert again.decode() == {"n": "first"}
    assert again.delivery_info["redelivered"] is True
    assert rows(engine, table)[0]["attempt"] == 2
    again.ack()


def test_reject_without_requeue_deletes_the_row(
    connect: Connect, engine: Engine, table_prefix: str,
) -> None:
    conn = connect()
    publish(conn, "jobs", {"n": 1})
    get_within(conn, "jobs").reject(requeue=False)
    settled(conn)
    assert rows(engine, table_of("jobs", table_prefix)) == []


def test_reject_without_requeue_moves_to_the_dead_letter_queue(
    connect: Connect, engine: Engine, table_prefix: str,
) -> None:
    conn = connect(**DEAD_LETTERS)
    publish(conn, "jobs", b"\x00payload\xff", content_type="application/octet-stream",
            content_encoding="binary", headers={"task": "t1"})
    get_within(conn, "jobs").reject(requeue=False)
    assert rows(engine, table_of("jobs", table_prefix)) == []
    parked = get_within(conn, "jobs.dead")
    assert parked.body == b"\x00payload\xff"
    assert parked.headers["task"] == "t1"
    record = death(parked)
    assert record["queue"] == "jobs"
    assert "rejected" in record["reason"]
    assert record["attempts"] == 1


def test_dead_letter_queue_is_an_ordinary_queue(
    connect: Connect, engine: Engine, table_prefix: str,
) -> None:
    conn = connect(**DEAD_LETTERS)
    for n in range(3):
        publish(conn, "jobs", {"n": n})
        get_within(conn, "jobs").reject(requeue=False)
    channel = conn.default_channel
    assert channel.queue_declare("jobs.dead", passive=True).message_count == 3
    parked = [get_within(conn, "jobs.dead") for _ in range(3)]
    assert [message.decode() for message in parked] == [{"n": 0}, {"n": 1}, {"n": 2}]
    for message in parked:
        message.ack()
    settled(conn)
    assert rows(engine, table_of("jobs.dead", table_prefix)) == []


def test_max_attempts_moves_a_requeued_row_to_the_dead_letter_queue(
    connect: Connect, engine: Engine, table_prefix: str,
) -> None:
    conn = connect(queues={"jobs": {"dead_letter_queue": "jobs.dead", "max_attempts": 3}})
    publish(conn, "jobs", {"poison": True})
    for _ in range(3):
        get_within(conn, "jobs").requeue()
        settled(conn)
    assert get(conn, "jobs") is None
    assert rows(engine, table_of("jobs", table_prefix)) == []
    parked = get_within(conn, "jobs.dead")
    assert parked.decode() == {"poison": True}
    record = death(parked)
    assert record["queue"] == "jobs"
    assert "max_attempts" in record["reason"]
    # three deliveries, then the fourth claim found the row over the limit
    assert record["attempts"] == 4


def test_max_attempts_counts_expired_leases(
    connect: Connect, engine: Engine, table_prefix: str,
) -> None:
    """A holder that stops extending (a hung or dead worker) loses the row; the next claim
    past max_attempts parks it instead of delivering it again."""
    queues = {"jobs": {"dead_letter_queue": "jobs.dead", "max_attempts": 1,
                       "visibility_timeout": 1}}
    stalled = connect(queues=queues)
    publish(stalled, "jobs", {"n": 1})
    assert get_within(stalled, "jobs").decode() == {"n": 1}
    broker_of(stalled).keeper.stop()
    # a second broker (other options): its own keeper, as in another process
    other = connect(queues=queues, polling_interval=0.06)
    table = table_of("jobs", table_prefix)

    def parked() -> bool:
        assert get(other, "jobs") is None
        return rows(engine, table) == []

    wait_for(parked, "the expired row to move to the dead-letter queue")
    dead = rows(engine, table_of("jobs.dead", table_prefix))
    assert len(dead) == 1
    record = json.loads(dead[0]["headers"])["headers"]["x-sqlinbox-death"]
    assert record["attempts"] == 2
    assert "max_attempts" in record["reason"]


def test_reject_after_the_lease_lapsed_writes_no_dead_letter(
    connect: Connect, engine: Engine, table_prefix: str,
) -> None:
    """A holder whose row was claimed again elsewhere cannot park it: the fenced delete
    removes nothing, so no dead-letter copy is written and the new holder keeps the row."""
    queues = {"jobs": {"dead_letter_queue": "jobs.dead", "visibility_timeout": 1}}
    stalled = connect(queues=queues)
    publish(stalled, "jobs", {"n": 1})
    first = get_within(stalled, "jobs")
    broker_of(stalled).keeper.stop()
    # a second broker (other options): its own keeper, as in another process
    other = connect(queues=queues, polling_interval=0.06)
    second = get_within(other, "jobs", timeout=10)
    assert second.delivery_info["redelivered"] is True
    first.reject(requeue=False)
    table = table_of("jobs", table_prefix)
    assert [row["attempt"] for row in rows(engine, table)] == [2]
    assert rows(engine, table_of("jobs.dead", table_prefix)) == []
    second.ack()
    settled(other)
    assert rows(engine, table) == []


def test_no_ack_consumer_completes_its_rows_on_delivery(
    connect: Connect, engine: Engine, table_prefix: str,
) -> None:
    """``no_ack`` (Celery's pidbox and event receivers) means settled when delivered: the
    rows leave the table and the keeper holds nothing to extend or deliver again."""
    conn = connect()
    for n in range(3):
        publish(conn, "jobs", {"n": n})
    received: list[Message] = []
    with Consumer(conn.default_channel, [Queue("jobs")], no_ack=True, accept=["json"],
                  callbacks=[lambda body, message: received.append(message)]):
        while len(received) < 3:
            conn.drain_events(timeout=10)
    assert [message.decode() for message in received] == [{"n": 0}, {"n": 1}, {"n": 2}]
    settled(conn)
    assert rows(engine, table_of("jobs", table_prefix)) == []
    assert broker_of(conn).keeper.held_count() == 0


def test_basic_get_without_ack_completes_its_row_on_delivery(
    connect: Connect, engine: Engine, table_prefix: str,
) -> None:
    conn = connect()
    publish(conn, "jobs", {"n": 1})
    message = wait_for(lambda: conn.default_channel.basic_get("jobs", no_ack=True),
                       "a message on 'jobs'")
    assert message.decode() == {"n": 1}
    settled(conn)
    assert rows(engine, table_of("jobs", table_prefix)) == []
    assert broker_of(conn).keeper.held_count() == 0


def test_reject_whose_dead_letter_move_fails_gives_the_row_back(
    connect: Connect, engine: Engine, table_prefix: str,
) -> None:
    """The dead-letter table is gone: the move fails and says so, and the row goes back
    in place instead of staying held (and extended) for the life of the process."""
    conn = connect(**DEAD_LETTERS)
    publish(conn, "jobs", {"n": 1})
    conn.default_channel.queue_declare("jobs.dead")
    with engine.begin() as ddl:
        ddl.execute(text(f"DROP TABLE {quoted(engine, table_of('jobs.dead', table_prefix))}"))
    with pytest.raises(DBAPIError):
        get_within(conn, "jobs").reject(requeue=False)
    settled(conn)
    assert broker_of(conn).keeper.held_count() == 0
    assert [(row["attempt"], row["locked_until"]) for row in rows(
        engine, table_of("jobs", table_prefix))] == [(1, None)]
    again = get_within(conn, "jobs")
    assert again.delivery_info["redelivered"] is True
    again.ack()


def test_reject_without_requeue_wakes_a_consumer_waiting_for_a_free_slot(
    connect: Connect, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A consumer whose prefetch slots are all taken waits; a reject without requeue (from
    another thread, as an ack may come) frees the slot and must wake it, as an ack does,
    not leave it asleep for its polling interval. ``notify=False``: on PostgreSQL only the
    in-process wake-up can be what wakes it."""
    conn = connect(polling_interval=30, notify=False)
    for n in range(2):
        publish(conn, "jobs", {"n": n})
    received: list[Message] = []
    asleep = threading.Event()
    wait = Wakeup.wait

    def observed_wait(self: Wakeup, timeout: float) -> None:
        asleep.set()
        wait(self, timeout)

    monkeypatch.setattr(Wakeup, "wait", observed_wait)

    def reject_once_asleep() -> None:
        assert asleep.wait(10), "the consumer never went to wait"
        received[0].reject(requeue=False)

    def on_message(body: Any, message: Message) -> None:
        received.append(message)

    with Consumer(conn.default_channel, [Queue("jobs")], callbacks=[on_message],
                  accept=["json"]) as consumer:
        consumer.qos(prefetch_count=1)
        conn.drain_events(timeout=10)
        assert [message.decode() for message in received] == [{"n": 0}]
        asleep.clear()
        rejecter = threading.Thread(target=reject_once_asleep)
        rejecter.start()
        started = time.monotonic()
        conn.drain_events(timeout=10)
        waited = time.monotonic() - started
        rejecter.join(10)
        assert [message.decode() for message in received] == [{"n": 0}, {"n": 1}]
        assert waited < 2, f"the next message came after {waited:.1f}s"
        received[1].ack()
