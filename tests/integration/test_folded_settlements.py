"""Settlements written in the next claim's transaction: they count once that commits, one
that fails there goes back to the settling thread, and a lost commit reply loses nothing.

To make an ack wait for the claim, the settling thread is kept busy first: it writes
the ack of a queue ("slow") whose rows another transaction holds locked. SQLite has one
writer, so a claim would wait for that transaction too: these tests need a server.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from kombu import Connection
from kombu.message import Message
from sqlalchemy import text
from sqlalchemy.engine import Engine

from kombu_sqlinbox.codec import ROW_KEY
from tests.tcp_proxy import Proxy

from .conftest import Connect
from .support import (
    broker_of,
    count_rows,
    fifo_jobs,
    get,
    get_within,
    publish,
    quoted,
    rows,
    rows_locked,
    run_prepared,
    statements_run,
    table_of,
    wait_for,
)
from .test_keeper import undeletable
from .test_lost_commits import broker_url  # noqa: F401  (every connection via the proxy)

pytestmark = pytest.mark.databases("postgresql", "mysql")


def lock_waiters(engine: Engine, table: str, prepared: str) -> int:
    """Sessions whose statement on ``table`` (or the statement ``prepared`` names) waits
    for a row lock."""
    if engine.dialect.name == "postgresql":
        sql = ("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
               "AND (query LIKE :like OR query LIKE :prepared)")
    else:
        sql = ("SELECT count(*) FROM information_schema.innodb_trx "
               "WHERE trx_state = 'LOCK WAIT' AND trx_query LIKE :like")
    with engine.connect() as conn:
        return int(conn.execute(text(sql), {"like": f"%{table}%",
                                            "prepared": f"{prepared} %"}).scalar_one())


@contextmanager
def settler_busy(conn: Connection, engine: Engine, table_prefix: str) -> Iterator[None]:
    """The settling thread waits inside the block, writing an ack of queue "slow" whose
    rows another transaction holds; that ack lands once the block ends."""
    publish(conn, "slow", {"n": 0})
    slow = get_within(conn, "slow")
    table = table_of("slow", table_prefix)
    broker = broker_of(conn)
    ack = run_prepared(broker.dialect.statements(broker.table("slow").spec).complete)
    with rows_locked(engine, table):
        slow.ack()
        # A precondition, bounded for a loaded machine: beside the other parts the
        # settling thread took over 10 s to reach the lock once.
        wait_for(lambda: lock_waiters(engine, table, ack), "the settling thread to wait",
                 timeout=60)
        yield
    wait_for(lambda: count_rows(engine, table) == 0, "the slow ack to land")


def test_an_ack_is_written_by_the_next_claim_and_counts_once_committed(
    connect: Connect, engine: Engine, table_prefix: str,
) -> None:
    conn = connect()
    for n in (1, 2):
        publish(conn, "jobs", {"n": n})
    keeper = broker_of(conn).keeper
    jobs = table_of("jobs", table_prefix)
    with settler_busy(conn, engine, table_prefix):
        first = get_within(conn, "jobs")
        first.ack()
        assert count_rows(engine, jobs) == 2  # queued: the settling thread is busy
        second = get_within(conn, "jobs")
        assert second.decode() == {"n": 2}
        assert count_rows(engine, jobs) == 1  # the claim's transaction deleted the first
        assert keeper.held_count() == 2  # the second, and the slow ack still unwritten
        second.ack()
    assert keeper.flush(timeout=10)
    assert count_rows(engine, jobs) == 0


def taken_over(engine: Engine, table: str, message: Message) -> None:
    """Another consumer's claim of ``message``'s row after its lease lapsed: the row's
    attempt moves on, so the first consumer's ack of it is fenced out."""
    with engine.begin() as db:
        db.execute(text(f"UPDATE {quoted(engine, table)} SET attempt = attempt + 1 "
                        "WHERE id = :id"), {"id": message.delivery_info[ROW_KEY]["id"]})


