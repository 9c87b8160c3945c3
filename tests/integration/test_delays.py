"""Delays and priority."""

from __future__ import annotations

from datetime import datetime, timezone

from kombu_sqlinbox.clock import Clock

from .conftest import Connect
from .support import get, get_within, publish, settled


def test_eta_in_the_future_is_not_claimable_before_it_is_due(
    connect: Connect, sqlinbox_clock: Clock,
) -> None:
    start = sqlinbox_clock.pin()
    conn = connect()
    due = datetime.fromtimestamp(start + 3600, timezone.utc)
    publish(conn, "jobs", {"n": "later"}, headers={"eta": due.isoformat()})
    publish(conn, "jobs", {"n": "now"})
    undelayed = get_within(conn, "jobs")
    assert undelayed.decode() == {"n": "now"}
    undelayed.ack()  # an hour later its lease would have passed too
    settled(conn)
    sqlinbox_clock.advance(3599)
    assert get(conn, "jobs") is None
    sqlinbox_clock.advance(2)  # a second past it (times are stored to the microsecond)
    delayed = get_within(conn, "jobs")
    assert delayed.decode() == {"n": "later"}
    assert delayed.headers["eta"] == due.isoformat()


def test_higher_priority_is_delivered_first(connect: Connect) -> None:
    conn = connect()
    for priority in (1, 9, 0, 5, 9):
        publish(conn, "jobs", {"priority": priority}, priority=priority)
    order = [get_within(conn, "jobs").decode()["priority"] for _ in range(5)]
    assert order == [9, 9, 5, 1, 0]
