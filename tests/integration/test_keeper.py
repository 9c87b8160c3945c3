"""The lease keeper: when a settlement counts as written, and what one that fails holds up."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from kombu import Connection
from sqlalchemy import text
from sqlalchemy.engine import Engine

from kombu_sqlinbox.codec import ROW_KEY
from kombu_sqlinbox.keeper import LeaseKeeper
from tests.tcp_proxy import Proxy

from .conftest import Connect
from .support import (
    broker_of,
    count_rows,
    fifo_jobs,
    get_within,
    never_delivered,
    publish,
    quoted,
    rows,
    rows_locked,
    statements_run,
    table_of,
    wait_for,
)

#: the lease of the tests that wait for a lease to lapse, or for extensions to fail (seconds)
LEASE = 1
#: the lease of the tests that watch a held row stay held: the keeper extends it every third
#: of it, so an extension may come up to two thirds of it late (a loaded machine's stalled
#: thread or slow commit) before the row lapses; and how many of these leases the healthy
#: queue is watched for (past one, the row is held only because the keeper extended it)
KEPT_LEASE = 3
LEASES_WATCHED = 1.5


def test_flush_returns_only_once_the_acks_are_committed(
    connect: Connect, engine: Engine, table_prefix: str,
) -> None:
    conn = connect()
    publish(conn, "jobs", {"n": 1})
    message = get_within(conn, "jobs")
    table = table_of("jobs", table_prefix)
    keeper = broker_of(conn).keeper
    with rows_locked(engine, table):  # the ack's statement waits for this transaction
        message.ack()
        assert keeper.flush(timeout=1.5) is False
        assert count_rows(engine, table) == 1
    assert keeper.flush(timeout=10)
    assert count_rows(engine, table) == 0


@contextmanager
def undeletable(engine: Engine, database: str, table: str, row_id: int) -> Iterator[None]:
    """Make every DELETE of one row fail for real: a foreign key of another table points at
    it (on SQLite, which enforces foreign keys only when asked, a trigger refuses it)."""
    pin = quoted(engine, table + "_pin")
    target = quoted(engine, table)
    with engine.begin() as conn:
        if database == "sqlite":
            conn.execute(text(
                f"CREATE TRIGGER {pin} BEFORE DELETE ON {target} WHEN OLD.id = {int(row_id)} "
                "BEGIN SELECT RAISE(ABORT, 'row is pinned'); END"))
        else:
            conn.execute(text(f"CREATE TABLE {pin} (id BIGINT REFERENCES {target} (id))"))
            conn.execute(text(f"INSERT INTO {pin} (id) VALUES (:id)"), {"id": row_id})
    try:
        yield
    finally:
        with engine.begin() as conn:
            conn.execute(text(f"DROP {'TRIGGER' if database == 'sqlite' else 'TABLE'} {pin}"))


def jobs_published(connect: Connect, table_prefix: str,
                   count: int) -> tuple[Connection, LeaseKeeper, str]:
    """A connection with ``count`` messages in queue "jobs"; its keeper, the queue's table."""
    conn = connect()
    for n in range(count):
        publish(conn, "jobs", {"n": n})
    return conn, broker_of(conn).keeper, table_of("jobs", table_prefix)


def own_pid(keeper: LeaseKeeper) -> int:
    """The server process of the lease keeper's own connection."""
    session = keeper._own.current() if keeper._own is not None else None
    assert session is not None, "no connection of the keeper's own"
    return int(session.exec_driver_sql("SELECT pg_backend_pid()").scalar_one())


def failures_logged(caplog: pytest.LogCaptureFixture, queue: str, what: str = "") -> list[str]:
    """The keeper's warnings that name ``queue`` (and contain ``what``)."""
    return [record.getMessage() for record in caplog.records
            if record.name == "kombu_sqlinbox.claims" and record.levelno >= logging.WARNING
            and repr(queue) in record.getMessage() and what in record.getMessage()]


