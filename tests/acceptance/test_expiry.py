"""A queue with a consumer never expires, whatever the consumer is doing.

A worker running one long task has no free prefetch slot, so it claims nothing (a solo
worker does nothing else at all) while its idle rounds, and every other process, sweep
what expired. Its queue's ``x-expires`` is far shorter than the task: the queue, the
held message and those behind it must all still be there when the task ends.
"""

from __future__ import annotations

import time

import pytest
from sqlalchemy import inspect

from kombu_sqlinbox.tables import table_name_for_queue
from tests.acceptance.apps import tasks
from tests.acceptance.conftest import Acceptance, check_exactly_once
from tests.processes import START_LIMIT, STOP_LIMIT, wait_until

#: the queue's x-expires (seconds); the held task runs for several of them. The consumer
#: renews it every quarter of it, so a renewal may come 1.5 s late (a loaded machine's
#: stalled process or slow commit) before the queue expires.
EXPIRES = 2.0
BEHIND = ["b0", "b1", "b2"]


@pytest.mark.slow
@pytest.mark.parametrize(("pool", "concurrency"), [("prefork", 1), ("prefork", 2),
                                                   ("solo", 1)])
def test_a_busy_consumers_queue_outlives_its_expiry(
    acceptance: Acceptance, monkeypatch: pytest.MonkeyPatch, pool: str, concurrency: int,
) -> None:
    """Each pool process runs a held task (the parent, which consumes, forked them before
    it consumed); the queue outlives several expiries and nothing is lost."""
    monkeypatch.setenv(tasks.EXPIRES_ENV, str(EXPIRES))
    acceptance.configure(sweep_interval=0.1)
    worker = acceptance.worker(pool, concurrency, worker_prefetch_multiplier=1)
    held = [f"held{n}" for n in range(concurrency)]
    acceptance.send("acc.run_late", held, kwargs={"hold": True})
    wait_until(lambda: all(acceptance.runs.starts()[key] == 1 for key in held), START_LIMIT,
               "the held tasks to start", alive=[worker])
    acceptance.send("acc.run_late", BEHIND)
    with acceptance.app.connection_for_write() as conn:
        sweeper = conn.default_channel.broker  # another process sweeping, as consumers do
        sweeper.routes.available()
        until = time.monotonic() + 2 * EXPIRES  # two expiries passing is the point
        while time.monotonic() < until:
            sweeper.sweep()
            time.sleep(0.1)
    table = table_name_for_queue("celery", acceptance.table_prefix)
    assert inspect(acceptance.engine).has_table(table), "the queue's table was dropped"
    assert acceptance.rows() == len(held) + len(BEHIND)

    for key in held:
        acceptance.runs.release(key)
    wait_until(lambda: sum(acceptance.runs.done().values()) >= len(held) + len(BEHIND),
               START_LIMIT,
               "every task to finish", alive=[worker])
    worker.terminate()
    assert worker.wait(STOP_LIMIT) == 0, worker.tail()
    check_exactly_once(acceptance.runs.starts(), [*held, *BEHIND])
    assert acceptance.rows() == 0
