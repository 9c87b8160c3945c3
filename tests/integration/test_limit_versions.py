"""Concurrency limits under racing claimers, over every claim form a limited queue takes:
a slot never names an attempt its row has not reached, and no key (nor a queue with
``max_in_work``) ever has more rows leased than its limit. Processes claim within the
limits and give rows back (uncounted, with their slots) or requeue them (counted), or
consume and acknowledge (the acks folded into the next claim) and publish anew; others
lease rows by id and give them back in the same transaction, so that claims lock rows
in versions newer than their snapshots."""

from __future__ import annotations

import contextlib
import multiprocessing
import random
import time
from functools import partial
from multiprocessing.synchronize import Event
from typing import Any

import pytest
from kombu import Connection, Consumer, Message, Queue
from sqlalchemy import Connection as SqlConnection
from sqlalchemy import text
from sqlalchemy.engine import Engine

from kombu_sqlinbox import TableBuilder
from kombu_sqlinbox.rows import ClaimedRow, Held

from .support import broker_of, partitioned_table, publish, quoted, spawned

QUEUE = "limited"
#: the longest wait for a child to start or stop
WAIT = 60.0
#: the limit of each key; and of the queue where it has ``max_in_work``
LIMIT, MAX_IN_WORK = 2, 5
KEYS = 6


def queue_options(layout: str, prefix: str) -> dict[str, Any]:
    """``own``: the transport's table; ``priority``: the same, rows of three priorities;
    ``declared``: a declared table with a priority column (leased by ids, not tuple ids);
    ``queue``: the transport's table with ``max_in_work`` too (the claim of several
    statements)."""
    options: dict[str, Any] = {"visibility_timeout": 60,
                               "concurrency_limits": {"*": LIMIT}}
    if layout == "declared":
        options["table"] = (TableBuilder(f"{prefix}declared").id().payload().headers()
                            .priority().available_at().locked_until().attempt().build())
    if layout == "queue":
        options["max_in_work"] = MAX_IN_WORK
    return options


def churn(broker_url: str, options: dict[str, Any], mode: str, ready: Event, stop: Event,
          rounds: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    """Until ``stop``, by ``mode``: ``claim`` within the limits and give the rows back
    uncounted or requeue them, at random; ``by_ids``: lease the first free rows by id and
    give them back in the same transaction; ``consume``: a consumer that acknowledges
    what it gets (the acks folded into its next claims) and publishes a row of the same
    key for each. Put how many rounds touched rows in ``rounds``."""
    done = 0
    rng = random.Random()
    with Connection(broker_url, transport_options=options) as conn:
        broker = broker_of(conn)
        channel = conn.default_channel
        channel.queue_declare(QUEUE)
        table = broker.table(QUEUE)
        name = quoted(broker.engine, table.spec.table)
        statements = broker.dialect.statements(table.spec)

        def settle(db: SqlConnection, claimed: list[ClaimedRow]) -> int:
            back: dict[int, list[int]] = {}
            requeued: dict[int, list[int]] = {}
            for row in claimed:
                (back if rng.random() < 0.5 else requeued).setdefault(
                    row.attempt, []).append(row.id)
            touched = broker.limits.give_back(db, table, back) if back else 0
            return touched + broker.dialect.settle(db, statements.release, requeued)

        def lease_and_give_back(db: SqlConnection) -> int:
            ids = list(db.execute(text(
                f"SELECT id FROM {name} WHERE locked_until IS NULL ORDER BY id "
                f"LIMIT {rng.randint(2, 8)}")).scalars())
            leased = broker.dialect.claim(db, table.spec, len(ids), 60.0, ids=ids)
            tokens: dict[int, list[int]] = {}
            for row in leased:
                tokens.setdefault(row.attempt, []).append(row.id)
            return broker.limits.give_back(db, table, tokens) if tokens else 0

        got: list[Message] = []
        consumer = None
        if mode == "consume":
            consumer = Consumer(channel, [Queue(QUEUE, routing_key=QUEUE)],
                                callbacks=[lambda body, message: got.append(message)],
                                prefetch_count=3)
            consumer.consume()
        ready.set()
        while not stop.is_set():
            if mode == "by_ids":
                done += bool(broker.database.run(lease_and_give_back))
            elif mode == "claim":
                claimed = broker.limits.claim(table, 4)
                for row in claimed:  # settled here, not by the keeper
                    broker.keeper.forget(Held(table, row.id, row.attempt))
                done += bool(broker.database.run(partial(settle, claimed=claimed)))
            else:
                with contextlib.suppress(TimeoutError):
                    conn.drain_events(timeout=0.05)
                for message in got:
                    key = message.headers["limit_key"]
                    message.ack()
                    publish(conn, QUEUE, {"n": 0}, limit_key=key,
                            priority=rng.choice((0, 0, 5)))
                done += bool(got)
                got.clear()
        if consumer is not None:
            consumer.cancel()
    rounds.put(done)


def in_work(db: SqlConnection, engine: Engine, table: str) -> dict[str | None, int]:
    """The rows of each key leased now (no lease lapses here), as the dashboard counts
    them."""
    counts: dict[str | None, int] = {}
    if engine.dialect.name == "postgresql":
        key = "CAST(headers AS json) -> 'headers' ->> 'limit_key'"
    else:
        key = "json_extract(headers, '$.headers.limit_key')"
    for limit_key, count in db.execute(text(
            f"SELECT {key}, COUNT(*) FROM {table} WHERE locked_until IS NOT NULL "
            f"GROUP BY {key}")):
        counts[None if limit_key is None else str(limit_key)] = int(count)
    return counts


#: every layout on PostgreSQL, whose claim of a limited queue is one statement on most;
#: MariaDB and SQLite claim by several statements whatever the layout
LAYOUTS = [*(("postgresql", layout) for layout in ("own", "priority", "declared", "queue")),
           *((database, layout) for database in ("mysql", "sqlite")
             for layout in ("own", "queue"))]


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("database", "layout"), LAYOUTS, indirect=["database"])
def test_racing_claims_keep_every_slot_and_limit(
        broker_url: str, engine: Engine, table_prefix: str, database: str,
        layout: str) -> None:
    """Two claimers, two consumers acknowledging and publishing anew, two leasing rows by
    id and giving them back, for 6 s: polled from the tables, no slot names an attempt
    past its row's, no key has more than LIMIT rows leased, a queue with max_in_work
    no more than that. Before claims matched only rows locked in the version their
    snapshot shows to slots, PostgreSQL's failed within 2 s (own tables) and 4 s
    (declared)."""
    options = {"table_prefix": table_prefix, "polling_interval": 0.01,
               "queues": {QUEUE: queue_options(layout, table_prefix)}}
    with Connection(broker_url, transport_options=options) as conn:
        for n in range(60):
            publish(conn, QUEUE, {"n": n}, limit_key=f"k{n % KEYS}",
                    priority=(0, 5, 9)[n % 3] if layout != "own" else 0)
        broker = broker_of(conn)
        broker.limits.ensure()
        table = quoted(engine, broker.table(QUEUE).spec.table)
    slots = quoted(engine, f"{table_prefix}limit_slots")
    modes = ["claim", "claim", "consume", "consume", "by_ids", "by_ids"]
    ahead: list[Any] = []
    over: dict[str | None, int] = {}
    polls = 0
    with spawned(churn, [(broker_url, options, mode) for mode in modes], WAIT) as done:
        until = time.monotonic() + 6.0
        with engine.connect() as db:
            while time.monotonic() < until and not ahead and not over:
                ahead = list(db.execute(text(
                    f"SELECT s.holder_id, s.holder_attempt, r.attempt FROM {slots} AS s "
                    f"JOIN {table} AS r ON r.id = s.holder_id "
                    "WHERE s.holder_attempt > r.attempt")))
                counts = in_work(db, engine, table)
                over = {key: n for key, n in counts.items()
                        if key is not None and n > LIMIT}
                if layout == "queue" and sum(counts.values()) > MAX_IN_WORK:
                    over[None] = sum(counts.values())
                db.rollback()
                polls += 1
    assert not ahead, f"slots naming attempts their rows have not reached: {ahead}"
    assert not over, f"past the limit: {over} ({polls} polls)"
    assert all(done), done


