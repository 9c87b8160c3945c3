"""Bulk publish: tasks sent inside ``celery_ext.bind`` are written as one multi-row INSERT.

The rows of a bound block are held and written when the caller commits (or a savepoint
begins or ends, or the block ends): one statement per queue table, in the order sent,
each row with its own options. They exist only if the caller commits; a rollback, also
to a savepoint, drops what it covers. A declared publish statement runs per row, and
a transaction another framework commits (Django's) is not batched.
"""

from __future__ import annotations

import json
import time
from contextlib import AbstractContextManager
from datetime import datetime, timedelta, timezone
from functools import partial
from typing import Any

import pytest
from celery import group
from kombu import Connection
from sqlalchemy import Engine, text

import celery_ext
from celery_ext.binding import defer_with
from kombu_sqlinbox import TableBuilder
from tests.integration.support import get, get_within, statements_run
from tests.ordering.apps.common import check_serial_in_order, transport_options
from tests.ordering.conftest import Ordering, wait_for_count
from tests.ordering.test_wakeups import arrivals, arrived
from tests.processes import wait_until

GROUPS, ROWS = 5, 40


def inserts_into(engine: Engine, table: str) -> AbstractContextManager[list[str]]:
    """The INSERT statements into ``table`` run on ``engine``'s connections in the block."""
    return statements_run(engine, lambda sql: "INSERT" in sql.upper() and table in sql)


def rows_of(engine: Engine, table: str, columns: str = "id") -> list[Any]:
    """What a connection of our own sees committed in ``table``, in id order."""
    quoted = engine.dialect.identifier_preparer.quote(table)
    with engine.connect() as conn:
        return list(conn.execute(text(f"SELECT {columns} FROM {quoted} ORDER BY id")))


@pytest.mark.slow
def test_a_bound_group_and_delay_loop_are_one_insert_and_run_once_in_order(
        ordering: Ordering) -> None:
    """A Celery group and a loop of delay() in one bound transaction: one INSERT at the
    commit, nothing visible before it; real workers run every task once, each FIFO group
    in the order sent."""
    app = ordering.app("jobs", "fifo")
    ordering.connect("jobs", "fifo").default_channel.queue_declare("jobs")
    table = f"{ordering.prefix}fifo_jobs"
    half = ROWS // 2
    with inserts_into(ordering.engine, table) as inserts, ordering.engine.connect() as conn:
        conn.begin()
        with celery_ext.bind(conn):
            group([app.signature("ord.step", args=(f"g{g}", seq),
                                 headers={"group_key": f"g{g}"})
                   for seq in range(half) for g in range(GROUPS)], app=app).apply_async()
            for seq in range(half, ROWS):
                for g in range(GROUPS):
                    app.signature("ord.step", headers={"group_key": f"g{g}"}).delay(
                        f"g{g}", seq)
            assert inserts == [], "rows were written before the commit"
        assert rows_of(ordering.engine, table) == [], "visible before the commit"
        conn.commit()
    assert len(inserts) == 1, inserts
    assert len(rows_of(ordering.engine, table)) == GROUPS * ROWS

    workers = ordering.workers(["w1", "w2"], "jobs", "fifo", pool="threads", concurrency=4)
    wait_for_count(ordering.log.done, GROUPS * ROWS, "tasks done", workers)
    check_serial_in_order(ordering.log.entries(), {f"g{g}": ROWS for g in range(GROUPS)})


def test_a_bound_bulk_publish_to_a_queue_of_the_default_layout_keeps_every_message(
        ordering: Ordering, engine: Engine) -> None:
    """The rows of a queue the transport laid out go in as one statement (on PostgreSQL
    one row of arrays, short whatever the number of rows) and come out as published:
    bodies, priorities, a ready time later, in claim order."""
    conn_ = Connection(ordering.broker_url, transport_options={"table_prefix": ordering.prefix})
    ordering.connections.append(conn_)
    conn_.default_channel.queue_declare("plain")
    producer = conn_.Producer()
    later = (datetime.now(timezone.utc) + timedelta(hours=1)).isoformat()
    table = f"{ordering.prefix}plain"
    with inserts_into(engine, table) as inserts, engine.connect() as conn:
        conn.begin()
        with celery_ext.bind(conn):
            for n in range(200):
                producer.publish({"n": n, "text": "ünïcode ✓"}, routing_key="plain",
                                 priority=n % 3, headers={"eta": later} if n == 7 else None)
        conn.commit()
    assert len(inserts) == 1, inserts
    if engine.dialect.name == "postgresql":
        assert "unnest" in inserts[0] and len(inserts[0]) < 1000, inserts[0][:300]
    taken = [get_within(conn_, "plain") for _ in range(199)]
    expected = sorted((n for n in range(200) if n != 7), key=lambda n: (-(n % 3), n))
    assert [m.payload["n"] for m in taken] == expected
    assert all(m.payload["text"] == "ünïcode ✓" for m in taken)
    assert get(conn_, "plain") is None, "the row due in an hour came early"
    for message in taken:
        message.ack()


