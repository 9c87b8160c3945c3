"""A queue with both a ``rate_limit`` and concurrency limits: processes racing over its
backlog never start more than the rate allows in any span, and never run more rows of a
key at once than its limit, both timed by a ledger outside the broker."""

from __future__ import annotations

import contextlib
import multiprocessing
import time
from multiprocessing.synchronize import Event
from typing import Any

import pytest
from kombu import Connection, Consumer, Message, Queue

from bench.ledger import most_at_once
from kombu_sqlinbox.options import parse_rate
from kombu_sqlinbox.rates import Budget

from .conftest import Connect
from .support import publish
from .test_rate_limits import most_in_any

QUEUE = "both"
PROCESSES = 4
RATE = "20/s"
#: per key: how many rows and how long each runs (seconds). "slow" rows alone would run
#: at 2 / 0.3 s, under the rate (its concurrency limit binds); with the "fast" ones the
#: rate binds
KEYS = {"slow": (30, 0.3), "fast": (60, 0.02)}
LIMITS = {"*": 2}
#: the longest wait for a child or a run
WAIT = 60.0


def worker(broker_url: str, options: dict[str, Any], ready: Event, stop: Event,
           ledger: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    """Consume ``QUEUE`` until ``stop``; each message runs for the seconds its body says,
    noting its key, start and end in the ledger, then is acknowledged."""
    with Connection(broker_url, transport_options=options) as conn:
        def run(body: Any, message: Message) -> None:
            start = time.monotonic()
            time.sleep(body["work"])
            ledger.put((body["key"], start, time.monotonic()))
            message.ack()

        conn.default_channel.queue_declare(QUEUE)
        with Consumer(conn, [Queue(QUEUE, routing_key=QUEUE)], callbacks=[run],
                      prefetch_count=4):
            ready.set()
            while not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    conn.drain_events(timeout=0.2)


@pytest.mark.timeout(240)
def test_racing_processes_keep_the_rate_and_the_concurrency_limits_at_once(
        connect: Connect, broker_url: str, table_prefix: str) -> None:
    queue_options = {"rate_limit": RATE, "concurrency_limits": LIMITS}
    options = {"table_prefix": table_prefix, "polling_interval": 0.05,
               "queues": {QUEUE: queue_options}}
    conn = connect(queues={QUEUE: queue_options})
    backlog = [(key, work) for key, (count, work) in KEYS.items() for _ in range(count)]
    backlog = backlog[::2] + backlog[1::2]  # the keys interleaved
    for key, work in backlog:
        publish(conn, QUEUE, {"key": key, "work": work}, limit_key=key)
    context = multiprocessing.get_context("spawn")
    stop, ledger = context.Event(), context.Queue()
    readies = [context.Event() for _ in range(PROCESSES)]
    children = [context.Process(target=worker, args=(broker_url, options, ready, stop, ledger))
                for ready in readies]
    for child in children:
        child.start()
    try:
        runs = [ledger.get(timeout=WAIT) for _ in backlog]
    finally:
        stop.set()
        for child in children:
            child.join(WAIT)
            if child.is_alive():
                child.kill()
    most = most_at_once(runs)
    assert most["slow"] == 2 and most["fast"] <= 2, most  # reached, never passed
    starts = [start for _, start, _ in runs]
    tokens = Budget.of(parse_rate("rate_limit", RATE)).tokens  # type: ignore[arg-type]
    for span in (1.0, 2.0):
        assert most_in_any(starts, span) <= 20 * span + 2 * tokens, (span, sorted(starts))
    assert max(starts) - min(starts) >= (len(backlog) - 20) / 20
    assert all(child.exitcode == 0 for child in children)
