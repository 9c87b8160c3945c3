"""Retry in place: same row, attempt counted, hidden until due, behind rows ready earlier.

kombu: ``channel.qos.retry_after(delivery_tag, seconds)``. Celery:
``raise self.retry_after(seconds)`` in an :class:`~celery_ext.tasks.InboxTask`, in
the prefork, threads and solo pools.
"""

from __future__ import annotations

import time
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from sqlalchemy import text

from tests.integration.support import get, get_within, quoted, rows, settled, table_of
from tests.ordering.conftest import Ordering, publish, wait_for_count
from tests.processes import wait_until

DELAY = 1.5


def only_row(ordering: Ordering) -> dict[str, Any]:
    (row,) = rows(ordering.engine, table_of("jobs", ordering.prefix))
    return row


def due_rows(ordering: Ordering) -> int:
    """Rows of queue "jobs" whose ``available_at`` has come, by the database's clock."""
    now = ordering.engine.dialect.name
    clock = {"postgresql": "now()", "mysql": "UTC_TIMESTAMP(6)"}.get(
        now, "((julianday('now') - 2440587.5) * 86400.0)")
    table = quoted(ordering.engine, table_of("jobs", ordering.prefix))
    with ordering.engine.connect() as conn:
        return int(conn.execute(text(
            f"SELECT COUNT(*) FROM {table} WHERE available_at <= {clock}")).scalar_one())


def test_retry_after_keeps_the_row_hides_it_and_puts_it_behind_rows_ready_earlier(
        ordering: Ordering) -> None:
    conn = ordering.connect("jobs", "plain")
    publish(conn, "jobs", [({"n": "a"}, {})])
    first = get_within(conn, "jobs")
    before = only_row(ordering)
    conn.default_channel.qos.retry_after(first.delivery_tag, DELAY)
    settled(conn)
    retried = time.monotonic()
    after = only_row(ordering)
    assert (after["id"], after["attempt"], after["locked_until"]) == (before["id"], 1, None)

    # b has a later id but becomes ready before a's retry is due
    eta = datetime.now(timezone.utc) + timedelta(seconds=DELAY / 2)
    publish(conn, "jobs", [({"n": "b"}, {"eta": eta.isoformat()})])
    while time.monotonic() < retried + DELAY / 2 - 0.2:
        assert get(conn, "jobs") is None, "a row was delivered before it was due"
        time.sleep(0.1)
    wait_until(lambda: due_rows(ordering) == 2, 10, "both rows to be due")

    ready_first = get_within(conn, "jobs")
    assert ready_first.payload == {"n": "b"}
    ready_first.ack()
    settled(conn)
    again = get_within(conn, "jobs")
    assert again.payload == {"n": "a"}
    assert again.delivery_info["redelivered"] is True
    assert time.monotonic() - retried >= DELAY - 0.1
    assert only_row(ordering)["attempt"] == 2 and only_row(ordering)["id"] == before["id"]


@pytest.mark.slow
@pytest.mark.parametrize("pool", ["prefork", "threads", "solo"])
def test_task_retry_after_runs_again_in_place_in_every_pool(ordering: Ordering,
                                                            pool: str) -> None:
    app = ordering.app("jobs", "plain")
    app.send_task("ord.retry_once", args=("k", DELAY))
    original = only_row(ordering)["id"]
    (worker,) = ordering.workers(["w1"], "jobs", "plain", pool=pool)

    wait_for_count(lambda: ordering.log.done("retry"), 1, "the first run", [worker])
    waiting = wait_until(lambda: (row := only_row(ordering))["locked_until"] is None and row,
                         DELAY, "the retried row to wait in place")
    assert (waiting["id"], waiting["attempt"]) == (original, 1), "not the same row"
    wait_for_count(ordering.log.done, 1, "the run after the retry", [worker])

    first, second = sorted(ordering.log.entries(), key=lambda e: e.started)
    assert (first.outcome, second.outcome) == ("retry", "done")
    assert second.started - (first.ended or 0) >= DELAY - 0.1, "ran again before it was due"
    wait_until(lambda: not rows(ordering.engine, table_of("jobs", ordering.prefix)), 10,
               "the row to be deleted by the ack")
