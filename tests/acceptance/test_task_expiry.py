"""A Celery task that expires while it waits in the queue (``apply_async(expires=)``)
reaches a state its caller sees: the worker that receives it records it revoked, as on
Redis, so ``result.get()`` raises instead of waiting for ever."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from celery.exceptions import TaskRevokedError
from celery.states import REVOKED

from tests.acceptance.apps import tasks
from tests.acceptance.conftest import Acceptance

EXPIRES = 1.0
#: how long the caller waits for the result: a worker takes a second or two to start
RESULT_LIMIT = 60.0


@pytest.mark.parametrize("task", ["acc.run", "acc.run_late"])
def test_a_task_expired_in_the_queue_is_recorded_revoked(
        acceptance: Acceptance, tmp_path: Path, task: str) -> None:
    backend = {"result_backend": f"db+sqlite:///{tmp_path / 'results.db'}",
               "task_ignore_result": False}
    caller = tasks.make_app(acceptance.broker_url, dict(acceptance.options), **backend)
    try:
        result = caller.send_task(task, args=("expired",), expires=EXPIRES)
        kept = caller.send_task(task, args=("kept",), expires=300)
        deadline = time.time() + EXPIRES
        while time.time() <= deadline:  # the first expires before any worker runs
            time.sleep(deadline - time.time() + 0.05)
        worker = acceptance.worker("prefork", 2, **backend)
        with pytest.raises(TaskRevokedError):
            result.get(timeout=RESULT_LIMIT)
        assert result.state == REVOKED
        assert kept.get(timeout=RESULT_LIMIT) == acceptance.runs.records("kept")[0]["token"]
    finally:
        caller.close()
    assert acceptance.runs.starts() == {"kept": 1}
    # a late ack follows the result Celery's db+ backend stored apart: both rows go
    acceptance.wait_acked(worker)
