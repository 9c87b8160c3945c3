"""Partition keys in one consumer: a key with a backlog and a long task in work holds back
only its own rows; the other keys keep the free prefetch slots busy."""

from __future__ import annotations

import contextlib
import time
from typing import Any

from kombu import Consumer, Message, Queue
from sqlalchemy import text

from tests.ordering.conftest import Ordering, publish

PREFETCH = 3
BACKLOG = 8
OTHERS = 6


def drain_until(conn: Any, done: Any, what: str, limit: float = 20.0) -> None:
    deadline = time.monotonic() + limit
    while not done():
        assert time.monotonic() < deadline, f"timed out after {limit:.0f} s waiting for {what}"
        with contextlib.suppress(TimeoutError):
            conn.drain_events(timeout=0.5)


def test_a_backlog_on_one_key_leaves_the_other_keys_running(ordering: Ordering) -> None:
    conn = ordering.connect("jobs", "keyed")
    publish(conn, "jobs", [({"grp": "busy", "seq": n}, {"partition_key": "busy"})
                           for n in range(BACKLOG)])
    publish(conn, "jobs", [({"grp": f"k{n}", "seq": 0}, {"partition_key": f"k{n}"})
                           for n in range(OTHERS)])
    received: list[dict[str, Any]] = []
    in_work: list[Message] = []  # the busy key's long task

    def on_message(body: dict[str, Any], message: Message) -> None:
        received.append(body)
        if body["grp"] == "busy" and not in_work:
            in_work.append(message)
        else:
            message.ack()

    def seen(grp: str) -> list[int]:
        return [body["seq"] for body in received if body["grp"] == grp]

    consumer_conn = ordering.connect("jobs", "keyed")
    with Consumer(consumer_conn.default_channel, [Queue("jobs")], callbacks=[on_message],
                  accept=["json"]) as consumer:
        consumer.qos(prefetch_count=PREFETCH)
        drain_until(consumer_conn, lambda: len(received) == 1 + OTHERS,
                    "the other keys' rows while the busy key's first task is in work")
        assert seen("busy") == [0]
        with ordering.engine.connect() as sql:
            leased = sql.execute(text(
                f"SELECT COUNT(*) FROM {ordering.prefix}keyed_jobs "
                "WHERE pkey = 'busy' AND attempt > 0")).scalar_one()
        assert leased <= PREFETCH, f"{leased} rows of the busy key claimed; its backlog " \
            "must stay in the table while the key is busy"
        in_work[0].ack()  # the long task ends: the key's next rows follow, in order
        drain_until(consumer_conn, lambda: len(received) == BACKLOG + OTHERS,
                    "the rest of the busy key's rows")
    assert seen("busy") == list(range(BACKLOG))
    assert sorted(body["grp"] for body in received if body["grp"] != "busy") == [
        f"k{n}" for n in range(OTHERS)]
