"""Two real prefork workers on one rate-limited queue: together they start no more tasks
per second than its ``rate_limit`` (measured by the tasks' own start records, outside the
broker), where Celery's own ``rate_limit`` would allow each of them that many."""

from __future__ import annotations

import socket
import time

import pytest

from kombu_sqlinbox.options import parse_options
from kombu_sqlinbox.rates import Budget
from tests.acceptance.conftest import Acceptance, check_exactly_once
from tests.acceptance.test_control_latency import REPLY_LIMIT
from tests.integration.test_rate_limits import most_in_any
from tests.processes import wait_until

RATE = "20/s"
BACKLOG = [f"r{n}" for n in range(100)]


@pytest.mark.parametrize("event_loop", [False, True], ids=["blocking", "event-loop"])
def test_two_workers_together_start_no_more_than_the_rate_limit(
        acceptance: Acceptance, event_loop: bool) -> None:
    """In Celery's blocking loop and in its event loop (whose timer waits out a spent
    window as the blocking loop's wait does)."""
    acceptance.configure(event_loop=event_loop, queues={"celery": {"rate_limit": RATE}})
    workers = acceptance.workers(["w1", "w2"], "prefork", 2)
    acceptance.send("acc.run", BACKLOG)
    wait_until(lambda: sum(acceptance.runs.done().values()) >= len(BACKLOG), 60,
               "the backlog to run", alive=workers)
    check_exactly_once(acceptance.runs.starts(), BACKLOG)
    times = [record["at"] for record in acceptance.runs.records()]
    limit = parse_options({"rate_limit": RATE}).defaults.rate_limit
    assert limit is not None
    tokens = Budget.of(limit).tokens
    for span in (1.0, 2.0):
        assert most_in_any(times, span) <= 20 * span + 2 * tokens, (span, sorted(times))
    assert max(times) - min(times) >= (len(BACKLOG) - 20) / 20


@pytest.mark.parametrize("event_loop", [False, True], ids=["blocking", "event-loop"])
def test_a_tiny_rate_limit_for_every_queue_leaves_remote_control_prompt(
        acceptance: Acceptance, event_loop: bool) -> None:
    """``rate_limit="1/h"`` as every queue's default: the task queue's window (one token
    an hour, a window the test cannot outlast) is spent by its first claim, yet the
    worker's remote-control queue and the caller's reply queue (transient: never
    limited) answer a ``ping`` as promptly as
    without a limit, idle and while the backlog waits for its windows; a wake-up brings
    the answer, not the polling interval (10 s here) the spent window stretches the idle
    wait to."""
    acceptance.configure(event_loop=event_loop, rate_limit="1/h", polling_interval=10.0)
    worker = acceptance.worker("prefork", 2, name="w1")
    node = f"w1@{socket.gethostname()}"

    def ping() -> float:
        started = time.monotonic()
        replies = acceptance.app.control.ping(destination=[node], timeout=5.0)
        assert replies == [{node: {"ok": "pong"}}], replies
        return time.monotonic() - started

    ping()  # the caller's reply queue exists from here on
    idle = [ping() for _ in range(3)]
    acceptance.send("acc.run", [f"t{n}" for n in range(5)])
    wait_until(lambda: acceptance.runs.starts(), 30, "the first task", alive=[worker])
    spent = [ping() for _ in range(5)]
    assert sum(acceptance.runs.starts().values()) == 1  # one an hour: the rest wait
    assert max(idle + spent) < REPLY_LIMIT, (idle, spent)
