"""Partition keys in one consumer: a key with a backlog and a long task in work holds back
only its own rows; the other keys keep the free prefetch slots busy."""

from __future__ import annotations

import contextlib
import time
from typing import Any

import pytest
from kombu import Consumer, Message, Queue
from sqlalchemy import text

from tests.ordering.apps.common import by_group, check_serial_in_order
from tests.ordering.conftest import Ordering, publish, wait_for_count

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


#: a celery worker's prefetch: concurrency 2 x Celery's default multiplier 4
WORKER_PREFETCH = 2 * 4
LONG_TASK = 3.0


@pytest.mark.slow
def test_a_celery_worker_runs_other_keys_while_one_key_has_a_long_task_and_a_backlog(
        ordering: Ordering) -> None:
    """The busy key's backlog is longer than the worker's prefetch; its first task is long.
    The other keys' tasks all finish while that task still runs."""
    app = ordering.app("jobs", "keyed")
    backlog = WORKER_PREFETCH + 4
    with app.producer_or_acquire() as producer:
        for seq in range(backlog):
            app.send_task("ord.run_for", args=("busy", seq, LONG_TASK if seq == 0 else 0.01),
                          headers={"partition_key": "busy"}, producer=producer)
        for n in range(OTHERS):
            app.send_task("ord.run_for", args=(f"k{n}", 0, 0.01),
                          headers={"partition_key": f"k{n}"}, producer=producer)
    workers = ordering.workers(["w0"], "jobs", "keyed", pool="threads", concurrency=2)
    wait_for_count(ordering.log.done, backlog + OTHERS, "rows done", workers, limit=60)

    groups = by_group(ordering.log.entries())
    long_task = groups["busy"][0]
    late = [e for grp, entries in groups.items() if grp != "busy" for e in entries
            if e.ended is None or e.ended > (long_task.ended or 0)]
    assert not late, f"{len(late)} rows of other keys waited for the busy key's long task"
    check_serial_in_order(groups["busy"], {"busy": backlog})
