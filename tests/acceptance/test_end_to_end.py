"""A real ``celery worker`` runs 1,000 tasks per database and pool, each exactly once."""

from __future__ import annotations

import time

import pytest

from tests.acceptance.conftest import Acceptance, check_exactly_once
from tests.processes import wait_until

TASKS = 1000
POOLS = [("prefork", 2), ("threads", 4), ("solo", 1)]


@pytest.mark.slow
@pytest.mark.parametrize(("pool", "concurrency"), POOLS, ids=[pool for pool, _ in POOLS])
def test_every_task_runs_exactly_once(acceptance: Acceptance, pool: str, concurrency: int) -> None:
    worker = acceptance.worker(pool, concurrency)
    keys = [f"t{n}" for n in range(TASKS)]
    began = time.monotonic()
    acceptance.send("acc.run", keys)
    sent = time.monotonic()
    wait_until(lambda: len(acceptance.runs.done()) >= TASKS, 120,
               f"{TASKS} tasks to finish", alive=[worker])
    finished = time.monotonic()
    assert worker.stop() == 0, worker.tail()

    check_exactly_once(acceptance.runs.starts(), keys)
    check_exactly_once(acceptance.runs.done(), keys)
    assert acceptance.rows() == 0, "acked tasks must leave the queue table"
    print(f"{pool} -c {concurrency}: sent {TASKS} in {sent - began:.1f}s, "
          f"all done after {finished - began:.1f}s ({TASKS / (finished - began):.0f} tasks/s)")


@pytest.mark.slow
@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_celery_event_loop_runs_every_task_exactly_once(acceptance: Acceptance, pool: str) -> None:
    """With ``event_loop`` the transport says it is asynchronous and Celery consumes from its
    event loop (hub readers, a polling timer, acks through the hub) instead."""
    acceptance.options["event_loop"] = True
    worker = acceptance.worker(pool, 2)
    keys = [f"e{n}" for n in range(200)]
    acceptance.send("acc.run", keys)
    wait_until(lambda: len(acceptance.runs.done()) >= len(keys), 60,
               f"{len(keys)} tasks to finish", alive=[worker])
    acceptance.wait_acked(worker)  # acked tasks leave the queue table
    assert worker.stop() == 0, worker.tail()
    check_exactly_once(acceptance.runs.starts(), keys)
    check_exactly_once(acceptance.runs.done(), keys)
