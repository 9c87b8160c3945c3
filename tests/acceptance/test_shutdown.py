"""A warm shutdown (``SIGTERM``) of a prefork worker taking in a backlog of long tasks:
every task runs exactly once, here or on the worker after it, and the worker exits in
a time bounded by its prefetch, not by the length of the queue."""

from __future__ import annotations

import time

from tests.acceptance.conftest import Acceptance, check_exactly_once
from tests.processes import wait_until

SECONDS = 1.0
BACKLOG = [f"long{n}" for n in range(24)]
#: a worker that runs only what it had started exits within this; one that ran its
#: whole backlog (24 one-second tasks on two processes) took 12 s. A loaded machine
#: adds seconds to the pool's own exit (6.4 s seen in CI), so the time is bounded
#: loosely and the tasks it ran tightly
STOP_WITHIN = 10.0
#: the most tasks a stopping worker runs: those its two processes had started, and a
#: round or two begun before the signal landed; running its backlog would be 24
RAN_AT_MOST = 8


def test_a_worker_without_a_prefetch_limit_stops_without_running_the_queue(
        acceptance: Acceptance) -> None:
    # worker_prefetch_multiplier 0: Celery takes no limit on the messages it receives
    worker = acceptance.worker("prefork", 2, worker_prefetch_multiplier=0)
    acceptance.send("acc.run", BACKLOG, kwargs={"seconds": SECONDS})
    wait_until(lambda: acceptance.runs.starts(), 30, "the first task to start", alive=[worker])
    asked = time.monotonic()
    assert worker.stop() == 0, worker.tail()
    took = time.monotonic() - asked
    ran = len(acceptance.runs.done())
    assert ran <= RAN_AT_MOST, f"the warm shutdown ran {ran} tasks in {took:.1f}s"
    assert took < STOP_WITHIN, f"the warm shutdown took {took:.1f}s and ran {ran} tasks"

    # eight processes: the rest of the backlog is sleeps, and the suite waits for it
    after = acceptance.worker("prefork", 8, name="w2")
    wait_until(lambda: len(acceptance.runs.done()) == len(BACKLOG), 60,
               "the rest of the backlog to run on the next worker", alive=[after])
    assert after.stop() == 0, after.tail()
    check_exactly_once(acceptance.runs.starts(), BACKLOG)
    assert acceptance.rows() == 0
