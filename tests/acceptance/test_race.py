"""Four consumer processes race for 20,000 messages: none delivered twice, none lost."""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from kombu import Connection

from kombu_sqlinbox.codec import encode_message
from tests.acceptance.conftest import Acceptance, check_exactly_once
from tests.processes import START_LIMIT, wait_until

QUEUE = "race"
MESSAGES = 20_000
#: how many go through kombu's producer; the rest are inserted in batches the same way
PRODUCED = 2_000
BATCH = 500
PREFETCH = (10, 20, 30, 50)


def insert_batches(conn: Connection, queue: str, numbers: range) -> None:
    """Publish as ``Channel._put`` does, but many rows per INSERT (executemany)."""
    channel = conn.default_channel
    broker = channel.broker
    table = broker.table(queue)
    for start in range(numbers.start, numbers.stop, BATCH):
        params = []
        for n in range(start, min(start + BATCH, numbers.stop)):
            message = channel.prepare_message(
                json.dumps({"n": n}), content_type="application/json", content_encoding="utf-8",
                properties={"delivery_info": {"exchange": "", "routing_key": queue}})
            payload, headers = encode_message(message, table)
            params.append(broker.dialect.insert_params(payload, headers, 0, None))
        broker.run(lambda c, rows=params: broker.dialect.publish(c, table.spec, rows))


def marker(out: Path, what: str) -> Path:
    """The files the consumer and its parent signal each other with (see apps/consumer.py)."""
    return out.with_name(f"{out.name}.{what}")


@pytest.mark.slow
def test_racing_consumers_get_each_message_once(acceptance: Acceptance) -> None:
    acceptance.configure(visibility_timeout=5)
    outs = [acceptance.tmp / f"consumer{i}.json" for i in range(len(PREFETCH))]
    with Connection(acceptance.broker_url, transport_options=acceptance.options) as conn:
        acceptance.declare(QUEUE)  # before the consumers race to create it
        consumers = [
            acceptance.spawn(f"consumer{i}", [
                sys.executable, "-m", "tests.acceptance.apps.consumer", acceptance.broker_url,
                json.dumps(acceptance.options), QUEUE, str(prefetch), str(out)])
            for i, (prefetch, out) in enumerate(zip(PREFETCH, outs, strict=True))
        ]
        wait_until(lambda: all(marker(out, "ready").exists() for out in outs), START_LIMIT,
                   "the consumers to start", alive=consumers)
        began = time.monotonic()
        producer = conn.Producer(serializer="json")
        for n in range(PRODUCED):
            producer.publish({"n": n}, routing_key=QUEUE)
        insert_batches(conn, QUEUE, range(PRODUCED, MESSAGES))
        published = time.monotonic()
        wait_until(lambda: acceptance.rows(QUEUE) == 0, 180,
                   f"{MESSAGES} messages to be consumed and acked", alive=consumers, interval=0.2)
        drained = time.monotonic()
    for out in outs:
        marker(out, "stop").touch()
    for consumer in consumers:
        assert consumer.wait(30) == 0, consumer.tail()

    results = [json.loads(out.read_text()) for out in outs]
    counts = Counter(str(n) for result in results for n in result["received"])
    check_exactly_once(counts, (str(n) for n in range(MESSAGES)))
    print(f"published {MESSAGES} in {published - began:.1f}s, all acked after "
          f"{drained - began:.1f}s; per consumer {[len(r['received']) for r in results]}, "
          f"redelivered {sum(r['redelivered'] for r in results)}")
