"""Lease claims (SPEC C2): fencing of stale holders, extension of held rows."""

from __future__ import annotations

import time

from sqlalchemy.engine import Engine

from .conftest import Connect
from .support import broker_of, get, get_within, publish, rows, settled, table_of


def test_stale_holder_cannot_ack_a_reclaimed_row(
    connect: Connect, engine: Engine, table_prefix: str,
) -> None:
    """A's keeper stops (a paused process); B reclaims after the lease; A's late ack is fenced."""
    holder_a = connect(visibility_timeout=1)
    holder_b = connect(visibility_timeout=1, polling_interval=0.06)  # another broker and keeper
    assert broker_of(holder_a) is not broker_of(holder_b)
    publish(holder_a, "jobs", {"n": 1})
    table = table_of("jobs", table_prefix)
    stale = get_within(holder_a, "jobs")
    broker_of(holder_a).keeper.stop()
    fresh = get_within(holder_b, "jobs")
    assert fresh.delivery_info["redelivered"] is True
    (reclaimed,) = rows(engine, table)
    assert reclaimed["attempt"] == 2
    stale.ack()
    settled(holder_a)
    assert [(row["id"], row["attempt"]) for row in rows(engine, table)] == [
        (reclaimed["id"], 2)]
    fresh.ack()
    settled(holder_b)
    assert rows(engine, table) == []


def test_held_row_is_not_delivered_twice_while_its_lease_is_extended(
    connect: Connect, engine: Engine, table_prefix: str,
) -> None:
    """With a 2 s lease, a row held for 7 s (3.5 leases) stays with its holder."""
    holder = connect(visibility_timeout=2)
    other = connect(visibility_timeout=2, polling_interval=0.06)
    publish(holder, "jobs", {"n": 1})
    held = get_within(holder, "jobs")
    until = time.monotonic() + 7
    while time.monotonic() < until:
        assert get(other, "jobs") is None
        time.sleep(0.2)
    assert rows(engine, table_of("jobs", table_prefix))[0]["attempt"] == 1
    held.ack()
    settled(holder)
    assert rows(engine, table_of("jobs", table_prefix)) == []


def test_lost_connection_keeps_the_rows_its_consumer_still_holds(
    connect: Connect, engine: Engine, table_prefix: str,
) -> None:
    """kombu collects a failed connection (Celery's reconnect path): a message still held
    by the consumer keeps its row until it is acked late; one it let go of goes back."""
    conn = connect()
    publish(conn, "jobs", {"n": "running"})
    publish(conn, "jobs", {"n": "dropped"})
    broker = broker_of(conn)
    running = get_within(conn, "jobs")
    dropped = get_within(conn, "jobs")
    conn.collect()
    assert broker.keeper.flush(timeout=10)
    assert [row["locked_until"] is not None for row in rows(engine, table_of(
        "jobs", table_prefix))] == [True, True]
    del dropped
    assert broker.keeper.flush(timeout=10)
    table = table_of("jobs", table_prefix)
    assert [(row["attempt"], row["locked_until"] is None) for row in rows(engine, table)] == [
        (1, False), (1, True)]
    running.ack()
    assert broker.keeper.flush(timeout=10)
    assert [row["payload"] for row in rows(engine, table)] == [b'{"n": "dropped"}']
    assert broker.keeper.held_count() == 0
