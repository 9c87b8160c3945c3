"""The caller's transaction: records written in it, messages sent only after it commits.

Also the binding mechanism itself (celery_ext.binding): Session and Connection,
savepoints, and a binding per thread and per asyncio task.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from kombu import Connection as KombuConnection
from sqlalchemy import text
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from celery_ext import HEADER, NotBound, after_commit, bind, current
from tests.outbox.conftest import OutboxEnv, make_env
from tests.processes import Processes, wait_until


def committed_records(env: OutboxEnv) -> int:
    """Records visible from another connection: only committed ones."""
    return len(env.records())


def test_rolled_back_caller_transaction_sends_nothing(any_db: OutboxEnv) -> None:
    env = any_db
    app, _ = env.sender()
    check = app.tasks["ob.check"]
    env.purge(app)
    with env.engine.connect() as conn:
        trans = conn.begin()
        with bind(conn):
            check.delay("connection")
            assert current() is conn
        assert env.queue_depth(app) == 0
        trans.rollback()
    with Session(env.engine) as session, bind(session):
        check.delay("session")
        session.rollback()
    assert env.queue_depth(app) == 0
    assert committed_records(env) == 0
    # the dropped sends stay dropped: a later commit on the same connection sends nothing
    with env.engine.connect() as conn, bind(conn):
        conn.commit()
    assert env.queue_depth(app) == 0


def test_committed_caller_transaction_sends_after_commit(any_db: OutboxEnv) -> None:
    env = any_db
    app, _ = env.sender()
    check = app.tasks["ob.check"]
    env.purge(app)
    with Session(env.engine) as session, bind(session):
        session.execute(text(f"INSERT INTO {env.table}_effects (k) VALUES ('order')"))
        result = check.delay("session")
        assert env.queue_depth(app) == 0
        session.commit()
        # after a commit inside the block, the next send joins the session's next transaction
        check.delay("session-2")
        assert env.queue_depth(app) == 1
        session.commit()
    with env.engine.connect() as conn:
        with bind(conn):
            check.delay("connection")
        assert env.queue_depth(app) == 2
        conn.commit()
    wait_until(lambda: env.queue_depth(app) == 3, 5, "three messages after three commits")
    records = env.records()
    assert len(records) == 3 and records[0]["task_id"] == result.id
    assert env.effects() == {"order": 1}
    with KombuConnection(app.conf.broker_url) as conn:
        message = conn.SimpleQueue(app.amqp.queues[env.queue]).get(timeout=5)
        assert message.headers[HEADER] == records[0]["id"]
        assert message.headers["id"] == result.id


def test_savepoint_rolled_back_drops_only_its_sends(rabbit_pg: OutboxEnv) -> None:
    env = rabbit_pg
    app, _ = env.sender()
    check = app.tasks["ob.check"]
    env.purge(app)
    with Session(env.engine) as session, bind(session):
        check.delay("outer")
        nested = session.begin_nested()
        check.delay("inner")
        nested.rollback()
        kept = session.begin_nested()
        check.delay("kept")
        kept.commit()
        session.commit()
    wait_until(lambda: env.queue_depth(app) == 2, 5, "two messages")
    assert sorted(r["task_name"] for r in env.records()) == ["ob.check", "ob.check"]


def test_failing_commit_sends_nothing(rabbit_pg: OutboxEnv) -> None:
    """A deferred constraint fails at COMMIT: the record is gone and nothing is sent."""
    env = rabbit_pg
    app, _ = env.sender()
    env.purge(app)
    name = f"{env.table}_deferred"
    with env.engine.begin() as conn:
        conn.execute(text(
            f"CREATE TABLE {name} (k INT UNIQUE DEFERRABLE INITIALLY DEFERRED)"))
    try:
        with env.engine.connect() as conn, bind(conn):
            conn.execute(text(f"INSERT INTO {name} VALUES (1), (1)"))
            app.tasks["ob.check"].delay("doomed")
            with pytest.raises(Exception, match="unique"):
                conn.commit()
        assert env.queue_depth(app) == 0 and committed_records(env) == 0
    finally:
        with env.engine.begin() as conn:
            conn.execute(text(f"DROP TABLE {name}"))


def test_after_commit_needs_a_binding() -> None:
    with pytest.raises(NotBound):
        after_commit(lambda: None)
    assert current() is None


def test_callbacks_run_after_the_data_is_visible(pg_engine: Engine) -> None:
    """SQLAlchemy's Connection ``commit`` event fires before the COMMIT: the callback must
    still only run once another connection can see the data."""
    seen: list[Any] = []
    table = f"probe_{uuid.uuid4().hex[:8]}"
    with pg_engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {table} (k INT)"))
    try:
        with pg_engine.connect() as conn, bind(conn):
            conn.execute(text(f"INSERT INTO {table} VALUES (1)"))

            def look() -> None:
                with pg_engine.connect() as other:
                    seen.append(other.execute(text(f"SELECT COUNT(*) FROM {table}")).scalar())

            after_commit(look)
            conn.commit()
    finally:
        with pg_engine.begin() as conn:
            conn.execute(text(f"DROP TABLE {table}"))
    assert seen == [1]


def test_binding_is_per_thread_and_per_asyncio_task(pg_engine: Engine) -> None:
    with pg_engine.connect() as conn, bind(conn):
        other: list[Any] = []
        thread = threading.Thread(target=lambda: other.append(current()))
        thread.start()
        thread.join(10)
        assert other == [None] and current() is conn

    async def bound(name: str, gate: asyncio.Event, seen: dict[str, Any]) -> None:
        with pg_engine.connect() as conn, bind(conn):
            seen[name] = conn
            await gate.wait()  # both coroutines are inside their block here
            seen[name + " after"] = current()

    async def both() -> dict[str, Any]:
        gate, seen = asyncio.Event(), dict[str, Any]()
        tasks = [asyncio.create_task(bound(n, gate, seen)) for n in ("a", "b")]
        await asyncio.sleep(0)
        gate.set()
        await asyncio.gather(*tasks)
        return seen

    seen = asyncio.run(both())
    assert seen["a after"] is seen["a"] and seen["b after"] is seen["b"]
    assert seen["a"] is not seen["b"]


@pytest.fixture
def inbox_pg(processes: Processes) -> Iterator[OutboxEnv]:
    yield from make_env(processes, "sqlinbox", "postgresql")


def test_on_the_sqlinbox_transport_record_and_row_share_the_transaction(
        inbox_pg: OutboxEnv) -> None:
    """The transport's transactional enqueue writes the queue row in the bound transaction
    too: record and row commit together, nothing waits for after-commit."""
    env = inbox_pg
    app, _ = env.sender()
    check = app.tasks["ob.check"]
    env.purge(app)
    with Session(env.engine) as session, bind(session):
        check.delay("rolled back")
        session.rollback()
    with Session(env.engine) as session, bind(session):
        check.delay("committed")
        assert env.queue_depth(app) == 0 and committed_records(env) == 0
        session.commit()
    assert env.queue_depth(app) == 1 and committed_records(env) == 1
