"""A unique task's key lives in its row, not in a lock beside it: a worker killed outright
while running the task leaves no stale key. The row comes back after one lease, and once
it is gone (here: past ``max_attempts``, to the dead-letter queue) a send with the key
lands again."""

from __future__ import annotations

import time

import pytest

from kombu_sqlinbox.errors import DuplicateTask
from tests.acceptance.conftest import Acceptance
from tests.processes import wait_until

LEASE = 2
KEY = "held"


def send(acceptance: Acceptance) -> str | None:
    """Send the held task with its unique key: its id, or None when the key is held."""
    try:
        return str(acceptance.app.send_task("acc.run_late", args=(KEY,),
                                             kwargs={"hold": True}, unique_key="job").id)
    except DuplicateTask:
        return None


@pytest.mark.slow
def test_a_killed_workers_unique_task_frees_its_key_within_one_lease(
        acceptance: Acceptance) -> None:
    acceptance.configure(visibility_timeout=LEASE, max_attempts=1, dead_letter_queue="dead")
    assert send(acceptance) is not None
    workers = acceptance.workers(["w1", "w2"])
    wait_until(lambda: acceptance.runs.starts()[KEY] >= 1, 30, "the unique task to start",
               alive=workers)
    assert send(acceptance) is None, "the running task holds its key"
    running, rival = sorted(workers, key=lambda w: -acceptance.runs.started_on(w.name))
    running.kill()
    killed = time.monotonic()
    assert send(acceptance) is None, "the killed worker's row still holds it (it may run again)"
    wait_until(lambda: send(acceptance) is not None, LEASE + 30,
               "a send with the key to land", alive=[rival])
    freed = time.monotonic() - killed
    assert acceptance.rows("dead") == 1, "the killed run went to the dead-letter queue"
    # the lease lapses within LEASE of the kill; the rival's next poll parks the row
    assert freed < LEASE + 5, f"the key was freed {freed:.1f}s after the kill"
    acceptance.runs.release(KEY)
    wait_until(lambda: acceptance.rows() == 0, 30, "the new task to finish", alive=[rival])
    assert rival.stop() == 0, rival.tail()
