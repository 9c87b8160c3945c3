"""A task running twice its lease is not delivered twice, though a second worker is polling.

The lease keeper extends the lease of every held row while its process lives; if it
did not, the second worker would claim the running task once its lease lapsed.
"""

from __future__ import annotations

import pytest

from tests.acceptance.conftest import Acceptance, check_exactly_once
from tests.processes import STOP_LIMIT, wait_until

#: the lease (seconds): the keeper extends it every third of it, so an extension may come up
#: to two seconds late (a loaded machine's stalled process or slow commit) before it lapses
LEASE = 3
RUNS_FOR = 2 * LEASE
KEYS = ["long0", "long1"]


@pytest.mark.slow
def test_task_longer_than_its_lease_runs_once(acceptance: Acceptance) -> None:
    acceptance.configure(visibility_timeout=LEASE)
    # four free slots for two tasks: whichever worker runs them, a slot stays free to claim
    # a row whose lease lapsed
    workers = acceptance.workers(["w1", "w2"], "prefork", 2, worker_prefetch_multiplier=1)
    acceptance.send("acc.run_late", KEYS, kwargs={"seconds": RUNS_FOR})
    wait_until(lambda: len(acceptance.runs.done()) >= len(KEYS), 6 * RUNS_FOR,
               "the long tasks to finish", alive=workers)
    for worker in workers:
        worker.terminate()
    for worker in workers:
        assert worker.wait(STOP_LIMIT) == 0, worker.tail()
        assert "lost their lease" not in worker.output()

    check_exactly_once(acceptance.runs.starts(), KEYS)
    assert not any(acceptance.runs.records(key)[0]["redelivered"] for key in KEYS)
    assert acceptance.rows() == 0