@pytest.mark.parametrize("database", ["postgresql"], indirect=True)
def test_a_partitioned_declared_table_is_claimed_within_its_limits(
        broker_url: str, engine: Engine, table_prefix: str, database: str) -> None:
    """Rows 1-2 and 3-4 lie in two partitions at the same tuple ids, each key at limit 1:
    the whole claim (one statement) leases one row of each key, and the next claim none
    until they are given back; then the other row of each key. A row is matched to a slot
    by the version its own partition shows, never by another partition's row at its tuple
    id."""
    name = f"{table_prefix}parts"
    spec = partitioned_table(engine, name)
    options = {"table_prefix": table_prefix, "queues": {QUEUE: {
        "table": spec, "visibility_timeout": 60, "concurrency_limits": {"*": 1}}}}
    with Connection(broker_url, transport_options=options) as conn:
        for n, key in enumerate(["a", "b", "a", "b"]):
            publish(conn, QUEUE, {"n": n}, limit_key=key)
        broker = broker_of(conn)
        table = broker.table(QUEUE)
        assert not table.spec.own
        with engine.connect() as db:
            places = db.execute(text(f'SELECT id, ctid::text FROM "{name}" ORDER BY id')).all()
        assert places[0][1] == places[2][1]  # the same tuple id in each partition
        broker.limits.ensure()
        reads = broker.dialect.limited_claim(table.spec, broker.limits.prefix)
        assert reads.whole is not None
        first = broker.limits.claim(table, 8)
        assert sorted(row.id for row in first) == [1, 2]
        assert broker.limits.claim(table, 8) == []
        tokens: dict[int, list[int]] = {}
        for row in first:
            tokens.setdefault(row.attempt, []).append(row.id)
        assert broker.database.run(lambda db: broker.limits.give_back(db, table, tokens)) == 2
        for row in first:
            broker.keeper.forget(Held(table, row.id, row.attempt))
        with engine.begin() as db:  # ready again, behind rows 3 and 4
            db.execute(text(f'UPDATE "{name}" SET available_at = now() + interval \'1 hour\' '
                            "WHERE id IN (1, 2)"))
        second = broker.limits.claim(table, 8)
        assert sorted(row.id for row in second) == [3, 4]
