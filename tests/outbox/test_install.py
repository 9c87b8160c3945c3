"""Installing: the deferred engine, the environment switch, what is tracked, a failed record,
and uninstalling."""

from __future__ import annotations

import contextlib
import uuid
from pathlib import Path
from typing import Any

import pytest
from celery import Celery, signals
from celery.app.trace import build_tracer
from kombu import Queue as KombuQueue
from sqlalchemy import text
from sqlalchemy.engine import Engine

import celery_ext
from celery_ext import HEADER, OutboxError, OutboxNotReady, RecordFailed, mark_processed, outbox_of
from celery_ext.outbox import DISABLED_ENV, engine_from_url
from kombu_sqlinbox.errors import ConfigurationError
from tests.outbox.conftest import AMQP_URL, DOWN_DB_URLS, OutboxEnv


def sent_tasks(env: OutboxEnv) -> list[str]:
    return [r["task_name"] for r in env.records()]


def test_the_engine_can_come_at_start_up(rabbit_pg: OutboxEnv) -> None:
    env = rabbit_pg
    app, outbox = env.sender(db=None, create=False)  # installed before the database exists
    with pytest.raises(OutboxNotReady, match="bind_engine"):
        app.tasks["ob.check"].delay("too early")
    assert env.queue_depth(app) == 0
    outbox.bind_engine(env.engine)  # e.g. from worker_init or the web app's start-up
    app.tasks["ob.check"].delay("bound")
    assert sent_tasks(env) == ["ob.check"]

    later, _ = env.sender(db=None, create=False)
    later.conf.outbox_url = env.db  # or by configuration
    later.tasks["ob.check"].delay("configured")
    assert len(sent_tasks(env)) == 2


def test_the_environment_switch_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DISABLED_ENV, "1")
    app = Celery("switched", broker=AMQP_URL, set_as_current=False)
    app.conf.task_always_eager = True
    outbox = celery_ext.install(app)  # no database anywhere
    assert not outbox.enabled

    @app.task(name="switched.add", shared=False)
    def add(x: int, y: int) -> int:
        return x + y

    assert add.delay(1, 2).get() == 3
    app.close()


def test_only_the_named_tasks_or_queues_are_tracked(rabbit_pg: OutboxEnv) -> None:
    env = rabbit_pg
    app, _ = env.sender(tasks=["ob.credit"])
    app.tasks["ob.check"].delay("untracked")
    app.tasks["ob.credit"].delay("tracked")
    app.tasks["ob.check"].apply_async(("by-queue",), queue="elsewhere")
    assert sent_tasks(env) == ["ob.credit"]

    env.apps.pop()[1].uninstall()
    app, _ = env.sender(tasks=lambda name: name.endswith("check"), queues=["elsewhere"])
    app.tasks["ob.credit"].apply_async(("routed",), queue="elsewhere")
    app.tasks["ob.credit"].delay("neither")
    app.tasks["ob.check"].delay("by-name")
    assert sorted(sent_tasks(env)) == ["ob.check", "ob.credit", "ob.credit"]
    with app.connection_for_write() as conn:
        app.amqp.queues["elsewhere"](conn.default_channel).delete()


def test_a_database_down_stops_the_send(rabbit_pg: OutboxEnv) -> None:
    env = rabbit_pg
    app, _ = env.sender(db=DOWN_DB_URLS["postgresql"], create=False)
    env.purge(app)
    with pytest.raises(RecordFailed, match=r"could not record task ob\.check\[.*not sent"):
        app.tasks["ob.check"].delay("lost?")
    assert env.queue_depth(app) == 0


def test_mark_processed_in_the_callers_transaction(rabbit_pg: OutboxEnv) -> None:
    env = rabbit_pg
    app, _ = env.sender()
    app.tasks["ob.check"].delay("x")
    (record,) = env.records()
    with env.engine.connect() as conn:
        assert mark_processed(conn, record["id"], app=app)
        conn.rollback()
    assert not env.records()[0]["processed"]
    with env.engine.begin() as conn:
        assert mark_processed(conn, record["id"], app=app)
    assert env.records()[0]["processed"]


