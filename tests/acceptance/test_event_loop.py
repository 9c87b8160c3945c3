"""Celery's event loop (:confval:`event_loop`) goes on polling after a round that failed.

The polling timer is what claims due countdowns, retries and rows written by SQL: a
round that raises (a table renamed away during a migration) is logged, and the next
round comes after a back-off, so the worker recovers by itself once the table is back.
"""

from __future__ import annotations

import pytest
from sqlalchemy import text

from tests.acceptance.conftest import Acceptance
from tests.processes import wait_until

#: the worker's log line for a failed round
FAILED_ROUND = "a polling round failed"


# on SQLite a missing table raises the driver's OperationalError, a connection error to
# kombu: Celery connects again instead (and stops after five reconnects in a second)
@pytest.mark.databases("postgresql", "mysql")
def test_a_failed_polling_round_does_not_stop_polling(acceptance: Acceptance) -> None:
    acceptance.options["event_loop"] = True
    worker = acceptance.worker("prefork", 2)
    acceptance.send("acc.run", ["before"])
    wait_until(lambda: acceptance.runs.done()["before"], 30, "a task to run", alive=[worker])

    table, away = acceptance.table("celery"), acceptance.table("celery_away")
    with acceptance.engine.begin() as conn:
        conn.execute(text(f"ALTER TABLE {table} RENAME TO {away}"))
    try:
        wait_until(lambda: FAILED_ROUND in worker.output() or "Error in timer" in worker.output(),
                   30, "a polling round to fail", alive=[worker])
    finally:
        with acceptance.engine.begin() as conn:
            conn.execute(text(f"ALTER TABLE {away} RENAME TO {table}"))
    # a countdown's row is claimed by a polling round only: no wake-up comes when it is due
    acceptance.send("acc.run", ["after"], countdown=1)
    wait_until(lambda: acceptance.runs.done()["after"], 30,
               "a countdown task to run after the table came back", alive=[worker])
    assert "Error in timer" not in worker.output(), worker.tail()
    acceptance.wait_acked(worker)
    assert worker.stop() == 0, worker.tail()
