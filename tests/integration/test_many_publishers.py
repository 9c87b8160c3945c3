"""Many publishers at once: processes racing on one queue lose nothing and write no row
twice; on PostgreSQL a durable publish commits its row as durably as before, then
NOTIFYs in a commit of its own (a notifying commit holds a lock of the whole server, so
in the durable commit it would let one publisher flush to the disk at a time), and a
listening consumer is still woken, once the row is there to be claimed."""

from __future__ import annotations

import multiprocessing
import select
import time
from typing import Any

import psycopg2
import pytest
from kombu import Connection
from sqlalchemy import text
from sqlalchemy.engine import Engine, make_url

from .conftest import Connect
from .support import count_rows, get_within, publish, table_of

PROCESSES = 4
EACH = 150
LIMIT = 120.0


def publisher(url: str, options: dict[str, Any], index: int, start: Any) -> None:
    """A spawned publisher: ``EACH`` messages numbered after ``index``, from ``start`` on."""
    with Connection(url, transport_options=options) as conn:
        producer = conn.Producer()
        start.wait(LIMIT)
        for n in range(EACH):
            producer.publish({"id": index * EACH + n}, routing_key="jobs", retry=False)


@pytest.mark.databases("postgresql", "mysql", "sqlite")
def test_racing_publisher_processes_lose_nothing_and_write_no_row_twice(
        connect: Connect, broker_url: str, table_prefix: str) -> None:
    options = {"table_prefix": table_prefix, "polling_interval": 0.05}
    conn = connect()
    conn.default_channel.queue_declare("jobs")
    spawn = multiprocessing.get_context("spawn")
    start = spawn.Event()
    children = [spawn.Process(target=publisher, args=(broker_url, options, index, start))
                for index in range(PROCESSES)]
    for child in children:
        child.start()
    start.set()
    for child in children:
        child.join(LIMIT)
        if child.is_alive():
            child.kill()
    assert [child.exitcode for child in children] == [0] * PROCESSES
    ids = []
    for _ in range(PROCESSES * EACH):
        message = get_within(conn, "jobs")
        ids.append(message.payload["id"])
        message.ack()
    assert sorted(ids) == list(range(PROCESSES * EACH))
    assert conn.default_channel.basic_get("jobs") is None


@pytest.mark.databases("postgresql")
def test_a_durable_publish_commits_its_row_durably_then_wakes_a_listener(
        connect: Connect, engine: Engine, db_url: str, table_prefix: str) -> None:
    """A trigger records the ``synchronous_commit`` each publish's INSERT ran with; a
    session LISTENing on the table's channel hears every publish, and finds the row
    committed when it does."""
    conn = connect()
    conn.default_channel.queue_declare("jobs")
    table = table_of("jobs", table_prefix)
    seen = f"{table_prefix}seen"
    with engine.begin() as db:
        db.execute(text(f"CREATE TABLE {seen} (setting TEXT)"))
        db.execute(text(
            f"CREATE FUNCTION {seen}_record() RETURNS trigger AS $$ BEGIN INSERT INTO {seen} "
            "VALUES (current_setting('synchronous_commit')); RETURN NEW; END $$ "
            "LANGUAGE plpgsql"))
        db.execute(text(f"CREATE TRIGGER {seen}_t AFTER INSERT ON {table} FOR EACH ROW "
                        f"EXECUTE FUNCTION {seen}_record()"))
    url = make_url(db_url)
    listener = psycopg2.connect(host=url.host, port=url.port, user=url.username,
                                dbname=url.database)
    listener.autocommit = True
    try:
        listener.cursor().execute(f'LISTEN "{table}"')
        for n in range(3):
            publish(conn, "jobs", {"n": n})
            deadline = time.monotonic() + 10
            while not listener.notifies and time.monotonic() < deadline:
                select.select([listener], [], [], 0.5)
                listener.poll()
            assert [note.channel for note in listener.notifies] == [table]
            listener.notifies.clear()
            assert count_rows(engine, table) == n + 1  # committed before the wake-up
        with engine.connect() as db:
            settings = db.execute(text(f"SELECT setting FROM {seen}")).scalars().all()
    finally:
        listener.close()
        with engine.begin() as db:
            db.execute(text(f"DROP TABLE {seen}"))
            db.execute(text(f"DROP FUNCTION {seen}_record() CASCADE"))
    assert settings == ["on"] * 3


@pytest.mark.databases("postgresql")
@pytest.mark.parametrize("driver", ["psycopg", "psycopg2"])
def test_a_publish_whose_session_dies_between_its_commit_and_its_wake_up_is_not_failed(
        engine: Engine, broker_url: str, table_prefix: str, driver: str,
        caplog: pytest.LogCaptureFixture) -> None:
    """The publisher's session ends itself as it sends the wake-up, its row committed
    (a ``pg_notify`` of its own schema, found before ``pg_catalog``'s on that session's
    search path, terminates its backend): the publish is not raised as failed (a caller
    would retry it and write the row twice), the loss is logged, and the row is consumed
    once; the next publish takes a fresh connection."""
    schema = f"{table_prefix}dies"
    with engine.begin() as db:
        db.execute(text(f"CREATE SCHEMA {schema}"))
        db.execute(text(
            f"CREATE FUNCTION {schema}.pg_notify(text, text) RETURNS void AS "
            "$$ SELECT pg_terminate_backend(pg_backend_pid()); $$ LANGUAGE sql"))
    url = make_url(broker_url.replace("sqlinbox+", "", 1)).set(
        drivername=f"postgresql+{driver}",
        query={"options": f"-csearch_path={schema},pg_catalog"})
    options = {"table_prefix": table_prefix, "polling_interval": 0.05}
    try:
        with Connection("sqlinbox+" + url.render_as_string(hide_password=False),
                        transport_options=options) as conn:
            conn.default_channel.queue_declare("jobs")
            with caplog.at_level("WARNING", logger="kombu_sqlinbox.database"):
                for n in range(2):
                    publish(conn, "jobs", {"n": n})
            assert caplog.text.count("wake-up was not sent") == 2, caplog.text
            got = []
            for _ in range(2):
                message = get_within(conn, "jobs")
                got.append(message.payload["n"])
                message.ack()
            assert sorted(got) == [0, 1]
            assert conn.default_channel.basic_get("jobs") is None
    finally:
        with engine.begin() as db:
            db.execute(text(f"DROP SCHEMA {schema} CASCADE"))
