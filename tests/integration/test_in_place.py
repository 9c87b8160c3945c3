"""On PostgreSQL a claim rewrites its rows on their own pages: a queue table the transport
creates keeps half of each page free for the claim's new row versions, so a claim adds
nothing to the table's indexes (heap-only updates) and costs its rows, not their indexes."""

from __future__ import annotations

import json

import pytest
from sqlalchemy import Connection, text

from kombu_sqlinbox.broker import Broker
from kombu_sqlinbox.rows import QueueTable

from .conftest import Connect
from .support import broker_of, quoted

ROWS = 2_000
#: a row the size of a small task's: its new version, a lease time longer, fits beside it
BODY = "x" * 120
ENVELOPE = json.dumps({"headers": {"task": "app.send", "id": "0" * 36}, "pad": "y" * 120})


def pages(db: Connection, table: str) -> dict[int, int]:
    """The heap page each row's current version is on, by id."""
    return {int(row_id): int(page) for row_id, page in db.execute(text(
        f"SELECT id, (ctid::text::point)[0] FROM {table}"))}


def moved_by_a_claim(broker: Broker, table: QueueTable) -> list[int]:
    """Fill the queue with ROWS ready rows and claim them all: the ids of those whose
    current version is on another page than before the claim."""
    name = quoted(broker.engine, table.spec.table)
    with broker.engine.begin() as db:
        db.execute(text(f"INSERT INTO {name} (payload, headers) SELECT "
                        f"convert_to(:body, 'UTF8'), :envelope FROM generate_series(1, {ROWS})"),
                   {"body": BODY, "envelope": ENVELOPE})
        before = pages(db, name)
    claimed = 0
    while claimed < ROWS:
        taken = broker.claim(table, ROWS - claimed)
        assert taken, f"claimed {claimed} of {ROWS} rows"
        claimed += len(taken)
    with broker.engine.connect() as db:
        after = pages(db, name)
    return [row_id for row_id, page in before.items() if after[row_id] != page]


@pytest.fixture
def jobs(connect: Connect) -> tuple[Broker, QueueTable, str]:
    """The queue ``jobs`` in a table the transport created: its broker, table, quoted name."""
    conn = connect()
    conn.default_channel.queue_declare("jobs")
    broker = broker_of(conn)
    table = broker.table("jobs")
    return broker, table, quoted(broker.engine, table.spec.table)


@pytest.mark.parametrize("database", ["postgresql"], indirect=True)
def test_a_claim_leaves_every_row_on_its_page(jobs: tuple[Broker, QueueTable, str]) -> None:
    broker, table, name = jobs
    with broker.engine.connect() as db:
        options = db.execute(text("SELECT reloptions FROM pg_class WHERE oid = "
                                  "CAST(:name AS regclass)"), {"name": name}).scalar_one()
    assert options == ["fillfactor=50"]
    moved = moved_by_a_claim(broker, table)
    assert not moved, f"{len(moved)} of {ROWS} claimed rows left their page"


@pytest.mark.parametrize("database", ["postgresql"], indirect=True)
def test_with_full_pages_a_claim_moves_its_rows(jobs: tuple[Broker, QueueTable, str]) -> None:
    """What the free half of each page is for: on a table filled to the brim (a table
    created before this layout, say) the claim writes most rows' new versions elsewhere."""
    broker, table, name = jobs
    with broker.engine.begin() as db:
        db.execute(text(f"ALTER TABLE {name} SET (fillfactor = 100)"))
    moved = moved_by_a_claim(broker, table)
    assert len(moved) > ROWS // 2, f"only {len(moved)} of {ROWS} claimed rows moved"
