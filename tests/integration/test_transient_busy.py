"""A consumer whose task queue keeps it busy claims a transient queue (a worker's
remote-control queue) as soon as a NOTIFY says a message came for it, not a polling
interval after it last found that queue empty."""

from __future__ import annotations

from typing import Any

import pytest
from kombu import Consumer, Queue

from tests.integration.conftest import Connect

#: work rows waiting when the control message is published: the consumer stays busy
#: (each claim finds rows) for all of them
BACKLOG = 300


@pytest.mark.parametrize("database", ["postgresql"])
def test_a_busy_consumer_takes_a_notified_transient_message_before_its_backlog(
        connect: Connect) -> None:
    # a polling interval far longer than the test: only the NOTIFY can bring the message
    consumer_conn = connect(polling_interval=60.0, polling_interval_min=60.0)
    publisher = connect()  # another broker: its publish reaches the consumer by NOTIFY alone
    work, control = Queue("work"), Queue("control", durable=False, auto_delete=True)
    channel = consumer_conn.default_channel
    channel.basic_qos(0, 1, False)  # one delivery at a time: each a claim of its own
    got: list[str] = []

    def callback(body: Any, message: Any) -> None:
        got.append(body[0])
        message.ack()

    with Consumer(channel, [work, control], accept=["json"], callbacks=[callback]):
        producer = publisher.Producer(serializer="json")
        for n in range(BACKLOG + 1):
            producer.publish([f"w{n}"], routing_key="work", declare=[work] if n == 0 else [])
        consumer_conn.drain_events(timeout=10)  # the control queue found empty, then busy
        consumer_conn.drain_events(timeout=10)
        producer.publish(["control"], routing_key="control")
        for _ in range(BACKLOG + 1):  # each drain delivers one message
            consumer_conn.drain_events(timeout=10)
            if "control" in got:
                break
    assert "control" in got, got[-3:]
    # before, it came once the backlog ran out (the consumer then found no work rows)
    assert len(got) - 1 < BACKLOG, f"{len(got) - 1} work messages came before it"
