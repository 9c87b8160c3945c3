"""Claims pass over the rows a snapshot held open keeps from vacuum (InnoDB purge), and a
row that fell below the claim floor is taken at the floor's next reading."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import Engine

from kombu_sqlinbox import TableBuilder
from kombu_sqlinbox.broker import Broker
from kombu_sqlinbox.dialects.base import FLOOR_MARGIN, FLOOR_REFRESH, FLOOR_STEP
from kombu_sqlinbox.rows import ClaimedRow
from tests.databases import pages_read, snapshot_held

from .conftest import Connect
from .support import broker_of, publish, quoted
from .test_explain import DIGITS

#: rows acked (deleted) while the snapshot is held: enough that walking them shows
DEAD = 20_000
#: pages a claim form may read past the dead rows: below the claim index's leaf pages
#: holding their entries (a walk from the index's start, inside the index, reads more)
PASSED_PAGES = DEAD // 250
#: payload bytes of a dead row (under PostgreSQL's TOAST threshold: the row holds them)
ROW_BYTES = 1500


def dead_rows_sql(database: str, table: str) -> str:
    """DEAD rows ready an hour ago, in one statement; a few to a page, so that visiting
    their rows reads thousands of pages."""
    if database == "postgresql":
        return (f"INSERT INTO {table} (payload, headers, available_at) "
                f"SELECT CAST(repeat('x', {ROW_BYTES}) AS bytea), '{{}}', "
                f"now() - interval '1 hour' + n * interval '1 ms' "
                f"FROM generate_series(1, {DEAD}) AS n")
    joins = ", ".join(f"({DIGITS}) AS d{n}" for n in range(5))
    return (f"INSERT INTO {table} (payload, headers, available_at) "
            f"SELECT REPEAT('x', {ROW_BYTES}), '{{}}', "
            f"UTC_TIMESTAMP(6) - INTERVAL 1 HOUR FROM {joins} LIMIT {DEAD}")


@contextmanager
def dead_rows_kept(broker: Broker, database: str, table: str) -> Iterator[None]:
    """DEAD rows in ``table``, deleted while a snapshot is held, for as long as the block
    runs (the snapshot held throughout)."""
    idle: Engine = create_engine(broker.engine.url, isolation_level="AUTOCOMMIT")
    try:
        with snapshot_held(idle, database):
            with broker.engine.begin() as db:
                db.execute(text(dead_rows_sql(database, table)))
            with broker.engine.begin() as db:
                db.execute(text(f"DELETE FROM {table}"))
            yield
    finally:
        idle.dispose()


@pytest.mark.parametrize("database", ["postgresql", "mysql"], indirect=True)
def test_a_claim_passes_over_dead_rows_a_snapshot_keeps(
    connect: Connect, database: str, db_url: str,
) -> None:
    conn = connect()
    conn.default_channel.queue_declare("jobs")
    broker = broker_of(conn)
    spec = broker.table("jobs").spec
    table = quoted(broker.engine, spec.table)
    with dead_rows_kept(broker, database, table):
        for n in range(3):
            publish(conn, "jobs", {"n": n})
        with broker.engine.connect() as db:
            floor = broker.dialect.claim_floor(db, spec)
            assert floor is not None
            assert floor > time.time() - 60  # above the dead rows, an hour old
            # the selection as claims made it before: locking, from the index's start
            walked, _ = pages_read(db, database, broker, spec,
                                   broker.dialect.explain(spec), 0.0)
            claim = broker.dialect.statements(spec).claim[0]
            passed, _ = pages_read(db, database, broker, spec, claim, floor)
        with broker.engine.begin() as db:
            claimed = broker.dialect.claim(db, spec, 8, 30)
    assert len(claimed) == 3
    # a locking read from the index's start visits the dead rows; the claim passes over
    # them in the index (on MariaDB through the indexes it names on the transport's own
    # table, whatever the table's statistics say)
    assert walked > DEAD // 10, (walked, passed)
    assert passed < walked // 20, (walked, passed)


@pytest.mark.parametrize(("database", "layout"), [
    ("postgresql", "own"), ("postgresql", "keyed"), ("mysql", "own")],
    indirect=["database"])
def test_every_claim_form_reads_a_bounded_few_pages_past_dead_rows(
    connect: Connect, database: str, layout: str, table_prefix: str,
) -> None:
    """Under a held snapshot with DEAD deleted rows ahead of three ready ones: the plain
    claim, the claim passing over keys in work, and the advisory form's candidates (each
    key's first row) read a few pages with the floor (on PostgreSQL from the epoch they
    read the dead rows); a priority row is taken first all the same. MariaDB's optimizer
    keeps to the claim index by whim on a declared table: there only the transport's own
    is asserted."""
    options: dict[str, Any] = {}
    if layout == "keyed":  # declared: a priority and partition keys
        options["queues"] = {"jobs": {"table": (
            TableBuilder(f"{table_prefix}keyed").id().payload().headers().priority()
            .partition_key("pkey").available_at().locked_until().attempt().build())}}
    conn = connect(**options)
    conn.default_channel.queue_declare("jobs")
    broker = broker_of(conn)
    dialect, spec = broker.dialect, broker.table("jobs").spec
    assert spec.own == (layout == "own")
    table = quoted(broker.engine, spec.table)
    statements = dialect.statements(spec)
    forms = {"claim": statements.claim[0], "candidates": statements.candidates}
    if layout == "keyed":
        forms["claim skipping"] = statements.claim_skipping[0]
    read: dict[str, tuple[int, int]] = {}
    with dead_rows_kept(broker, database, table):
        with broker.engine.begin() as db:
            dialect.publish(db, spec, [
                dialect.publish_params(spec, b"%d" % n, "{}", priority=priority,
                                       partition_key=f"k{n}")
                for n, priority in enumerate((0, 0, 5))])
        with broker.engine.connect() as db:
            floor = dialect.claim_floor(db, spec)
            assert floor is not None
            for name, statement in forms.items():
                walked, _ = pages_read(db, database, broker, spec, statement, 0.0)
                passed, _ = pages_read(db, database, broker, spec, statement, floor)
                read[name] = (walked, passed)
        with broker.engine.begin() as db:
            claimed = dialect.claim(db, spec, 8, 30)
    assert [row.payload for row in claimed] == [b"2", b"0", b"1"]  # priority 5 first
    for name, (walked, passed) in read.items():
        if database == "postgresql":  # from the epoch the dead rows are read
            assert walked > DEAD // 10, (name, read)
        # (a plain read skips MariaDB's delete-marked entries in the index: from the
        # epoch too it reads only index pages, where a whole-table scan reads thousands)
        # fewer than the claim index's pages of dead entries: not walked from its start
        assert passed < PASSED_PAGES, (name, read)


@pytest.mark.parametrize("database", ["postgresql"], indirect=True)
def test_a_claim_and_an_ack_read_a_few_pages_after_a_vacuum_that_counted_no_live_row(
    connect: Connect, database: str,
) -> None:
    """A queue drained while a snapshot keeps its dead rows, then vacuumed: the vacuum
    counts no live row, and the planner believes the table empty (one row) however many
    pages it has. Rows published after it are claimed and acked reading a few pages, not
    the table or the claim index whole (a lease joined to the table walked it once per
    claimed row; an ack by ids walked the claim index)."""
    conn = connect()
    conn.default_channel.queue_declare("jobs")
    broker = broker_of(conn)
    dialect, spec = broker.dialect, broker.table("jobs").spec
    table = quoted(broker.engine, spec.table)
    statements = dialect.statements(spec)
    with dead_rows_kept(broker, database, table):
        with broker.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as db:
            db.execute(text(f"VACUUM {table}"))
            believed = db.execute(text("SELECT reltuples FROM pg_class WHERE oid = "
                                       "CAST(:t AS regclass)"), {"t": table}).scalar_one()
        assert believed == 0  # the trap is set
        for n in range(30):
            publish(conn, "jobs", {"n": n})
        with broker.engine.connect() as db:
            floor = dialect.claim_floor(db, spec)
            assert floor is not None
            claimed, plan = pages_read(db, database, broker, spec, statements.claim[0], floor)
        with broker.engine.begin() as db:
            rows = dialect.claim(db, spec, 8, 30)
        assert len(rows) == 8
        ack = text(f"EXPLAIN (ANALYZE, BUFFERS) {statements.complete.text}").bindparams(
            *statements.complete._bindparams.values())
        with broker.engine.connect() as db:
            acked = "\n".join(str(row[0]) for row in db.execute(
                ack, {"attempt": rows[0].attempt, "ids": [row.id for row in rows]}))
            db.rollback()
    hit = re.search(r"Buffers: shared hit=(\d+)(?: read=(\d+))?", acked)
    assert hit is not None and " rows=8 " in acked, acked
    assert claimed < PASSED_PAGES, plan
    assert int(hit[1]) + int(hit[2] or 0) < PASSED_PAGES, acked


@pytest.mark.parametrize("database", ["postgresql", "mysql"], indirect=True)
def test_a_row_below_the_floor_is_claimed_at_the_floors_next_reading(
    connect: Connect, database: str,
) -> None:
    """A publish with an ETA an hour past lands below the floor the last claim read: the
    claims pass over it until the floor is read again, then take it."""
    conn = connect()
    publish(conn, "jobs", {"n": 0})
    broker = broker_of(conn)
    dialect, spec = broker.dialect, broker.table("jobs").spec
    with broker.engine.begin() as db:
        assert len(dialect.claim(db, spec, 8, 30)) == 1
    late = dialect.publish_params(spec, b"late", "{}", eta=time.time() - 3600)
    with broker.engine.begin() as db:
        dialect.publish(db, spec, [late])
    with broker.engine.begin() as db:
        assert dialect.claim(db, spec, 8, 30) == []
    dialect.floor_refresh = 0.0
    try:
        with broker.engine.begin() as db:
            (row,) = dialect.claim(db, spec, 8, 30)
    finally:
        dialect.floor_refresh = FLOOR_REFRESH
    assert row.payload == b"late"


@pytest.mark.parametrize("database", ["postgresql", "mysql"], indirect=True)
def test_the_floor_follows_the_queues_head_between_whole_readings(
    connect: Connect, database: str,
) -> None:
    """Once its rows are acked the floor rises to the next row's ready time (less the
    margin) at the next step, reading from where it stood; a leased row and a row of
    another priority hold it down."""
    conn = connect()
    conn.default_channel.queue_declare("jobs")
    broker = broker_of(conn)
    dialect, spec = broker.dialect, broker.table("jobs").spec
    now = time.time()

    def publish_at(ready: float, priority: int = 0) -> None:
        with broker.engine.begin() as db:
            dialect.publish(db, spec, [dialect.publish_params(spec, b"x", "{}", priority,
                                                              eta=ready)])

    def complete(row: ClaimedRow) -> None:
        with broker.engine.begin() as db:
            dialect.settle(db, dialect.statements(spec).complete, {row.attempt: [row.id]})

    def floor() -> float:
        with broker.engine.connect() as db:
            found = dialect.claim_floor(db, spec)
        assert found is not None
        return found

    publish_at(now - 100)
    publish_at(now - 50, priority=3)
    whole = floor()
    assert whole == pytest.approx(now - 100 - FLOOR_MARGIN, abs=1)
    dialect.floor_step = 0.0
    try:
        with broker.engine.begin() as db:
            (other,) = dialect.claim(db, spec, 1, 30)  # priority 3 first
        with broker.engine.begin() as db:
            (old,) = dialect.claim(db, spec, 1, 30)
        assert floor() == whole  # the leased row holds it
        complete(old)
        publish_at(now - 20)
        assert floor() == pytest.approx(now - 50 - FLOOR_MARGIN, abs=1)  # priority 3's
        complete(other)
        assert floor() == pytest.approx(now - 20 - FLOOR_MARGIN, abs=1)
    finally:
        dialect.floor_step = FLOOR_STEP
