"""The database layer, and the claim forms and lease keeper on it with no broker: what
each takes is a database, a keeper and a wake-up callback.

Each test asks for ``table_prefix`` first, so its tables are dropped only after the
keeper stopped."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator

import pytest
from sqlalchemy import Connection
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError

from kombu_sqlinbox import ConfigurationError, TableBuilder, TableSpec, default_table
from kombu_sqlinbox.claims import ClaimForm, LeaseClaims, RowLockClaims
from kombu_sqlinbox.database import Database
from kombu_sqlinbox.dialects.sqlite import SQLiteDialect
from kombu_sqlinbox.keeper import LeaseKeeper
from kombu_sqlinbox.options import QueueOptions
from kombu_sqlinbox.rows import ClaimedRow, QueueTable, Settlement
from tests.tcp_proxy import Proxy

from .support import count_rows, exit_code_within, rows, wait_for


@pytest.fixture
def db(db_url: str) -> Iterator[Database]:
    made = Database.open(db_url)
    yield made
    made.engine.dispose()


@pytest.fixture
def woken() -> threading.Event:
    """Set by the keeper's wake-up callback."""
    return threading.Event()


@pytest.fixture
def keeper(db: Database, woken: threading.Event) -> Iterator[LeaseKeeper]:
    made = LeaseKeeper(db, wake=woken.set)
    yield made
    made.stop(timeout=5)


def queue_table(db: Database, spec: TableSpec, claims: ClaimForm,
                lease: float = 30.0) -> QueueTable:
    """The table created and checked as the broker does on first use."""
    payload_is_text = db.run(lambda conn: db.dialect.ensure_table(conn, spec, True),
                             read_only=True)
    return QueueTable("jobs", spec, QueueOptions(visibility_timeout=lease), payload_is_text,
                      True, claims)


def publish(db: Database, table: QueueTable, *bodies: str, group: str | None = None) -> None:
    params = [db.dialect.insert_params(body if table.payload_is_text else body.encode(), None,
                                       0, None, group=group) for body in bodies]
    db.run(lambda conn: db.dialect.publish(conn, table.spec, params))


def bodies(claimed: list[ClaimedRow]) -> list[str]:
    return [row.payload if isinstance(row.payload, str) else row.payload.decode()
            for row in claimed]


@pytest.mark.databases("postgresql", "mysql")  # a file has no connection to lose
def test_work_whose_commit_reply_is_lost_runs_again_only_when_repeatable(
    table_prefix: str, db_url: str, engine: Engine, proxy: Proxy,
) -> None:
    """Whether a commit whose reply was lost landed is unknown: the database layer runs
    the work again only when its caller said that is harmless."""
    db = Database.open(proxy.url(db_url))
    name = f"{table_prefix}jobs"
    spec = default_table(name)
    runs: list[None] = []

    def work(conn: Connection) -> None:
        runs.append(None)
        db.dialect.publish(conn, spec, [db.dialect.insert_params(b"m", None, 0, None)])

    try:
        db.run(lambda conn: db.dialect.ensure_table(conn, spec, True))
        proxy.cut_after_commit()
        with pytest.raises(DBAPIError):
            db.run(work)
        assert (len(runs), count_rows(engine, name)) == (1, 1)
        # a fresh connection's set-up (MySQL's READ COMMITTED) must not be what is cut
        db.ping()
        proxy.cut_after_commit()
        db.run(work, repeatable=True)
        assert proxy.commits_cut == 2
        assert (len(runs), count_rows(engine, name)) == (3, 3)
    finally:
        db.engine.dispose()


def test_lease_claims_take_ready_rows_in_order_and_hand_them_to_the_keeper(
    table_prefix: str, db: Database, keeper: LeaseKeeper,
) -> None:
    form = LeaseClaims(db, keeper)
    table = queue_table(db, default_table(f"{table_prefix}jobs"), form)
    publish(db, table, "m0", "m1", "m2")
    first = form.claim(table, 2)
    assert bodies(first) == ["m0", "m1"]
    assert [row.attempt for row in first] == [1, 1]
    assert keeper.held_count() == 2
    assert bodies(form.claim(table, 5)) == ["m2"]
    assert form.claim(table, 5) == []
    assert keeper.held_count() == 3


