"""``kill -9`` of a whole worker mid-task: the task comes back after the lease, its attempt
counted; past ``max_attempts`` it lands in the dead-letter queue with the death header.

The task holds until the test releases it (``acc.run_late`` with ``hold=True``), so the kill
always lands in the middle of it; ``acks_late`` keeps its message unacked until it ends.
"""

from __future__ import annotations

import pytest
from kombu import Connection

from kombu_sqlinbox.codec import DEATH_HEADER
from tests.acceptance.conftest import Acceptance
from tests.processes import Proc, wait_until

LEASE = 2
KEY = "held"


def start_and_kill(acceptance: Acceptance, name: str, runs: int) -> None:
    """Start a worker, wait until it has started run number ``runs`` of the task, kill it."""
    worker = acceptance.worker("prefork", 2, name=name)
    wait_until(lambda: acceptance.runs.starts()[KEY] >= runs, 30,
               f"run {runs} of the held task to start on {name}", alive=[worker])
    worker.kill()


def held_attempt(acceptance: Acceptance) -> int:
    with acceptance.engine.connect() as conn:
        return int(conn.exec_driver_sql(
            f"SELECT attempt FROM {acceptance.table('celery')}").scalar_one())


@pytest.mark.slow
def test_task_of_killed_worker_runs_again_after_the_lease(acceptance: Acceptance) -> None:
    acceptance.configure(visibility_timeout=LEASE)
    acceptance.send("acc.run_late", [KEY], kwargs={"hold": True})
    start_and_kill(acceptance, "w1", runs=1)

    worker: Proc = acceptance.worker("prefork", 2, name="w2")
    wait_until(lambda: acceptance.runs.starts()[KEY] >= 2, 30,
               "the task to run again on w2", alive=[worker])
    assert held_attempt(acceptance) == 2
    acceptance.runs.release(KEY)
    wait_until(lambda: acceptance.runs.done()[KEY] >= 1, 30, "the task to finish", alive=[worker])
    assert worker.stop() == 0, worker.tail()

    first, second = acceptance.runs.records(KEY)
    assert (first["redelivered"], second["redelivered"]) == (False, True)
    assert first["task_id"] == second["task_id"]
    assert acceptance.runs.done()[KEY] == 1
    assert acceptance.rows() == 0


@pytest.mark.slow
def test_task_killed_past_max_attempts_is_dead_lettered(acceptance: Acceptance) -> None:
    acceptance.configure(visibility_timeout=LEASE, max_attempts=2, dead_letter_queue="dead")
    acceptance.send("acc.run_late", [KEY], kwargs={"hold": True})
    start_and_kill(acceptance, "w1", runs=1)
    start_and_kill(acceptance, "w2", runs=2)

    worker = acceptance.worker("prefork", 2, name="w3")
    wait_until(lambda: acceptance.rows() == 0, 30,
               "the third delivery to be dead-lettered", alive=[worker])
    assert worker.stop() == 0, worker.tail()
    assert acceptance.runs.starts()[KEY] == 2, "a task past max_attempts must not run again"

    with Connection(acceptance.broker_url, transport_options=acceptance.options) as conn:
        dead = conn.SimpleQueue("dead")
        message = dead.get(timeout=5)
        death = message.headers[DEATH_HEADER]
        assert message.headers["task"] == "acc.run_late"
        assert message.headers["id"] == acceptance.runs.records(KEY)[0]["task_id"]
        message.ack()
        dead.close()
    assert death["queue"] == "celery"
    assert death["attempts"] == 3
    assert "max_attempts" in death["reason"]