@pytest.mark.databases("postgresql")
def test_acks_and_the_claim_that_carries_them_are_one_statement(
    connect: Connect, engine: Engine, table_prefix: str,
) -> None:
    """PostgreSQL runs the completion of the acked rows and the next claim as one
    statement: one round trip for both."""
    conn = connect()
    for n in (1, 2):
        publish(conn, "jobs", {"n": n})
    jobs = table_of("jobs", table_prefix)
    broker = broker_of(conn)
    with settler_busy(conn, engine, table_prefix):
        first = get_within(conn, "jobs")
        first.ack()
        with statements_run(broker.engine) as seen:
            second = get_within(conn, "jobs")
        assert second.decode() == {"n": 2}
        carrying = [sql for sql in seen if jobs in sql and "DELETE" in sql]
        assert len(carrying) == 1 and "UPDATE" in carrying[0], seen
        assert count_rows(engine, jobs) == 1  # the first is gone
        second.ack()
    assert broker.keeper.flush(timeout=10)
    assert count_rows(engine, jobs) == 0


@pytest.mark.databases("postgresql")
def test_an_ack_carried_by_a_claim_leaves_a_row_claimed_again_elsewhere(
    connect: Connect, engine: Engine, table_prefix: str, caplog: pytest.LogCaptureFixture,
) -> None:
    """The completion in the claim's statement is fenced like any other: an ack of a row
    whose lease another consumer took over (its attempt moved on) completes nothing."""
    caplog.set_level(logging.INFO, "kombu_sqlinbox.claims")
    conn = connect()
    for n in (1, 2):
        publish(conn, "jobs", {"n": n})
    jobs = table_of("jobs", table_prefix)
    with settler_busy(conn, engine, table_prefix):
        first = get_within(conn, "jobs")
        taken_over(engine, jobs, first)
        first.ack()
        second = get_within(conn, "jobs")
        assert second.decode() == {"n": 2}
        assert count_rows(engine, jobs) == 2  # the first kept: its ack was fenced out
        assert any("1 of 1 settled rows had already left" in record.getMessage()
                   for record in caplog.records)
        second.ack()
    assert broker_of(conn).keeper.flush(timeout=10)
    assert [row["attempt"] for row in rows(engine, jobs)] == [2]


