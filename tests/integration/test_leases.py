"""Lease claims: fencing of stale holders, extension of held rows."""

from __future__ import annotations

from sqlalchemy.engine import Engine

from kombu_sqlinbox.clock import Clock

from .conftest import Connect
from .support import (
    broker_of,
    count_rows,
    get,
    get_within,
    never_delivered,
    publish,
    rows,
    settled,
    table_of,
)

#: the lease of the tests that watch a held row stay held (seconds): the keeper extends it
#: every third of it, so an extension may come up to two thirds of it late (a loaded
#: machine's stalled thread or slow commit) before the row lapses; watched past one such
#: lease, the row is held only because the keeper extended it
KEPT_LEASE = 3


def test_stale_holder_cannot_ack_a_reclaimed_row(
    connect: Connect, engine: Engine, table_prefix: str, sqlinbox_clock: Clock,
) -> None:
    """A's keeper stops (a paused process); B reclaims once the lease has passed; A's late
    ack is fenced."""
    holder_a = connect(visibility_timeout=30)
    holder_b = connect(visibility_timeout=30, polling_interval=0.06)  # another broker, keeper
    assert broker_of(holder_a) is not broker_of(holder_b)
    publish(holder_a, "jobs", {"n": 1})
    table = table_of("jobs", table_prefix)
    stale = get_within(holder_a, "jobs")
    broker_of(holder_a).keeper.stop()
    assert get(holder_b, "jobs") is None
    sqlinbox_clock.advance(31)
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
    """A row held for two leases stays with its holder (see :data:`KEPT_LEASE`)."""
    holder = connect(visibility_timeout=KEPT_LEASE)
    other = connect(visibility_timeout=KEPT_LEASE, polling_interval=0.06)
    publish(holder, "jobs", {"n": 1})
    held = get_within(holder, "jobs")
    never_delivered(other, ["jobs"], 2 * KEPT_LEASE)
    assert rows(engine, table_of("jobs", table_prefix))[0]["attempt"] == 1
    held.ack()
    settled(holder)
    assert rows(engine, table_of("jobs", table_prefix)) == []


def test_a_late_extension_does_not_lease_a_requeued_row_again(
    connect: Connect, engine: Engine, table_prefix: str,
) -> None:
    """The keeper extends on one thread and settles on another: an extension of rows read
    before a requeue was written, landing after it, leaves the requeued row free."""
    conn = connect()
    publish(conn, "jobs", {"n": 1})
    get_within(conn, "jobs").requeue()
    settled(conn)
    table = table_of("jobs", table_prefix)
    (row,) = rows(engine, table)
    assert row["locked_until"] is None
    broker = broker_of(conn)
    spec = broker.table("jobs").spec
    kept = broker.run(lambda c: broker.dialect.extend(c, spec, {row["attempt"]: [row["id"]]}, 30))
    assert kept == 0
    assert rows(engine, table)[0]["locked_until"] is None
    assert get_within(conn, "jobs").delivery_info["redelivered"] is True


def test_a_short_lease_is_kept_beside_longer_ones(
    connect: Connect, engine: Engine, table_prefix: str,
) -> None:
    """A row of a short lease, held after rows of a 30 s lease, is extended at a third of
    its own lease, not of theirs (10 s, by which it would have lapsed): another consumer
    gets nothing over one and a half of its leases."""
    queues = {"fast": {"visibility_timeout": KEPT_LEASE}}
    holder = connect(visibility_timeout=30, queues=queues)
    rival = connect(visibility_timeout=30, queues=queues, polling_interval=0.06)
    publish(holder, "slow", {"n": 0})
    publish(holder, "fast", {"n": 1})
    get_within(holder, "slow")
    held = get_within(holder, "fast")
    never_delivered(rival, ["fast"], 1.5 * KEPT_LEASE)
    fast = table_of("fast", table_prefix)
    assert [row["attempt"] for row in rows(engine, fast)] == [1]
    held.ack()
    settled(holder)
    assert count_rows(engine, fast) == 0


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
