"""Two real workers and a pause: no task starts while the queue is paused (measured by the
tasks' own start records, outside the broker), the task in work when it was paused
finishes, remote control still answers, a worker started while paused stays idle, and
resume drains the backlog."""

from __future__ import annotations

import socket
import time
from collections import Counter
from collections.abc import Iterator

import pytest

from kombu_sqlinbox.operations import Operations
from kombu_sqlinbox.options import parse_options
from tests.acceptance.conftest import Acceptance, check_exactly_once
from tests.processes import wait_until

HOST = socket.gethostname()
#: the transport's pause_check_interval in this test: the bound a missed wake-up adds
CHECK_INTERVAL = 1.0
#: how long the test watches for a start that must not come
WATCH = 3.0
BACKLOG = [f"p{n}" for n in range(8)]


@pytest.fixture
def ops(acceptance: Acceptance) -> Iterator[Operations]:
    made = Operations(acceptance.broker_url, parse_options(acceptance.options), ["celery"])
    yield made
    made.close()


def test_a_paused_queue_starts_nothing_on_any_worker_until_resumed(
        acceptance: Acceptance, ops: Operations) -> None:
    acceptance.configure(pause_check_interval=CHECK_INTERVAL)
    workers = acceptance.workers(["w1", "w2"], "prefork", 1)
    acceptance.send("acc.run", ["held"], kwargs={"hold": True})
    wait_until(lambda: acceptance.runs.starts()["held"], 30, "the held task to start",
               alive=workers)

    ops.pause("celery", reason="acceptance")
    paused_at = time.time()
    acceptance.send("acc.run", BACKLOG)  # publishes go on while paused
    acceptance.runs.release("held")  # the task in work finishes and is acked
    wait_until(lambda: acceptance.runs.done()["held"], 30, "the held task to finish",
               alive=workers)
    control = acceptance.app.control
    replies = control.ping(destination=[f"w1@{HOST}", f"w2@{HOST}"], timeout=5.0)
    assert sorted(replies, key=str) == [{f"w1@{HOST}": {"ok": "pong"}},
                                        {f"w2@{HOST}": {"ok": "pong"}}], replies
    time.sleep(WATCH)  # the bound is a wake-up; watched well past it
    started = [record for record in acceptance.runs.records() if record["key"] != "held"]
    assert not started, (f"{len(started)} started while paused, the first "
                         f"{started[0]['at'] - paused_at:.3f}s after the pause")

    # a worker restarted meanwhile reads the pause from the database
    assert workers[0].stop() == 0, workers[0].tail()
    restarted = acceptance.worker("prefork", 1, name="w3")
    time.sleep(WATCH)
    assert [r for r in acceptance.runs.records() if r["key"] != "held"] == []
    assert acceptance.rows() == len(BACKLOG)

    resumed_at = time.time()
    assert ops.resume("celery")
    wait_until(lambda: set(acceptance.runs.done()) >= set(BACKLOG), 60, "the backlog",
               alive=[workers[1], restarted])
    first = min(r["at"] for r in acceptance.runs.records() if r["key"] != "held")
    print(f"first task {first - resumed_at:.3f}s after the resume")
    check_exactly_once(acceptance.runs.starts() - Counter(["held"]), BACKLOG)


def test_pause_and_resume_flapping_under_a_consuming_worker_loses_and_repeats_nothing(
        acceptance: Acceptance, ops: Operations) -> None:
    """Twenty pauses and resumes within about a second while a worker takes a backlog:
    every task runs exactly once, and none comes as redelivered (rows given back for a
    pause keep their attempt)."""
    acceptance.configure(pause_check_interval=CHECK_INTERVAL)
    keys = [f"f{n}" for n in range(150)]
    # 7.5 s of work on two processes: the twenty rounds, a write each way, end well
    # before it on a loaded machine (at 0.04 s a task the backlog was gone first in CI)
    acceptance.send("acc.run", keys, kwargs={"seconds": 0.1})
    worker = acceptance.worker("prefork", 2)
    wait_until(lambda: acceptance.runs.starts(), 30, "the first task", alive=[worker])
    for _ in range(20):
        ops.pause("celery")
        time.sleep(0.025)
        ops.resume("celery")
        time.sleep(0.025)
    assert len(acceptance.runs.done()) < len(keys), "the backlog was gone before the flapping"
    wait_until(lambda: set(acceptance.runs.done()) >= set(keys), 90, "the backlog",
               alive=[worker])
    check_exactly_once(acceptance.runs.starts(), keys)
    again = [r["key"] for r in acceptance.runs.records() if r["redelivered"]]
    assert not again, f"{len(again)} redelivered: {again[:5]}"
