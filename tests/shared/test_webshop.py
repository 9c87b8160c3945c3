"""examples/webshop, run by a real ``celery worker`` on every database: rows written by the
database's own command-line client and by a trigger run as the tasks their declarations
name; malformed rows are parked with their raw columns and the reason; the mail the tasks
queue is stored as plain rows by the shop's own INSERT and read back with plain SQL by
another process."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from types import ModuleType

import pytest
from kombu import Connection
from sqlalchemy import select, text
from sqlalchemy.engine import Engine

from tests.databases import drop_tables
from tests.docs.support import EXAMPLES, load_example
from tests.integration.support import death, get, get_within
from tests.processes import Processes, wait_until
from tests.shared.support import run_sql

SCHEMA = EXAMPLES / "webshop" / "schema"

ORDERS = """
INSERT INTO webshop_orders (customer, status) VALUES ('ann@example.com', 'placed');
INSERT INTO webshop_orders (customer, status) VALUES ('bob@example.com', 'placed');
UPDATE webshop_orders SET status = 'paid' WHERE customer = 'ann@example.com';
UPDATE webshop_orders SET status = 'shipped' WHERE customer = 'ann@example.com';
INSERT INTO webshop_order_events (order_id, kind) VALUES (99, 'audited');
"""
JOBS = """
INSERT INTO webshop_jobs (task, payload) VALUES ('webshop.rebuild_report', '{"day": "2026-11-30"}');
INSERT INTO webshop_jobs (task, payload) VALUES ('webshop.rebuild_report', '{oops');
INSERT INTO webshop_jobs (task, payload) VALUES (NULL, '{"day": "2026-12-01"}');
INSERT INTO webshop_jobs (task, payload) VALUES ('webshop.rebuild_report', '["2026-12-02"]');
INSERT INTO webshop_jobs (task, payload) VALUES ('webshop.no_such_task', '{}');
"""
#: why each malformed job row was parked, by its payload
PARKED = {
    "{oops": "the payload column is not JSON",
    '{"day": "2026-12-01"}': "the row names no task: column 'task' is None",
    '["2026-12-02"]': "the payload column must hold a JSON object of keyword arguments",
    "{}": "rejected without requeue by the consumer",
}


def drop_shop(engine: Engine) -> None:
    drop_tables(engine, "webshop_")
    if engine.dialect.name == "postgresql":
        with engine.begin() as conn:
            conn.execute(text("DROP FUNCTION IF EXISTS webshop_order_event() CASCADE"))


@pytest.fixture
def shop(db_url: str, engine: Engine, monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """The shop's schema, created by the database's client, and the example app on it."""
    drop_shop(engine)
    run_sql(db_url, (SCHEMA / f"{engine.dialect.name}.sql").read_text())
    monkeypatch.setenv("WEBSHOP_DATABASE_URL", db_url)
    module = load_example("webshop/webshop_app.py")
    module.create_tables(engine)
    try:
        yield module
    finally:
        module.app.close()
        drop_shop(engine)


def test_rows_from_a_trigger_and_a_client_run_as_declared(
        shop: ModuleType, db_url: str, engine: Engine, processes: Processes) -> None:
    env = {"WEBSHOP_DATABASE_URL": db_url, "PYTHONPATH": str(EXAMPLES / "webshop")}
    worker = processes.worker("webshop_app", "webshop", env, args=["-Q", "order_events,jobs"])
    run_sql(db_url, ORDERS)
    run_sql(db_url, JOBS)

    def handled() -> list[tuple[str, str, str]]:
        with engine.connect() as conn:
            return [tuple(row) for row in conn.execute(
                select(shop.handled.c.task, shop.handled.c.subject, shop.handled.c.task_id)
                .order_by(shop.handled.c.n))]

    wait_until(lambda: len(handled()) >= 6, 60, "six tasks to run", alive=[worker])
    runs = handled()
    events = [subject for task, subject, _ in runs if task == "on_order_event"]
    assert sorted(events) == ["1:paid", "1:placed", "1:shipped", "2:placed", "99:audited"]
    assert [e for e in events if e.startswith("1:")] == ["1:placed", "1:paid", "1:shipped"]
    assert [s for t, s, _ in runs if t == "webshop.rebuild_report"] == ["2026-11-30"]
    task_ids = [task_id for _, _, task_id in runs]
    assert len(set(task_ids)) == len(task_ids), "each row is its own task"
    assert all(uuid.UUID(task_id) for task_id in task_ids)

    with Connection(shop.app.conf.broker_url,
                    transport_options=shop.app.conf.broker_transport_options) as conn:
        found = {}
        for _ in PARKED:
            message = get_within(conn, "webshop.parked", timeout=30)
            found[message.payload["payload"]] = (message.payload, death(message))
            message.ack()
        assert get(conn, "webshop.parked") is None
    assert sorted(found) == sorted(PARKED)
    for payload, (columns, record) in found.items():
        assert record["queue"] == "jobs"
        assert record["reason"].startswith(PARKED[payload]), record["reason"]
        assert set(columns) == {"payload", "task"}, "the raw columns are kept"

    # the mail the two placed orders queued, read by another process with plain SQL: the
    # keyword arguments alone, and the source column that only the shop's INSERT fills
    mail = run_sql(db_url, "SELECT kind, body, source FROM webshop_mail ORDER BY id;")
    assert sorted((kind, json.loads(body)["order_id"], json.loads(body)) for kind, body, _ in mail
                  ) == [
        ("send_mail", 1, {"to": "ann@example.com", "template": "order-placed", "order_id": 1}),
        ("send_mail", 2, {"to": "bob@example.com", "template": "order-placed", "order_id": 2})]
    assert all(source.startswith("webshop:") and uuid.UUID(source[8:]) for _, _, source in mail)
    assert run_sql(db_url, "SELECT COUNT(*) FROM webshop_order_events;") == [["0"]]
    assert run_sql(db_url, "SELECT COUNT(*) FROM webshop_jobs;") == [["0"]]
