"""Installing: the deferred engine, the environment switch, what is tracked, a failed record."""

from __future__ import annotations

import pytest
from celery import Celery

import celery_ext
from celery_ext import OutboxNotReady, RecordFailed, mark_processed
from celery_ext.outbox import DISABLED_ENV
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
