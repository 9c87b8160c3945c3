"""Delays and priority."""

from __future__ import annotations

import time
from datetime import datetime, timezone

import pytest

from kombu_sqlinbox.clock import Clock
from kombu_sqlinbox.dialects.base import FLOOR_REFRESH, FLOOR_STEP

from .conftest import Connect
from .support import broker_of, get, get_within, publish, settled

#: what a driver returns for a payload, a headers column, a time: every variant
pytestmark = pytest.mark.drivers


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


def test_a_row_due_later_hides_none_published_before_it_is_due(connect: Connect) -> None:
    """A queue whose only row is due in an hour (a countdown task) delivers a message
    published next at once, whether the claim floor was read over the whole table or from
    where it stood (the step) while that row was alone: the floor never rises above the
    present, so the new row is not passed over until the next whole reading."""
    conn = connect()
    due = datetime.fromtimestamp(time.time() + 3600, timezone.utc)
    publish(conn, "jobs", {"n": "later"}, headers={"eta": due.isoformat()})
    assert get(conn, "jobs") is None  # a claim reads the floor with the later row alone
    publish(conn, "jobs", {"n": "now"})
    first = get_within(conn, "jobs", timeout=FLOOR_REFRESH / 3)
    assert first.decode() == {"n": "now"}
    first.ack()
    settled(conn)
    dialect = broker_of(conn).dialect
    dialect.floor_step = 0.0  # every claim reads the floor from where it stands
    try:
        assert get(conn, "jobs") is None
        publish(conn, "jobs", {"n": "next"})
        assert get_within(conn, "jobs", timeout=FLOOR_REFRESH / 3).decode() == {"n": "next"}
    finally:
        dialect.floor_step = FLOOR_STEP


def test_higher_priority_is_delivered_first(connect: Connect) -> None:
    conn = connect()
    for priority in (1, 9, 0, 5, 9):
        publish(conn, "jobs", {"priority": priority}, priority=priority)
    order = [get_within(conn, "jobs").decode()["priority"] for _ in range(5)]
    assert order == [9, 9, 5, 1, 0]