@pytest.mark.databases("postgresql")
def test_a_claim_carrying_an_ack_that_fails_runs_alone_and_the_ack_lands_later(
    connect: Connect, engine: Engine, table_prefix: str, database: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An acked row that cannot be deleted fails the one statement of the ack and the
    claim: the claim runs again alone and delivers, the settling thread retries the ack
    until it lands, once."""
    caplog.set_level(logging.INFO, "kombu_sqlinbox.claims")
    conn = connect()
    for n in (1, 2):
        publish(conn, "jobs", {"n": n})
    jobs = table_of("jobs", table_prefix)
    pinned = rows(engine, jobs)[0]["id"]
    first = get_within(conn, "jobs")
    with undeletable(engine, database, jobs, pinned):
        with settler_busy(conn, engine, table_prefix):
            first.ack()
            second = get_within(conn, "jobs")
            assert second.decode() == {"n": 2}
            assert any("claim with 1 settlements failed" in record.getMessage()
                       for record in caplog.records)
            second.ack()
        assert count_rows(engine, jobs) >= 1  # the first still pinned, still retried
    assert broker_of(conn).keeper.flush(timeout=10), "the ack did not land once it could"
    assert count_rows(engine, jobs) == 0
    assert get(conn, "jobs") is None


@pytest.mark.databases("postgresql")
def test_a_fifo_claim_carrying_a_heads_ack_takes_the_next_row_of_its_group(
    connect: Connect, engine: Engine, table_prefix: str,
) -> None:
    """The claim that completes a group's head counts it as finished, though its snapshot
    still shows it: the group's next row comes in that one statement."""
    conn = fifo_jobs(connect, table_prefix)
    jobs = table_of("jobs", table_prefix)
    with settler_busy(conn, engine, table_prefix):
        first = get_within(conn, "jobs")
        first.ack()
        with statements_run(broker_of(conn).engine, lambda sql: jobs in sql) as seen:
            second = get_within(conn, "jobs")
        assert second.decode() == {"n": 2}
        assert len(seen) == 1 and "DELETE" in seen[0], seen
        second.ack()
    assert broker_of(conn).keeper.flush(timeout=10)
    assert count_rows(engine, jobs) == 0


@pytest.mark.databases("postgresql")
def test_a_fifo_head_whose_carried_ack_is_fenced_out_keeps_its_group_waiting(
    connect: Connect, engine: Engine, table_prefix: str,
) -> None:
    """An ack of a head another consumer has taken over (its attempt moved on) completes
    nothing, so the claim carrying it must not count the head as finished: the group's
    next row stays back while the head is in work elsewhere."""
    conn = fifo_jobs(connect, table_prefix)
    jobs = table_of("jobs", table_prefix)
    with settler_busy(conn, engine, table_prefix):
        first = get_within(conn, "jobs")
        taken_over(engine, jobs, first)
        first.ack()
        assert get(conn, "jobs") is None, "a row ran while its group's head was in work"
        assert count_rows(engine, jobs) == 2


def test_a_settlement_failing_in_a_claim_goes_back_to_the_settling_thread(
    connect: Connect, engine: Engine, table_prefix: str, database: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A row that cannot be deleted: the claim that took its ack fails, runs again alone
    and delivers; the ack is retried by the settling thread until it lands, once."""
    caplog.set_level(logging.INFO, "kombu_sqlinbox.claims")
    conn = connect()
    publish(conn, "stuck", {"n": 0})
    publish(conn, "jobs", {"n": 1})
    stuck_table, jobs = table_of("stuck", table_prefix), table_of("jobs", table_prefix)
    (pinned,) = rows(engine, stuck_table)
    stuck = get_within(conn, "stuck")
    with undeletable(engine, database, stuck_table, pinned["id"]):
        with settler_busy(conn, engine, table_prefix):
            stuck.ack()
            job = get_within(conn, "jobs")
            assert job.decode() == {"n": 1}
            assert any("claim with 1 settlements failed" in record.getMessage()
                       for record in caplog.records)
            job.ack()
        assert count_rows(engine, stuck_table) == 1  # still pinned, still retried
    assert broker_of(conn).keeper.flush(timeout=10), "the ack did not land once it could"
    assert count_rows(engine, stuck_table) == 0
    assert count_rows(engine, jobs) == 0
    assert get(conn, "stuck") is None and get(conn, "jobs") is None


def test_a_claim_with_acks_whose_commit_reply_is_lost_runs_again_and_loses_nothing(
    connect: Connect, engine: Engine, table_prefix: str, proxy: Proxy,
) -> None:
    """The commit lands, its reply is lost: run again, the fenced ack finds nothing to do
    and the claim takes the next row; the acked message never comes back, the row of the
    lost claim comes back once its lease lapses."""
    lease = 5  # no extension commits while the claim runs: the cut is the claim's
    conn = connect(visibility_timeout=lease)
    for n in range(3):
        publish(conn, "jobs", {"n": n})
    jobs = table_of("jobs", table_prefix)
    with settler_busy(conn, engine, table_prefix):
        first = get_within(conn, "jobs")
        assert first.decode() == {"n": 0}
        first.ack()
        proxy.cut_after_commit()
        second = get_within(conn, "jobs")
        assert proxy.commits_cut == 1
        assert second.decode() == {"n": 2}
        assert count_rows(engine, jobs) == 2
    again = get_within(conn, "jobs", timeout=lease * 4)
    assert again.decode() == {"n": 1}
    assert again.delivery_info["redelivered"] is True
    for message in (second, again):
        message.ack()
    assert broker_of(conn).keeper.flush(timeout=10)
    assert count_rows(engine, jobs) == 0
    assert get(conn, "jobs") is None