def test_an_ack_that_keeps_failing_holds_up_no_other_ack_or_lease(
    connect: Connect, engine: Engine, table_prefix: str, database: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """One row that cannot be deleted: its ack is retried with back-off until it lands, while
    the other queue's acks land and its leases are kept past several lease periods."""
    caplog.set_level(logging.WARNING, "kombu_sqlinbox.claims")
    holder = connect(visibility_timeout=KEPT_LEASE)
    rival = connect(visibility_timeout=KEPT_LEASE, polling_interval=0.06)  # another process
    publish(holder, "stuck", {"n": 0})
    for n in (1, 2):
        publish(holder, "jobs", {"n": n})
    stuck = get_within(holder, "stuck")
    first, second = get_within(holder, "jobs"), get_within(holder, "jobs")
    stuck_table, jobs_table = table_of("stuck", table_prefix), table_of("jobs", table_prefix)
    (pinned,) = rows(engine, stuck_table)

    with undeletable(engine, database, stuck_table, pinned["id"]):
        stuck.ack()
        first.ack()
        wait_for(lambda: count_rows(engine, jobs_table) == 1, "the healthy ack to land", 5)
        never_delivered(rival, ["jobs", "stuck"], KEPT_LEASE * LEASES_WATCHED)
        second.ack()
        wait_for(lambda: count_rows(engine, jobs_table) == 0, "the second healthy ack", 5)
        assert [row["attempt"] for row in rows(engine, stuck_table)] == [1]
        retries = failures_logged(caplog, "stuck", "settlements")
        assert len(retries) >= 2, "the failing ack was not retried"
        assert not failures_logged(caplog, "jobs")
    assert broker_of(holder).keeper.flush(timeout=10), "the ack did not land once it could"
    assert count_rows(engine, stuck_table) == 0


def test_an_ack_on_a_dropped_table_is_given_up_and_holds_up_nothing(
    connect: Connect, engine: Engine, table_prefix: str, caplog: pytest.LogCaptureFixture,
) -> None:
    """The table of a held row is dropped: its lease can no longer be extended and its ack
    can never land, and its row is gone, so both are dropped (logged); the other queue's
    leases and acks go on."""
    caplog.set_level(logging.WARNING, "kombu_sqlinbox.claims")
    holder = connect(visibility_timeout=KEPT_LEASE)
    rival = connect(visibility_timeout=KEPT_LEASE, polling_interval=0.06)
    publish(holder, "doomed", {"n": 0})
    publish(holder, "jobs", {"n": 1})
    doomed = get_within(holder, "doomed")
    held = get_within(holder, "jobs")
    with engine.begin() as conn:
        conn.execute(text(f"DROP TABLE {quoted(engine, table_of('doomed', table_prefix))}"))
    wait_for(lambda: failures_logged(caplog, "doomed", "forgotten"),
             "the next extension to forget the dropped table's row", 10)
    never_delivered(rival, ["jobs"], KEPT_LEASE * LEASES_WATCHED)
    doomed.ack()
    assert broker_of(holder).keeper.flush(timeout=5), "an ack that can never land was kept"
    assert failures_logged(caplog, "doomed", "dropped")
    jobs_table = table_of("jobs", table_prefix)
    assert [row["attempt"] for row in rows(engine, jobs_table)] == [1]
    held.ack()
    assert broker_of(holder).keeper.flush(timeout=5)
    assert count_rows(engine, jobs_table) == 0
    assert not failures_logged(caplog, "jobs")


@pytest.mark.databases("postgresql", "mysql")  # a file has no connection to lose
def test_an_ack_that_cannot_reach_the_database_is_retried_until_it_lands(
    db_url: str, engine: Engine, table_prefix: str, proxy: Proxy,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The server is out of reach (as in a restart): the ack is not dropped but kept and
    retried, extensions are retried too, and the ack lands once the server answers again."""
    caplog.set_level(logging.WARNING, "kombu_sqlinbox.claims")
    conn = Connection("sqlinbox+" + proxy.url(db_url), transport_options={
        "table_prefix": table_prefix, "polling_interval": 0.05, "visibility_timeout": LEASE})
    try:
        publish(conn, "jobs", {"n": 1})
        message = get_within(conn, "jobs")
        keeper = broker_of(conn).keeper
        table = table_of("jobs", table_prefix)
        with proxy.refuse():
            message.ack()
            wait_for(lambda: len(failures_logged(caplog, "jobs", "settlements")) >= 2,
                     "the ack to fail and be retried")
            wait_for(lambda: len(failures_logged(caplog, "jobs", "extending")) >= 2,
                     "the extension to fail and be retried")
            # a failure is its transaction's tries (at most ten connections) and one
            # question whether the table is gone, not ten more (~3 s of the settling
            # thread per failure on MariaDB, every queue's settlements held up)
            failures = len(failures_logged(caplog, "jobs"))
            assert proxy.refused <= 11 * failures + 10, (proxy.refused, failures)
            assert keeper.flush(timeout=0.5) is False
            assert count_rows(engine, table) == 1
        assert keeper.flush(timeout=10), "the ack did not land once the server answered"
        assert count_rows(engine, table) == 0
    finally:
        conn.release()


def test_closing_gives_up_on_an_ack_it_cannot_write_in_time_and_the_row_comes_back(
    connect: Connect, engine: Engine, table_prefix: str, database: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Closing waits a bounded time for an ack that keeps failing, then says so; the row is
    not lost: once its lease runs out it is delivered again."""
    caplog.set_level(logging.WARNING, "kombu_sqlinbox.claims")
    holder = connect(visibility_timeout=LEASE)
    rival = connect(visibility_timeout=LEASE, polling_interval=0.06)
    publish(holder, "jobs", {"n": 1})
    message = get_within(holder, "jobs")
    table = table_of("jobs", table_prefix)
    (row,) = rows(engine, table)
    with undeletable(engine, database, table, row["id"]):
        message.ack()
        broker_of(holder).keeper.stop(timeout=1)
        assert failures_logged(caplog, "jobs", "settlements")
        assert any("not written within" in record.getMessage() for record in caplog.records)
        again = get_within(rival, "jobs")
        assert again.delivery_info["redelivered"] is True
    again.ack()
    assert broker_of(rival).keeper.flush(timeout=10)
    assert count_rows(engine, table) == 0


@pytest.mark.parametrize("database", ["postgresql"], indirect=True)
def test_acks_are_written_on_the_keepers_own_connection_then_on_the_pool_once_it_died(
    connect: Connect, engine: Engine, table_prefix: str, caplog: pytest.LogCaptureFixture,
) -> None:
    """PostgreSQL: the settling thread writes acks on a connection of its own (one round
    trip a statement). Once that connection died (its server session ended), the next
    ack lands through the pool, once; the one after connects it again."""
    caplog.set_level(logging.INFO, "kombu_sqlinbox.claims")
    conn, keeper, table = jobs_published(connect, table_prefix, 3)

    def ack_next() -> int:
        """Ack the next message, wait until it is written; the rows left."""
        get_within(conn, "jobs").ack()
        assert keeper.flush(timeout=10), "the ack did not land"
        return count_rows(engine, table)

    assert ack_next() == 2
    first = own_pid(keeper)
    with engine.connect() as db:
        db.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": first})
        db.commit()
    assert ack_next() == 1
    assert "settling on the pool" in caplog.text
    assert ack_next() == 0
    assert own_pid(keeper) != first


@pytest.mark.parametrize("database", ["postgresql"], indirect=True)
def test_an_ack_the_database_refuses_keeps_the_keepers_own_connection(
    connect: Connect, engine: Engine, table_prefix: str, database: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A statement refused on the keeper's own connection (a row a foreign key pins) is
    the row's error, not the connection's: the ack is retried until it lands, once, on
    the same connection, never dropped for it."""
    caplog.set_level(logging.INFO, "kombu_sqlinbox.claims")
    conn, keeper, table = jobs_published(connect, table_prefix, 2)
    first, second = get_within(conn, "jobs"), get_within(conn, "jobs")
    second.ack()
    assert keeper.flush(timeout=10)
    pid = own_pid(keeper)
    with undeletable(engine, database, table, first.delivery_info[ROW_KEY]["id"]):
        first.ack()
        wait_for(lambda: failures_logged(caplog, "jobs"), "the refused ack to be logged")
        assert count_rows(engine, table) == 1
    assert keeper.flush(timeout=10), "the ack did not land once it could"
    assert count_rows(engine, table) == 0
    assert own_pid(keeper) == pid
    assert "settling on the pool" not in caplog.text


def test_acks_that_keep_coming_do_not_wake_the_writing_thread_and_still_land_soon(
    connect: Connect, engine: Engine, table_prefix: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Once an ack was written, the writing thread looks every few milliseconds for a while
    instead of waiting to be woken: the next ack wakes no thread (a consumer acking in
    bursts pays no thread switch per burst) and is written as soon, with no claim or flush
    to carry it."""
    # looking, however slow this machine
    monkeypatch.setattr("kombu_sqlinbox.keeper.SETTLE_ACTIVE", 30.0)
    conn, keeper, table = jobs_published(connect, table_prefix, 2)
    first, second = get_within(conn, "jobs"), get_within(conn, "jobs")
    first.ack()
    wait_for(lambda: count_rows(engine, table) == 1 or None, "the first ack written")
    second.ack()
    assert not keeper._settle_wake.is_set(), "the second ack woke the writing thread"
    wait_for(lambda: count_rows(engine, table) == 0 or None, "the second ack written", 2.0)


def test_a_row_its_tasks_transaction_completed_leaves_with_no_statement_a_fifo_head_settles(
    connect: Connect, engine: Engine, table_prefix: str, caplog: pytest.LogCaptureFixture,
) -> None:
    """``QoS.completed``: a row completed by a transaction of its task's own (fenced by its
    attempt, as a result written with it) leaves the keeper with no statement and no
    report; a FIFO group's head is settled as an ack is (that settlement wakes the
    group's consumers), its fenced completion finding nothing."""
    caplog.set_level(logging.INFO, "kombu_sqlinbox")
    conn = fifo_jobs(connect, table_prefix)
    publish(conn, "plain", {"n": 1})
    broker = broker_of(conn)
    for queue, fifo in (("plain", False), ("jobs", True)):
        message = get_within(conn, queue)
        row, table = message.delivery_info[ROW_KEY], broker.table(queue)
        with broker.engine.begin() as tx:
            assert broker.complete_in(tx, table, row["id"], row["attempt"])
        caplog.clear()
        name = table_of(queue, table_prefix)
        with statements_run(broker.engine, lambda sql, name=name: name in sql) as seen:
            conn.default_channel.qos.completed(message.delivery_tag)
            assert broker.keeper.flush(timeout=10)
        assert bool(seen) is fifo, seen
        assert any("1 of 1 settled rows had already left" in record.getMessage()
                   for record in caplog.records) is fifo
        assert broker.keeper.held_count() == 0
