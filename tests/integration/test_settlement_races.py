"""Settlements and claims racing other writes of their rows, on PostgreSQL (both drivers).

A statement that waits for a row's lock while another transaction updates the row locks
the row's newest version once that transaction commits (READ COMMITTED's recheck). An ack,
requeue or extension that waits for the lease keeper's extension of its row must still
settle it (found by its id and attempt, its recheck follows the row to the new version);
written by the tuple id its lock returned, it would write nothing (the newest version is
not in its snapshot), the row would be forgotten and run again once its lease lapsed.
A claim leases the versions it locked by tuple id: a row written between its snapshot and
its lock is left ready for the next claim, never lost. Rows of one publish are claimed in
id order wherever their versions lie; a declared, partitioned table (a tuple id names a
row in each partition) is claimed and settled by ids.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import pytest
from sqlalchemy import Connection, text
from sqlalchemy.engine import Engine

from kombu_sqlinbox.broker import Broker
from kombu_sqlinbox.rows import ClaimedRow
from kombu_sqlinbox.tables import TableSpec

from .conftest import Connect
from .support import (
    broker_of,
    count_rows,
    get_within,
    never_delivered,
    partitioned_table,
    publish,
    quoted,
)

T = TypeVar("T")

#: the lease of the rows these tests claim (seconds)
LEASE = 30.0
#: both PostgreSQL drivers: psycopg 3 in the postgresql part, psycopg2 in the drivers part
DRIVERS = ["postgresql", "postgresql-psycopg2"]
#: what a race leaves depends on how a driver runs the statements
pytestmark = pytest.mark.drivers


def waiting_for_a_lock(broker: Broker, pid: int | None = None, like: str | None = None,
                       timeout: float = 10.0) -> None:
    """Return once a backend (``pid``, or one running a statement ``like``) waits for a
    lock; fail after ``timeout``."""
    with broker.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as watch:
        until = time.monotonic() + timeout
        while time.monotonic() < until:
            found = watch.execute(text(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                "AND (CAST(:pid AS integer) IS NULL OR pid = CAST(:pid AS integer)) "
                "AND (CAST(:like AS text) IS NULL OR query LIKE CAST(:like AS text))"),
                {"pid": pid, "like": like}).scalar_one()
            if found:
                return
            time.sleep(0.02)
    raise AssertionError(f"no statement came to wait for a lock (pid {pid}, like {like!r})")


def behind(broker: Broker, hold: Callable[[Connection], Any],
           settle: Callable[[Connection], T],
           meanwhile: Callable[[], None] = lambda: None) -> T:
    """``settle`` run in a transaction of its own (another thread) while an open transaction
    that ran ``hold`` keeps the locks of its rows; once ``settle`` waits for them, run
    ``meanwhile``, then commit the holder. What ``settle`` returned."""
    outcome: dict[str, Any] = {}
    started = threading.Event()

    def run() -> None:
        try:
            with broker.engine.connect() as conn:
                outcome["pid"] = conn.execute(text("SELECT pg_backend_pid()")).scalar_one()
                conn.commit()
                started.set()
                with conn.begin():
                    outcome["value"] = settle(conn)
        except BaseException as exc:
            outcome["error"] = exc
        finally:
            started.set()

    thread = threading.Thread(target=run, daemon=True)
    with broker.engine.connect() as holder:
        holder.begin()
        hold(holder)
        thread.start()
        assert started.wait(10)
        if "error" not in outcome:
            waiting_for_a_lock(broker, pid=outcome["pid"])
            meanwhile()
        holder.commit()
    thread.join(15)
    assert not thread.is_alive(), "the settlement never returned"
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]  # type: ignore[no-any-return]


def claimed(broker: Broker, spec: TableSpec, limit: int = 1,
            lease: float = LEASE) -> list[ClaimedRow]:
    with broker.engine.begin() as db:
        return broker.dialect.claim(db, spec, limit, lease)


def extension(broker: Broker, spec: TableSpec,
              rows: list[ClaimedRow]) -> Callable[[Connection], int]:
    """The lease keeper's extension of ``rows`` (its extender thread's statement)."""
    tokens: dict[int, list[int]] = {}
    for row in rows:
        tokens.setdefault(row.attempt, []).append(row.id)
    return lambda db: broker.dialect.extend(db, spec, tokens, LEASE)


def row_state(broker: Broker, spec: TableSpec, row_id: int) -> dict[str, Any] | None:
    table = quoted(broker.engine, spec.table)
    with broker.engine.connect() as db:
        found = db.execute(text(
            f"SELECT attempt, locked_until, available_at > now() + interval '30 seconds' "
            f"AS later FROM {table} WHERE id = :id"), {"id": row_id}).first()
    return None if found is None else dict(found._mapping)


def queue_of(connect: Connect, messages: int = 1, **options: Any) -> tuple[Broker, TableSpec]:
    conn = connect(**options)
    for n in range(messages):
        publish(conn, "jobs", {"n": n})
    broker = broker_of(conn)
    spec = broker.table("jobs").spec
    assert spec.own
    return broker, spec


# -- settlements on held rows, fenced by (attempt, ids), racing the keeper's extension --------

@pytest.mark.parametrize("database", DRIVERS, indirect=True)
@pytest.mark.parametrize("settlement", [
    "complete", "release", "release_uncounted", "retry", "extend"])
def test_a_settlement_that_waited_for_the_keepers_extension_still_settles_the_row(
    connect: Connect, database: str, settlement: str,
) -> None:
    """The keeper extends a held row on its connection while the consumer's ack (release,
    retry...) of it runs on another: the settlement waits for the extension's lock, and
    must settle the row once the extension committed."""
    broker, spec = queue_of(connect)
    dialect = broker.dialect
    (row,) = claimed(broker, spec)
    statement = getattr(dialect.statements(spec), settlement)
    touched = behind(broker, hold=extension(broker, spec, [row]),
                     settle=lambda db: dialect.settle(db, statement, {row.attempt: [row.id]},
                                                      {"lease": LEASE, "delay": 60}))
    state = row_state(broker, spec, row.id)
    assert touched == 1, (f"the {settlement} touched no row: it waited for the extension's "
                          f"lock and missed the row it left ({state})")
    if settlement == "complete":
        assert state is None
    else:
        assert state is not None
        if settlement in ("release", "release_uncounted", "retry"):
            assert state["locked_until"] is None, state
        if settlement == "release_uncounted":
            assert state["attempt"] == row.attempt - 1, state
        if settlement == "retry":
            assert state["later"], state


@pytest.mark.parametrize("database", DRIVERS, indirect=True)
def test_an_ack_folded_into_a_claim_completes_a_row_the_keeper_just_extended(
    connect: Connect, database: str,
) -> None:
    """``claim_completing`` (the consumer's acks written in its next claim's statement)
    waits for the keeper's extension of an acked row: it must still complete it."""
    broker, spec = queue_of(connect, messages=2)
    (row,) = claimed(broker, spec)
    completed, rows = behind(
        broker, hold=extension(broker, spec, [row]),
        settle=lambda db: broker.dialect.complete_and_claim(db, spec, 8, LEASE, row.attempt,
                                                            [row.id]))
    assert (completed, len(rows)) == (1, 1), (
        f"completed {completed} (the acked row left: {row_state(broker, spec, row.id)}), "
        f"claimed {len(rows)}")


