"""Retry in place: same row, attempt counted, hidden until due, behind rows ready earlier.

kombu: ``channel.qos.retry_after(delivery_tag, seconds)``. Celery:
``raise self.retry_after(seconds)`` in an :class:`~celery_ext.tasks.InboxTask`, in
the prefork, threads and solo pools.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

import pytest

from kombu_sqlinbox.clock import Clock
from tests.integration.support import get, get_within, rows, settled, table_of
from tests.ordering.conftest import Ordering, publish, wait_for_count
from tests.processes import wait_until

DELAY = 1.5


def only_row(ordering: Ordering) -> dict[str, Any]:
    (row,) = rows(ordering.engine, table_of("jobs", ordering.prefix))
    return row


def test_retry_after_keeps_the_row_hides_it_and_puts_it_behind_rows_ready_earlier(
        ordering: Ordering, sqlinbox_clock: Clock) -> None:
    start = sqlinbox_clock.pin()
    conn = ordering.connect("jobs", "plain")
    publish(conn, "jobs", [({"n": "a"}, {})])
    first = get_within(conn, "jobs")
    before = only_row(ordering)
    conn.default_channel.qos.retry_after(first.delivery_tag, 3600)
    settled(conn)
    after = only_row(ordering)
    assert (after["id"], after["attempt"], after["locked_until"]) == (before["id"], 1, None)

    # b has a later id but becomes ready half an hour before a's retry is due
    eta = datetime.fromtimestamp(start + 1800, timezone.utc)
    publish(conn, "jobs", [({"n": "b"}, {"eta": eta.isoformat()})])
    assert get(conn, "jobs") is None, "a row was delivered before it was due"
    sqlinbox_clock.advance(1801)
    ready_first = get_within(conn, "jobs")
    assert ready_first.payload == {"n": "b"}
    ready_first.ack()
    settled(conn)
    assert get(conn, "jobs") is None, "the retried row was delivered before it was due"

    sqlinbox_clock.advance(1800)
    again = get_within(conn, "jobs")
    assert again.payload == {"n": "a"}
    assert again.delivery_info["redelivered"] is True
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