def test_held_rows_keep_their_options_and_a_rollback_drops_what_it_covers(
        ordering: Ordering, engine: Engine) -> None:
    """Priority, eta and partition key per row; a savepoint's rollback drops its rows, a
    savepoint flushes those before it, a block that raises writes nothing, the commit
    inside the block writes the rest."""
    conn_ = ordering.connect("jobs", "keyed")
    conn_.default_channel.queue_declare("jobs")
    producer = conn_.Producer()
    later = (datetime.now(timezone.utc) + timedelta(hours=1)).isoformat()
    publish = partial(producer.publish, routing_key="jobs")
    table = f"{ordering.prefix}keyed_jobs"
    with inserts_into(engine, table) as inserts, engine.connect() as conn:
        conn.begin()
        with pytest.raises(RuntimeError), celery_ext.bind(conn):
            publish({"n": "raised"})
            raise RuntimeError("the caller's code failed")
        conn.rollback()
        conn.begin()
        with celery_ext.bind(conn):
            publish({"n": "plain"}, headers={"partition_key": "k1"})
            publish({"n": "urgent"}, priority=7)
            publish({"n": "later"}, headers={"eta": later})
            savepoint = conn.begin_nested()  # writes the three above
            publish({"n": "dropped"})
            savepoint.rollback()
            publish({"n": "last"})
            conn.commit()  # inside the block: the held row goes first
        assert len(inserts) == 2, inserts
    stored = rows_of(engine, table, "priority, pkey")
    assert [tuple(row) for row in stored] == [(0, "k1"), (7, None), (0, None), (0, None)]
    taken = [get_within(conn_, "jobs") for _ in range(3)]
    assert [m.payload["n"] for m in taken] == ["urgent", "plain", "last"]
    assert get(conn_, "jobs") is None, "the eta'd row came early, or a dropped one came"
    for message in taken:
        message.ack()


def test_a_declared_publish_statement_runs_per_row_after_the_held_rows(
        ordering: Ordering, engine: Engine) -> None:
    """A queue whose INSERT is declared SQL cannot join a multi-row INSERT: its rows are
    written one statement each, and rows held for other queues are written before."""
    plain = ordering.connect("jobs", "keyed")
    plain.default_channel.queue_declare("jobs")
    audit = f"{ordering.prefix}audit"
    quoted = engine.dialect.identifier_preparer.quote(audit)
    spec = (TableBuilder(audit).id().payload().headers().priority().available_at()
            .locked_until().attempt()
            .publish_statement(f"INSERT INTO {quoted} (payload, headers) "
                               "VALUES (:payload, :headers)").build())
    options = transport_options(ordering.prefix, "jobs", "keyed")
    options["queues"]["audit"] = {"table": spec}
    declared = Connection(ordering.broker_url, transport_options=options)
    ordering.connections.append(declared)
    declared.default_channel.queue_declare("audit")
    producer = declared.Producer()
    keyed = f"{ordering.prefix}keyed_jobs"
    with (inserts_into(engine, keyed) as held, inserts_into(engine, audit) as per_row,
          engine.connect() as conn):
        conn.begin()
        with celery_ext.bind(conn):
            for n in range(3):
                producer.publish({"n": n}, routing_key="jobs")
                producer.publish({"n": n}, routing_key="audit")
        conn.commit()
    assert len(per_row) == 3 and len(held) == 3, (held, per_row)
    assert [get_within(declared, "audit").payload["n"] for _ in range(3)] == [0, 1, 2]
    assert [get_within(plain, "jobs").payload["n"] for _ in range(3)] == [0, 1, 2]


@pytest.mark.parametrize("database", ["postgresql"])
def test_a_bulk_publish_wakes_an_idle_consumer_in_another_process(ordering: Ordering) -> None:
    """One NOTIFY with the multi-row INSERT: the consumer does not wait out its interval."""
    options = {"polling_interval": 10}
    conn = ordering.connect("jobs", "plain", **options)
    conn.default_channel.queue_declare("jobs")
    consumer = ordering.consumer("idle", "jobs", "plain", mode="latency", options=options,
                                 drain_timeout=60, expect=3)
    producer = conn.Producer()
    with ordering.engine.connect() as caller:
        caller.begin()
        with celery_ext.bind(caller):
            for i in range(3):
                producer.publish({"i": i, "sent": time.time()}, routing_key="jobs")
        caller.commit()
    wait_until(partial(arrived, ordering, "idle", 3), 8, "the bulk to arrive",
               alive=[consumer], interval=0.01)
    assert max(arrivals(ordering, "idle")) < 5, json.dumps(arrivals(ordering, "idle"))


def test_a_transaction_another_framework_commits_writes_each_row_at_once(
        ordering: Ordering, engine: Engine) -> None:
    """Django's binding (``defer_with``): SQLAlchemy sees neither its commit nor its
    savepoints, so nothing is held; each publish is written as it is made."""
    conn_ = ordering.connect("jobs", "keyed")
    conn_.default_channel.queue_declare("jobs")
    producer = conn_.Producer()
    with (inserts_into(engine, f"{ordering.prefix}keyed_jobs") as inserts,
          engine.connect() as conn):
        conn.begin()
        defer_with(conn, lambda callback: None)
        with celery_ext.bind(conn):
            producer.publish({"n": 0}, routing_key="jobs")
            assert len(inserts) == 1, "the row was held"
            producer.publish({"n": 1}, routing_key="jobs")
            assert len(inserts) == 2, "the row was held"
        conn.commit()
    assert [get_within(conn_, "jobs").payload["n"] for _ in range(2)] == [0, 1]