@pytest.mark.parametrize("database", DRIVERS, indirect=True)
def test_an_ack_of_many_rows_racing_an_extension_of_some_of_them_completes_them_all(
    connect: Connect, database: str,
) -> None:
    """The settling thread acks a batch while the extender extends the rows held (a
    part of the batch among them): every acked row is deleted."""
    broker, spec = queue_of(connect, messages=6)
    rows = claimed(broker, spec, limit=6)
    assert len(rows) == 6 and len({row.attempt for row in rows}) == 1
    touched = behind(broker, hold=extension(broker, spec, rows[2:4]),
                     settle=lambda db: broker.dialect.settle(
                         db, broker.dialect.statements(spec).complete,
                         {rows[0].attempt: [row.id for row in rows]}))
    left = [row.id for row in rows if row_state(broker, spec, row.id) is not None]
    assert touched == 6 and not left, (touched, f"rows left after their ack: {left}")


@pytest.mark.parametrize("database", DRIVERS, indirect=True)
def test_a_transactional_tasks_completion_that_waited_for_the_keepers_extension_lands(
    connect: Connect, database: str,
) -> None:
    """A transactional task (celery_ext.tasks.complete_row) or a result written with its
    row (celery_ext.results) completes the held row in its own transaction with
    ``Broker.complete_in``; False there rolls the task's writes back as "no longer this
    delivery's". Waiting for the keeper's extension of that very row, it must complete it."""
    broker, spec = queue_of(connect)
    (row,) = claimed(broker, spec)
    table = broker.table("jobs")
    landed = behind(broker, hold=extension(broker, spec, [row]),
                    settle=lambda db: broker.complete_in(db, table, row.id, row.attempt))
    assert landed, f"complete_in found the row gone: {row_state(broker, spec, row.id)}"


