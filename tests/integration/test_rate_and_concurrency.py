"""A queue with both a ``rate_limit`` and concurrency limits: processes racing over its
backlog never start more than the rate allows in any span, and never run more rows of a
key at once than its limit, both timed by a ledger outside the broker."""

from __future__ import annotations

import time
from typing import Any

import pytest
from kombu import Message

from bench.ledger import most_at_once
from kombu_sqlinbox.options import parse_rate
from kombu_sqlinbox.rates import Budget

from .conftest import Connect
from .support import consumer_processes, publish
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


def job(body: Any, message: Message) -> tuple[str]:
    """A task running for the seconds its body says, noting its key in the ledger."""
    time.sleep(body["work"])
    return (body["key"],)


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
    with consumer_processes(PROCESSES, broker_url, options, QUEUE, 4, job, WAIT) as ledger:
        runs = [ledger.get(timeout=WAIT) for _ in backlog]
    most = most_at_once(runs)
    assert most["slow"] == 2 and most["fast"] <= 2, most  # reached, never passed
    starts = [start for _, start, _ in runs]
    tokens = Budget.of(parse_rate("rate_limit", RATE)).tokens  # type: ignore[arg-type]
    for span in (1.0, 2.0):
        assert most_in_any(starts, span) <= 20 * span + 2 * tokens, (span, sorted(starts))
    assert max(starts) - min(starts) >= (len(backlog) - 20) / 20