def test_the_keeper_extends_a_held_lease_until_the_row_settles(
    table_prefix: str, db: Database, engine: Engine, keeper: LeaseKeeper,
    woken: threading.Event,
) -> None:
    """A held row stays with its holder past the lease its first extension gave it (a
    rival form with a keeper of its own, as in another process, gets nothing): the keeper
    extended it again; the ack then deletes it.

    The lease is 3 s: the keeper extends it every second, so an extension may come two
    seconds late (a loaded machine's stalled thread or slow commit) before it lapses."""
    lease = 3
    form = LeaseClaims(db, keeper)
    name = f"{table_prefix}jobs"
    table = queue_table(db, default_table(name), form, lease=lease)
    publish(db, table, "m0")
    (row,) = form.claim(table, 1)
    (claimed,) = rows(engine, name)
    wait_for(lambda: rows(engine, name)[0]["locked_until"] > claimed["locked_until"],
             "the keeper to extend the lease", timeout=10)
    rival_keeper = LeaseKeeper(db, wake=lambda: None)
    rival = LeaseClaims(db, rival_keeper)
    try:
        # the extension just seen gave the row a lease to a time before this one's end
        until = time.monotonic() + lease + 0.5
        while time.monotonic() < until:
            assert rival.claim(table, 1) == [], "a held row was claimed again"
            time.sleep(0.1)
    finally:
        rival_keeper.stop(timeout=5)
    form.settle(Settlement.COMPLETE, form.held_for(table, row))
    assert keeper.flush(timeout=10)
    assert rows(engine, name) == []
    assert keeper.held_count() == 0
    assert not woken.is_set(), "no row waited behind this one"


def test_a_keeper_used_in_a_forked_child_starts_threads_of_its_own(
    table_prefix: str, db: Database, keeper: LeaseKeeper, engine: Engine,
) -> None:
    """A child forked while the keeper's threads run has none of them: its first
    settlement starts the child's own, which write it."""
    spec = default_table(f"{table_prefix}forked")
    form = LeaseClaims(db, keeper)
    table = queue_table(db, spec, form)
    publish(db, table, "a", "b")
    first, second = form.claim(table, 2)
    form.settle(Settlement.COMPLETE, form.held_for(table, first))
    assert keeper.flush(timeout=10)  # the parent's threads run
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            db.engine.dispose(close=False)  # the parent's connections stay the parent's
            form.settle(Settlement.COMPLETE, form.held_for(table, second))
            code = 0 if keeper.flush(timeout=10) else 2
        finally:
            os._exit(code)
    assert exit_code_within(pid, 30) == 0, "the child's settlement was not written"
    assert rows(engine, spec.table) == []


def test_a_child_forked_while_a_keeper_thread_holds_its_lock_settles_all_the_same(
    table_prefix: str, db: Database, keeper: LeaseKeeper, engine: Engine,
) -> None:
    """A pool process forked while one of the parent's threads is inside the keeper (here
    a thread holding its lock across the fork, as the settling thread does for an
    instant every few milliseconds): the child's copy of that lock would be held for
    ever and its first settlement hang. The child begins the keeper afresh."""
    spec = default_table(f"{table_prefix}forklock")
    form = LeaseClaims(db, keeper)
    table = queue_table(db, spec, form)
    publish(db, table, "a")
    (row,) = form.claim(table, 1)
    inside, leave = threading.Event(), threading.Event()

    def hold_the_lock() -> None:
        with keeper._lock:
            inside.set()
            leave.wait(10)

    holder = threading.Thread(target=hold_the_lock)
    holder.start()
    assert inside.wait(10)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            db.engine.dispose(close=False)
            form.settle(Settlement.COMPLETE, form.held_for(table, row))
            code = 0 if keeper.flush(timeout=10) else 2
        finally:
            os._exit(code)
    leave.set()
    holder.join(10)
    assert exit_code_within(pid, 30) == 0, "the child's settlement hung or was not written"
    assert rows(engine, spec.table) == []
    assert keeper.held_count() == 1, "the parent still holds (and extends) its row"