# -- the same end to end: an acked message delivered again --------------------------------

@pytest.mark.parametrize("database", ["postgresql"], indirect=True)
def test_a_message_acked_while_its_lease_was_being_extended_is_not_delivered_again(
    connect: Connect, database: str,
) -> None:
    """A consumer acks a message while its lease is being extended (as the keeper's
    extender thread does, on its own connection, every third of the lease): once the
    ack is written (flush), no consumer may receive the message again."""
    consumer = connect(visibility_timeout=2)
    publish(consumer, "jobs", {"n": 1})
    message = get_within(consumer, "jobs")
    broker = broker_of(consumer)
    spec = broker.table("jobs").spec
    table = quoted(broker.engine, spec.table)
    with broker.engine.connect() as extender:
        extender.begin()
        row_id, attempt = extender.execute(text(f"SELECT id, attempt FROM {table}")).one()
        assert broker.dialect.extend(extender, spec, {attempt: [row_id]}, 2.0) == 1
        message.ack()
        waiting_for_a_lock(broker, like="%DELETE FROM%")
        extender.commit()
    assert broker.keeper.flush(timeout=10)
    rival = connect(visibility_timeout=2, polling_interval=0.06)  # another worker
    never_delivered(rival, ["jobs"], 4.0)
    assert count_rows(broker.engine, spec.table) == 0


# -- the claim: leased by the tuple ids its subquery locked --------------------------------

@pytest.mark.parametrize("database", DRIVERS, indirect=True)
def test_a_row_released_while_a_completing_claim_waited_is_left_ready_for_the_next_claim(
    connect: Connect, database: str,
) -> None:
    """A completing claim waits for the lock of a row it acks (here only locked, so the
    ack itself is not at stake); meanwhile a consumer whose lease lapsed gives its row
    back. The claim's subquery locks that row's newest version, which the lease (by tuple
    id, on the claim's snapshot) does not see: the row is not leased by this claim, its
    attempt not counted, and the next claim takes it."""
    broker, spec = queue_of(connect, messages=2)
    dialect = broker.dialect
    table = quoted(broker.engine, spec.table)
    (acked,) = claimed(broker, spec)
    (lapsed,) = claimed(broker, spec, lease=0.01)  # another consumer's, its lease lapsed
    time.sleep(0.1)

    def give_back() -> None:
        with broker.engine.begin() as db:
            db.execute(text("SET LOCAL lock_timeout = '3s'"))
            assert dialect.settle(db, dialect.statements(spec).release,
                                  {lapsed.attempt: [lapsed.id]}) == 1

    completed, rows = behind(
        broker, hold=lambda db: db.execute(text(f"SELECT id FROM {table} WHERE id = :id "
                                                "FOR UPDATE"), {"id": acked.id}),
        settle=lambda db: dialect.complete_and_claim(db, spec, 8, LEASE, acked.attempt,
                                                     [acked.id]),
        meanwhile=give_back)
    assert completed == 1
    assert rows == [], rows
    state = row_state(broker, spec, lapsed.id)
    assert state is not None and state["locked_until"] is None, state
    assert state["attempt"] == lapsed.attempt, state
    (again,) = claimed(broker, spec)
    assert (again.id, again.attempt) == (lapsed.id, lapsed.attempt + 1)


