"""Each example the docs include runs as the docs say it does, on the databases they name."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from queue import Empty
from types import ModuleType

import pytest
from kombu import Connection
from sqlalchemy import text
from sqlalchemy.engine import Engine

from kombu_sqlinbox import SchemaMismatch
from kombu_sqlinbox.tables import as_spec

from .support import EXAMPLES, load_example

recipes = load_example("recipes/messages.py")


# -- table declarations (docs/tables.rst) -------------------------------------------------
@pytest.fixture
def declarations(engine: Engine) -> Iterator[ModuleType]:
    """The declarations example, with its fixed table dropped before and after."""
    drop = text("DROP TABLE IF EXISTS email_jobs")
    with engine.begin() as conn:
        conn.execute(drop)
    yield load_example("declarations/tables.py")
    with engine.begin() as conn:
        conn.execute(drop)


def test_class_and_builder_declare_the_same_table(declarations: ModuleType) -> None:
    assert as_spec(declarations.EmailJobs) == declarations.email_jobs


def test_declared_table_checked_then_used(
    declarations: ModuleType, broker_url: str, engine: Engine,
) -> None:
    options = declarations.TRANSPORT_OPTIONS
    with Connection(broker_url, transport_options=options) as conn, pytest.raises(
            SchemaMismatch, match=r"table 'email_jobs' does not exist.*create it with:"
    ) as refused:
        conn.default_channel.queue_declare("emails")
    ddl = str(refused.value).split("create it with:\n", 1)[1]
    with engine.begin() as sql:
        for statement in ddl.split(";\n"):
            if statement.strip(" ;\n"):
                sql.exec_driver_sql(statement)
    with Connection(broker_url, transport_options=options) as conn:
        queue = conn.SimpleQueue("emails")
        queue.put({"to": "ada@example.com"}, priority=3)
        message = queue.get(timeout=10)
        assert message.payload == {"to": "ada@example.com"}
        message.ack()
        queue.close()


# -- dead letters (docs/outcomes.rst) -----------------------------------------------------
def test_requeue_dead_letters(broker_url: str, table_prefix: str) -> None:
    options = {"table_prefix": table_prefix,
               "queues": {"orders": {"dead_letter_queue": "orders.parked", "max_attempts": 5}}}
    with Connection(broker_url, transport_options=options) as conn:
        channel = conn.default_channel
        channel.queue_declare("orders")
        producer = conn.Producer()
        for number in (1, 2):
            producer.publish({"order": number}, routing_key="orders", headers={"n": number})
        for _ in (1, 2):
            message = channel.basic_get("orders")
            assert message is not None
            message.reject(requeue=False)
        assert channel.queue_declare("orders.parked").message_count == 2

        assert recipes.requeue_dead_letters(conn, "orders.parked") == 2

        assert channel.queue_declare("orders.parked").message_count == 0
        seen = []
        for _ in (1, 2):
            message = channel.basic_get("orders")
            assert message is not None
            assert recipes.DEATH_HEADER not in message.headers
            assert message.delivery_info["redelivered"] is False
            seen.append((message.payload["order"], message.headers["n"]))
            message.ack()
        assert sorted(seen) == [(1, 1), (2, 2)]


# -- coming from kombu sqla (docs/from-sqla.rst) ------------------------------------------
def test_move_queue_from_sqla(tmp_path: Path) -> None:
    """SQLite only: kombu's sqla transport fixes its table names per process and leaves
    transactions open, so it is not run against the shared servers here."""
    with Connection(f"sqla+sqlite:///{tmp_path}/old.db") as old, Connection(
            f"sqlinbox+sqlite:///{tmp_path}/new.db") as new:
        with old.SimpleQueue("celery") as queue:
            for number in range(3):
                queue.put({"n": number}, headers={"task": "proj.tasks.work"}, priority=number)
        assert recipes.move_queue(old, new, "celery") == 3
        with new.SimpleQueue("celery") as queue:
            got = []
            for _ in range(3):
                message = queue.get(timeout=10)
                got.append((message.payload["n"], message.headers["task"]))
                message.ack()
        # priority, higher first, survives the move
        assert got == [(2, "proj.tasks.work"), (1, "proj.tasks.work"), (0, "proj.tasks.work")]


# -- the all-SQL stack (docs/all-sql.rst) -------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("database", ["postgresql"])
def test_all_sql_stack(db_url: str, engine: Engine, tmp_path: Path,
                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DATABASE_URL", db_url)
    proj = load_example("allsql/proj.py")
    demo = load_example("demo/run.py")
    log_path = tmp_path / "worker.log"
    try:
        with log_path.open("wb") as log:
            worker = demo.start_worker("proj", EXAMPLES / "allsql", {"DATABASE_URL": db_url},
                                       log, pool=("--pool", "solo"))
            try:
                result = proj.invoice_total.delay([9.99, 5.01])
                assert result.get(timeout=60) == 15.0, log_path.read_text()
            finally:
                assert demo.stop_worker(worker) == 0, log_path.read_text()
        with engine.connect() as conn:
            stored = conn.execute(text("SELECT status, result FROM proj_taskmeta "
                                       "WHERE task_id = :id"), {"id": result.id}).one()
            waiting = conn.execute(text("SELECT COUNT(*) FROM sqlinbox_proj")).scalar_one()
        assert stored.status == "SUCCESS"
        assert waiting == 0
    finally:
        proj.app.backend.ResultSession().get_bind().dispose()
        with engine.begin() as conn:
            conn.exec_driver_sql("SET LOCAL lock_timeout = '10s'")
            for table in ("proj_taskmeta", "proj_groupmeta", "sqlinbox_proj"):
                conn.exec_driver_sql(f"DROP TABLE IF EXISTS {table}")


# -- plain kombu: failover and TTL (docs/kombu.rst) ---------------------------------------
#: a primary that is down: a port nothing listens on, a file that cannot be opened
DOWN = {"postgresql": "sqlinbox+postgresql://postgres@127.0.0.1:5439/test",
        "mysql": "sqlinbox+mysql+pymysql://root@127.0.0.1:3309/test",
        "sqlite": "sqlinbox+sqlite:////nonexistent-directory/inbox.db"}


def test_failover_to_the_standby_and_a_short_lived_queue(
        database: str, broker_url: str, table_prefix: str) -> None:
    example = load_example("kombu/failover.py")
    conn = example.connect(DOWN[database], broker_url, table_prefix=table_prefix)
    try:
        # the second message must be consumed within the TTL too, on a loaded machine
        queue = example.short_lived(conn, "quotes", seconds=1.0)
        queue.put({"price": 1})
        time.sleep(1.2)  # the time to pass is what is shown
        with pytest.raises(Empty):
            queue.get(block=False)
        queue.put({"price": 2})
        assert queue.get(timeout=10).payload == {"price": 2}
    finally:
        conn.release()