def test_settling_a_fifo_head_calls_the_wake_up(
    table_prefix: str, db: Database, keeper: LeaseKeeper, woken: threading.Event,
) -> None:
    """The row behind a FIFO group's head is claimable only once the head settled: the
    keeper then calls the wake-up, so a waiting consumer claims it without polling."""
    spec = (TableBuilder(f"{table_prefix}fifo").id().payload().headers()
            .group("customer", fifo=True).priority().available_at().locked_until().attempt()
            .build())
    form = LeaseClaims(db, keeper)
    table = queue_table(db, spec, form)
    publish(db, table, "head", "next", group="c1")
    (head,) = form.claim(table, 5)
    assert bodies([head]) == ["head"]
    assert form.claim(table, 5) == []
    form.settle(Settlement.COMPLETE, form.held_for(table, head))
    assert woken.wait(timeout=10), "the keeper did not call the wake-up"
    assert bodies(form.claim(table, 5)) == ["next"]


@pytest.mark.databases("postgresql", "mysql")
def test_row_lock_claims_hold_a_connection_per_row_until_it_settles(
    table_prefix: str, db: Database, engine: Engine,
) -> None:
    form = RowLockClaims(db)
    name = f"{table_prefix}jobs"
    table = queue_table(db, default_table(name), form)
    form.check(table.queue)
    publish(db, table, "m0", "m1")
    free = form.capacity()
    done, released = form.claim(table, 2)
    assert bodies([done, released]) == ["m0", "m1"]
    assert form.capacity() == free - 2
    form.settle(Settlement.COMPLETE, form.held_for(table, done))
    form.settle(Settlement.RELEASE, form.held_for(table, released))
    assert form.capacity() == free
    assert [(row["id"], row["attempt"]) for row in rows(engine, name)] == [(released.id, 1)]
    (again,) = form.claim(table, 2)
    assert (again.id, again.attempt) == (released.id, 2)
    form.settle(Settlement.COMPLETE, form.held_for(table, again))
    assert rows(engine, name) == []


@pytest.mark.databases("sqlite")
def test_an_idle_consumers_claims_take_no_write_lock(
    table_prefix: str, db: Database, keeper: LeaseKeeper, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """While another transaction holds the file's write lock (here one publishing), claims
    of a queue with nothing ready -- a row in work, none waiting -- read and return at
    once instead of waiting for the lock (and failing after the busy timeout); the row
    published is claimed by the first round after its commit."""
    monkeypatch.setattr(SQLiteDialect, "busy_timeout", 0.2)  # a wait fails in seconds
    form = LeaseClaims(db, keeper)
    table = queue_table(db, default_table(f"{table_prefix}jobs"), form)
    publish(db, table, "m0")
    assert bodies(form.claim(table, 5)) == ["m0"]
    assert form.claim(table, 5) == []  # the queue is idle from now on
    with db.engine.begin() as conn:  # BEGIN IMMEDIATE: the write lock
        db.dialect.publish(conn, table.spec, [db.dialect.insert_params(b"m1", None, 0, None)])
        for _ in range(5):
            assert form.claim(table, 5) == []
    assert bodies(form.claim(table, 5)) == ["m1"]
    assert bodies(form.claim(table, 5)) == []


@pytest.mark.databases("sqlite")
def test_row_lock_claims_are_refused_without_row_locks(db: Database) -> None:
    with pytest.raises(ConfigurationError, match="needs row or advisory locks"):
        RowLockClaims(db).check("jobs")