@pytest.mark.parametrize("database", DRIVERS, indirect=True)
def test_rows_of_one_publish_are_claimed_in_id_order_wherever_their_versions_lie(
    connect: Connect, database: str,
) -> None:
    """Rows published in one transaction share their ready time; the claim takes them by
    priority, then id, not by where their versions lie in the table (an update moves a
    version to the end of its page)."""
    conn = connect()
    conn.default_channel.queue_declare("jobs")
    broker = broker_of(conn)
    dialect, spec = broker.dialect, broker.table("jobs").spec
    table = quoted(broker.engine, spec.table)
    priorities = [0, 0, 0, 0, 0, 3, 3, 0, 0, 0]
    with broker.engine.begin() as db:
        dialect.publish(db, spec, [dialect.publish_params(spec, b"%d" % n, "{}", priority=p)
                                   for n, p in enumerate(priorities)])
    with broker.engine.begin() as db:
        # the first rows' versions moved after the others' (as a lapsed lease's release
        # would); ready times unchanged
        db.execute(text(f"UPDATE {table} SET headers = headers WHERE id IN "
                        f"(SELECT id FROM {table} ORDER BY id LIMIT 3)"))
        placed = db.execute(text(f"SELECT id, ctid, available_at FROM {table} "
                                 "ORDER BY id")).all()
    assert len({row.available_at for row in placed}) == 1
    by_ctid = [row.id for row in sorted(placed, key=lambda row: tuple(
        int(part) for part in str(row.ctid).strip("()").split(",")))]
    assert by_ctid != [row.id for row in placed], "precondition: versions out of id order"
    taken = []
    for _ in range(4):
        taken += [row.payload for row in claimed(broker, spec, limit=3)]
    assert taken == [b"5", b"6", b"0", b"1", b"2", b"3", b"4", b"7", b"8", b"9"]


@pytest.mark.parametrize("database", DRIVERS, indirect=True)
def test_racing_consumers_never_hold_one_row_at_once_and_every_ack_lands(
    connect: Connect, database: str,
) -> None:
    """Four consumers claim and ack at once, each extending its own held rows all the
    while on a connection of its own (as its keeper's extender thread does): no row is
    claimed twice, and every ack touches every row it acks."""
    messages = 300
    broker, spec = queue_of(connect)
    dialect = broker.dialect
    with broker.engine.begin() as db:
        dialect.publish(db, spec, [dialect.publish_params(spec, b"%d" % n, "{}")
                                   for n in range(messages - 1)])
    seen: list[int] = []
    missed: list[tuple[int, int]] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def worker() -> None:
        try:
            while True:
                rows = claimed(broker, spec, limit=5)
                if not rows:
                    return
                with lock:
                    seen.extend(row.id for row in rows)
                tokens = {rows[0].attempt: [row.id for row in rows]}
                stop = threading.Event()

                def extend_loop(tokens: dict[int, list[int]] = tokens,
                                stop: threading.Event = stop) -> None:
                    while not stop.is_set():
                        with broker.engine.begin() as db:
                            dialect.extend(db, spec, tokens, LEASE)

                extender = threading.Thread(target=extend_loop)
                extender.start()
                time.sleep(0.005)
                with broker.engine.begin() as db:
                    touched = dialect.settle(db, dialect.statements(spec).complete, tokens)
                stop.set()
                extender.join()
                if touched != len(rows):
                    with lock:
                        missed.append((touched, len(rows)))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors, errors
    assert sorted(seen) == sorted(set(seen)), "a row was claimed twice"
    assert not missed, f"acks that missed rows the extender had just extended: {missed}"
    assert count_rows(broker.engine, spec.table) == 0


# -- a declared table may be partitioned: a tuple id names a row in each partition -------

