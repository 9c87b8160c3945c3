"""Delays and priority."""

from __future__ import annotations

import time
from datetime import datetime, timedelta, timezone

from .conftest import Connect
from .support import get, get_within, publish


def test_eta_in_the_future_is_not_claimable_before_it_is_due(connect: Connect) -> None:
    conn = connect()
    due = datetime.now(timezone.utc) + timedelta(seconds=2)
    publish(conn, "jobs", {"n": "later"}, headers={"eta": due.isoformat()})
    publish(conn, "jobs", {"n": "now"})
    assert get_within(conn, "jobs").decode() == {"n": "now"}
    while time.time() < due.timestamp() - 0.3:
        assert get(conn, "jobs") is None
        time.sleep(0.1)
    delayed = get_within(conn, "jobs", timeout=10)
    assert time.time() >= due.timestamp()
    assert delayed.decode() == {"n": "later"}
    assert delayed.headers["eta"] == due.isoformat()


def test_higher_priority_is_delivered_first(connect: Connect) -> None:
    conn = connect()
    for priority in (1, 9, 0, 5, 9):
        publish(conn, "jobs", {"priority": priority}, priority=priority)
    order = [get_within(conn, "jobs").decode()["priority"] for _ in range(5)]
    assert order == [9, 9, 5, 1, 0]
