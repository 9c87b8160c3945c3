"""Celery ``countdown`` / ``eta``: the task runs after its delay, never before, and the
worker does not hold it meanwhile (the row waits in the table, unleased)."""

from __future__ import annotations

import time
from datetime import datetime, timedelta, timezone

import pytest
from kombu import Connection

from tests.acceptance.conftest import Acceptance
from tests.processes import wait_until

DELAY = 4.0


def waiting_rows(acceptance: Acceptance) -> int:
    """Rows of the celery queue nobody holds (what ``queue_declare`` reports)."""
    with Connection(acceptance.broker_url, transport_options=acceptance.options) as conn:
        return int(conn.default_channel.queue_declare("celery", passive=True).message_count)


@pytest.mark.slow
def test_countdown_and_eta_run_after_their_delay(acceptance: Acceptance) -> None:
    worker = acceptance.worker("prefork", 2)
    sent = time.time()
    acceptance.send("acc.run", ["countdown"], countdown=DELAY)
    acceptance.send("acc.run", ["eta"], eta=datetime.now(timezone.utc) + timedelta(seconds=DELAY))
    acceptance.send("acc.run", ["now"])
    wait_until(lambda: acceptance.runs.done()["now"], DELAY / 2, "the undelayed task to run",
               alive=[worker])
    assert waiting_rows(acceptance) == 2, "delayed tasks must wait in the table, not the worker"

    wait_until(lambda: len(acceptance.runs.done()) == 3, DELAY + 15, "the delayed tasks to run",
               alive=[worker])
    assert worker.stop() == 0, worker.tail()
    for key in ("countdown", "eta"):
        (run,) = acceptance.runs.records(key)
        assert run["at"] >= sent + DELAY, f"{key} ran {sent + DELAY - run['at']:.3f}s early"