@pytest.mark.parametrize("database", ["postgresql"], indirect=True)
def test_a_declared_partitioned_table_claims_and_settles_exactly_its_rows(
    connect: Connect, database: str, table_prefix: str, engine: Engine,
) -> None:
    """Rows 1-2 and 3-4 lie in two partitions, at the same tuple ids: claims, extensions,
    acks and the completing claim touch exactly the rows they name."""
    name = f"{table_prefix}parts"
    conn = connect(queues={"jobs": {"table": partitioned_table(engine, name)}})
    broker = broker_of(conn)
    for n in range(5):
        publish(conn, "jobs", {"n": n})
    table = broker.table("jobs").spec
    assert not table.own
    dialect = broker.dialect
    with broker.engine.connect() as db:
        places = db.execute(text(f'SELECT id, ctid::text FROM "{name}" ORDER BY id')).all()
    assert places[0][1] == places[2][1]  # the same tuple id in each partition
    first = claimed(broker, table, limit=2)
    assert [row.id for row in first] == [1, 2]
    with broker.engine.begin() as db:
        assert dialect.extend(db, table, {first[0].attempt: [1]}, LEASE) == 1
        assert dialect.settle(db, dialect.statements(table).complete,
                              {first[0].attempt: [1]}) == 1
    assert [row.id for row in claimed(broker, table, limit=1)] == [3]
    with broker.engine.begin() as db:
        completed, rows = dialect.complete_and_claim(db, table, 8, LEASE, first[1].attempt, [2])
    assert (completed, sorted(row.id for row in rows)) == (1, [4, 5])
    with broker.engine.connect() as db:
        left = db.execute(text(f'SELECT id, attempt FROM "{name}" ORDER BY id')).all()
    assert [tuple(row) for row in left] == [(3, 1), (4, 1), (5, 1)]


# -- the completion by ids run again (Statements.complete_again): counts, fences, paths ----

def limited_queue(connect: Connect, messages: int) -> tuple[Broker, Any, Any]:
    """A queue whose rows all share one limit key with one slot: its claims take the
    limiter's whole claim (one statement), completing the acked rows first."""
    conn = connect(queues={"jobs": {"concurrency_limits": {"*": 1}}})
    for n in range(messages):
        publish(conn, "jobs", {"n": n}, limit_key="k")
    broker = broker_of(conn)
    table = broker.table("jobs")
    assert table.spec.own
    broker.limits.ensure()
    reads = broker.dialect.limited_claim(table.spec, broker.limits.prefix)
    assert reads.whole_completing is not None
    return broker, table, reads


@pytest.mark.parametrize("database", DRIVERS, indirect=True)
def test_a_limited_claim_completing_a_row_the_keeper_just_extended_completes_it(
    connect: Connect, database: str,
) -> None:
    """The limiter's whole claim embeds the completion (``whole_completing``): waiting
    for the keeper's extension of the acked row, the row must still be completed, counted
    once, and its key's slot free for the next claim."""
    broker, table, reads = limited_queue(connect, messages=2)
    limits, spec = broker.limits, table.spec
    with broker.engine.begin() as db:
        completed, (row,), more = limits._claim_whole(db, table, reads, 1, 0, [])
    assert (completed, more) == (0, False)
    completed, rows, more = behind(
        broker, hold=extension(broker, spec, [row]),
        settle=lambda db: limits._claim_whole(db, table, reads, 1, row.attempt, [row.id]))
    assert completed == 1, (completed, row_state(broker, spec, row.id))
    assert row_state(broker, spec, row.id) is None
    if not rows:  # the slot of the row missed looked held to the claim's statement
        with broker.engine.begin() as db:
            _, rows, _ = limits._claim_whole(db, table, reads, 1, 0, [])
    assert len(rows) == 1 and rows[0].id != row.id, rows


def reclaim_paths(broker: Broker, spec: TableSpec, path: str, row: ClaimedRow,
                  reads: Any = None) -> Callable[[Connection], int]:
    """The ack of ``row`` at its (stale) attempt through one completion path; how many
    rows it completed."""
    dialect = broker.dialect
    if path == "settle":
        return lambda db: dialect.settle(db, dialect.statements(spec).complete,
                                         {row.attempt: [row.id]})
    if path == "complete_and_claim":
        return lambda db: dialect.complete_and_claim(db, spec, 8, LEASE, row.attempt,
                                                     [row.id])[0]
    if path == "complete_in":
        table = broker.table("jobs")
        return lambda db: int(broker.complete_in(db, table, row.id, row.attempt))
    assert path == "limited"
    table = broker.table("jobs")
    return lambda db: broker.limits._claim_whole(db, table, reads, 1, row.attempt,
                                                 [row.id])[0]