def test_an_outbox_in_an_sqlite_memory_database_is_refused() -> None:
    """Each connection would see its own empty outbox: records written on one would never
    be found by the republisher or marked by the worker."""
    app = Celery("in-memory", broker=AMQP_URL, set_as_current=False)
    with pytest.raises(ConfigurationError, match=r"in memory.*use a file"):
        celery_ext.install(app, "sqlite://")



def test_uninstall_undoes_install(tmp_path: Path) -> None:
    """After uninstall the app sends as before (no record, no header), a worker neither
    skips nor marks, the signals have their old receivers, and install() works again."""
    db = f"sqlite:///{tmp_path}/outbox.db"
    app = Celery("uninstalled", broker="sqlinbox+" + db, set_as_current=False)
    app.conf.task_default_queue = QUEUE
    ran: list[str] = []

    @app.task(name="un.note", shared=False, ignore_result=True)
    def note(key: str) -> None:
        ran.append(key)

    receivers = {signal: len(signal.receivers) for signal in WORKER_SIGNALS}
    engine = engine_from_url(db)
    try:
        celery_ext.install(app, db, table="un_outbox").create()
        assert_tracked(app, engine, "installed")
        processed = written_record(engine, processed=True)
        deliver(app, "skipped", processed)
        assert ran == []  # the guard skips a processed record's delivery

        outbox_of(app).uninstall()
        note.delay("after")
        assert received(app) == {}
        assert count(engine) == 2  # no record was written
        assert {signal: len(signal.receivers) for signal in WORKER_SIGNALS} == receivers
        deliver(app, "after-processed", processed)
        assert ran == ["after-processed"]  # no guard skips it
        unprocessed = written_record(engine, processed=False)
        deliver(app, "after-unprocessed", unprocessed)
        assert ran[-1] == "after-unprocessed"
        assert not is_processed(engine, unprocessed)  # no hook marks it

        celery_ext.install(app, db, table="un_outbox")
        assert_tracked(app, engine, "again")
        deliver(app, "again-processed", processed)
        assert ran[-1] == "after-unprocessed"
    finally:
        from kombu_sqlinbox.brokers import close_all

        with contextlib.suppress(OutboxError):
            outbox_of(app).uninstall()
        app.close()
        close_all()
        engine.dispose()


QUEUE = "uninstalled"
WORKER_SIGNALS = (signals.task_postrun, signals.worker_init, signals.worker_ready)


def assert_tracked(app: Celery, engine: Engine, key: str) -> None:
    """A tracked send: its record is written and the message carries its id."""
    before = count(engine)
    app.tasks["un.note"].delay(key)
    assert count(engine) == before + 1
    with engine.connect() as conn:
        newest = conn.execute(text(
            "SELECT MAX(id) FROM un_outbox WHERE task_name = 'un.note'")).scalar_one()
    assert received(app) == {HEADER: newest}


def received(app: Celery) -> dict[str, Any]:
    """The outbox header of the message waiting in the queue, which is taken off it."""
    with app.connection_for_read() as conn:
        message = KombuQueue(QUEUE)(conn.default_channel).get(no_ack=True)
        assert message is not None, "no message in the queue"
        return {k: v for k, v in message.headers.items() if k == HEADER}


def count(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text("SELECT COUNT(*) FROM un_outbox")).scalar_one())


def written_record(engine: Engine, processed: bool) -> int:
    """A record written by hand, processed or not."""
    with engine.begin() as conn:
        return int(conn.execute(text(
            "INSERT INTO un_outbox (exchange, routing_key, headers, properties, body, "
            "created_at, processed_at) VALUES ('', 'x', '{}', '{}', x'7b7d', 0, :processed) "
            "RETURNING id"), {"processed": 1 if processed else None}).scalar_one())


def is_processed(engine: Engine, record_id: int) -> bool:
    with engine.connect() as conn:
        return conn.execute(text("SELECT processed_at FROM un_outbox WHERE id = :id"),
                            {"id": record_id}).scalar_one() is not None


def deliver(app: Celery, key: str, record_id: int) -> None:
    """Run a delivery of un.note carrying ``record_id`` as a worker started now runs it:
    through the tracer Celery builds for the task at start-up."""
    task = app.tasks["un.note"]
    build_tracer(task.name, task, app=app)(
        uuid.uuid4().hex, [key], {}, {HEADER: record_id, "delivery_info": {}})
