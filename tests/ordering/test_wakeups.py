"""Wake-ups: an idle consumer starts on a new row long before its polling interval ends.

On PostgreSQL a publish NOTIFYs the table's channel in its own transaction and an
idle consumer in another process, waiting in ``select()`` on its LISTEN socket,
wakes at once. With ``notify=False`` (and on MariaDB and SQLite) only the
polling interval finds the row -- except in the publishing process itself,
whose consumers are poked in-process. Latency figures are in bench/ordering.py;
these tests only bound them.
"""

from __future__ import annotations

import json
import threading
import time
from functools import partial
from typing import Any

import pytest
from kombu import Consumer, Queue

from tests.ordering.conftest import Ordering, publish
from tests.processes import wait_until

MESSAGES = 3


def arrivals(ordering: Ordering, name: str) -> list[float]:
    """How long after publishing each message reached the consumer program, in order."""
    path = ordering.marker(name, "lat")
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line)["delay"] for line in lines]


def arrived(ordering: Ordering, name: str, count: int) -> bool:
    return len(arrivals(ordering, name)) >= count


def delays_to_another_process(ordering: Ordering, polling_interval: float,
                              **options: Any) -> list[float]:
    """Publish one message at a time to an idle consumer process; each after the last
    arrived, so each one finds the consumer waiting."""
    options["polling_interval"] = polling_interval
    conn = ordering.connect("jobs", "plain", **options)
    conn.default_channel.queue_declare("jobs")
    consumer = ordering.consumer("idle", "jobs", "plain", mode="latency", options=options,
                                 drain_timeout=60, expect=MESSAGES)
    for i in range(MESSAGES):
        publish(conn, "jobs", [({"i": i, "sent": time.time()}, {})])
        wait_until(partial(arrived, ordering, "idle", i + 1), polling_interval + 10,
                   f"message {i} to arrive", alive=[consumer], interval=0.01)
    return arrivals(ordering, "idle")


@pytest.mark.slow
@pytest.mark.parametrize("database", ["postgresql"])
def test_notify_wakes_an_idle_consumer_in_another_process(ordering: Ordering) -> None:
    delays = delays_to_another_process(ordering, polling_interval=5)
    assert max(delays) < 0.2, f"publish -> delivery took {delays} s with NOTIFY"


@pytest.mark.slow
@pytest.mark.parametrize("database", ["postgresql"])
def test_without_notify_another_process_waits_for_its_polling_interval(
        ordering: Ordering) -> None:
    interval = 2.0
    # polling_interval_min too: no quick look right after a delivery finds the next row
    delays = delays_to_another_process(ordering, polling_interval=interval, notify=False,
                                       polling_interval_min=interval)
    assert all(delay < interval + 1 for delay in delays), delays
    # a publish may land before the consumer's own next claim right after a delivery (no
    # wake-up needed then); the others wait for the polling interval, since nothing wakes it
    waited = [delay for delay in delays if delay > interval / 2]
    assert len(waited) >= len(delays) - 1, delays


def test_a_publish_wakes_a_consumer_of_the_same_process(ordering: Ordering) -> None:
    """Publisher and consumer share the process's broker: the publish pokes the wait.
    ``notify=False`` so that on PostgreSQL only the poke can be what wakes it."""
    options = {"polling_interval": 5, "notify": False}
    consumer_conn = ordering.connect("jobs", "plain", **options)
    publisher = ordering.connect("jobs", "plain", **options)
    publisher.default_channel.queue_declare("jobs")
    delays: list[float] = []
    arrived = threading.Event()

    def on_message(body: dict[str, Any], message: Any) -> None:
        delays.append(time.time() - body["sent"])
        message.ack()
        arrived.set()

    def publish_while_idle() -> None:
        for i in range(MESSAGES):
            time.sleep(0.3)  # the consumer's idle gap: it is waiting by now
            publish(publisher, "jobs", [({"i": i, "sent": time.time()}, {})])
            arrived.wait(10)
            arrived.clear()

    with Consumer(consumer_conn.default_channel, [Queue("jobs")], callbacks=[on_message],
                  accept=["json"]):
        thread = threading.Thread(target=publish_while_idle)
        thread.start()
        deadline = time.monotonic() + 30
        while len(delays) < MESSAGES and time.monotonic() < deadline:
            consumer_conn.drain_events(timeout=10)
        thread.join(10)
    assert len(delays) == MESSAGES and max(delays) < 0.5, delays