@pytest.mark.parametrize("database", DRIVERS, indirect=True)
@pytest.mark.parametrize("path", ["settle", "complete_and_claim", "complete_in", "limited"])
def test_an_ack_that_waited_while_another_consumer_claimed_its_row_again_leaves_it(
    connect: Connect, database: str, path: str,
) -> None:
    """A consumer's lease lapsed; another consumer claims the row (attempt bumped) while
    the first one's ack waits for that claim's lock: neither the completion nor the
    completion run again may delete the row now held by the other consumer."""
    if path == "limited":
        broker, table, reads = limited_queue(connect, messages=1)
        spec = table.spec
    else:
        broker, spec = queue_of(connect)
        reads = None
    (stale,) = claimed(broker, spec, lease=0.01)
    time.sleep(0.1)
    taken: list[ClaimedRow] = []

    def claim_again(db: Connection) -> None:
        if path == "limited":
            taken.extend(broker.limits._claim_whole(db, broker.table("jobs"), reads, 1, 0,
                                                    [])[1])
        else:
            taken.extend(broker.dialect.claim(db, spec, 1, LEASE))

    completed = behind(broker, hold=claim_again,
                       settle=reclaim_paths(broker, spec, path, stale, reads))
    assert [row.id for row in taken] == [stale.id]
    state = row_state(broker, spec, stale.id)
    assert completed == 0, (completed, state)
    assert state is not None, "the stale ack deleted the row another consumer holds"
    assert state["attempt"] == stale.attempt + 1 and state["locked_until"] is not None, state


@pytest.mark.parametrize("database", DRIVERS, indirect=True)
@pytest.mark.parametrize("path", ["settle", "complete_and_claim"])
def test_an_ack_counts_each_row_it_completed_once_whatever_ids_it_was_given(
    connect: Connect, database: str, path: str,
) -> None:
    """Ids acked twice and a row already gone (the completion finds fewer rows than ids,
    so the completion by ids runs again) while the keeper extends one of them: the count
    is the rows deleted, each once."""
    broker, spec = queue_of(connect, messages=4)
    dialect = broker.dialect
    rows = claimed(broker, spec, limit=3)
    a, b, gone = rows
    with broker.engine.begin() as db:
        assert dialect.settle(db, dialect.statements(spec).complete,
                              {gone.attempt: [gone.id]}) == 1
    ids = [a.id, a.id, b.id, gone.id]
    if path == "settle":
        def settle(db: Connection) -> int:
            return dialect.settle(db, dialect.statements(spec).complete, {a.attempt: ids})
    else:
        def settle(db: Connection) -> int:
            completed, claimed_rows = dialect.complete_and_claim(db, spec, 8, LEASE,
                                                                 a.attempt, ids)
            assert len(claimed_rows) == 1
            return completed
    touched = behind(broker, hold=extension(broker, spec, [b]), settle=settle)
    assert touched == 2, touched
    assert row_state(broker, spec, a.id) is None and row_state(broker, spec, b.id) is None


@pytest.mark.parametrize("database", DRIVERS, indirect=True)
def test_a_transactional_completion_in_repeatable_read_never_misses_silently(
    connect: Connect, database: str,
) -> None:
    """A task's transaction in REPEATABLE READ completes its row while the keeper's
    extension of it holds the lock: the completion fails as a serialization failure (the
    task's transaction is retried) or completes the row; it must never report the row
    gone (its writes rolled back as another delivery's) while the row stays held."""
    from sqlalchemy.exc import DBAPIError

    broker, spec = queue_of(connect)
    (row,) = claimed(broker, spec)
    table = broker.table("jobs")

    def complete(db: Connection) -> bool:
        db.exec_driver_sql("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        return broker.complete_in(db, table, row.id, row.attempt)

    try:
        landed = behind(broker, hold=extension(broker, spec, [row]), settle=complete)
    except DBAPIError as exc:
        assert broker.dialect.driver_error_code(exc) == "40001", exc
        assert row_state(broker, spec, row.id) is not None
        return
    assert landed and row_state(broker, spec, row.id) is None, (
        landed, row_state(broker, spec, row.id))
