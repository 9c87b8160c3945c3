"""What the outbox is for: a broker down, a worker killed, SQLite locks."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from kombu import Queue
from kombu.exceptions import OperationalError
from sqlalchemy import inspect, text

import celery_ext
from tests.outbox.conftest import DOWN_AMQP_URL, OutboxEnv, make_env
from tests.processes import Processes, wait_until


def test_broker_down_keeps_the_record_and_republish_delivers_it(rabbit_pg: OutboxEnv) -> None:
    env = rabbit_pg
    down, _ = env.sender(broker=DOWN_AMQP_URL)
    with pytest.raises(OperationalError, match="refused"):
        down.tasks["ob.check"].apply_async(("down",), retry=False)
    (record,) = env.records()
    assert record["task_name"] == "ob.check" and not record["processed"]

    worker = env.worker()
    _, outbox = env.sender()  # the same service once the broker answers
    assert outbox.republish(older_than=0).sent == 1
    wait_until(lambda: env.counts("run")["down"] == 1, 30, "the republished task to run",
               alive=[worker])
    (run,) = env.files("run")
    assert run["task_id"] == record["task_id"] and run["outbox_id"] == record["id"]
    assert run["record"]["found"]
    wait_until(lambda: env.records()[0]["processed"], 10, "the record to be processed")
    assert outbox.republish(older_than=0).sent == 0


def test_worker_killed_before_ack_effect_happens_once(rabbit_pg: OutboxEnv) -> None:
    """kill -9 mid-task: the task's transaction (effect + mark) never commits, the record
    stays unprocessed; the next worker gets the message twice (RabbitMQ redelivers the
    unacked one, republish at start sends it again) and the effect happens once."""
    env = rabbit_pg
    app, _ = env.sender()
    first = env.worker("w1", pool="prefork", concurrency=1)
    app.tasks["ob.credit"].delay("k", hold=True)
    wait_until(lambda: env.counts("start")["k"] == 1, 30, "the task to start", alive=[first])
    first.kill()
    assert not env.records()[0]["processed"] and env.effects() == {}

    env.release("k")
    second = env.worker("w2", pool="prefork", concurrency=2, start_grace="0")
    wait_until(lambda: "duplicate delivery" in second.output(), 30,
               "the second delivery to be skipped", alive=[second])
    assert env.records()[0]["processed"]
    assert env.effects() == {"k": 1}
    assert env.counts("start")["k"] == 2  # the killed run, then the one that committed


@pytest.fixture
def sqlite_inbox(processes: Processes) -> Iterator[OutboxEnv]:
    """The sqlinbox broker and the outbox in one SQLite file."""
    yield from make_env(processes, "sqlinbox", "sqlite")


def test_sqlite_publish_under_the_tasks_own_write_lock_fails_clearly(
        sqlite_inbox: OutboxEnv) -> None:
    env = sqlite_inbox
    app, _ = env.sender()
    worker = env.worker()
    app.tasks["ob.lock"].delay(env.db)
    app.tasks["ob.lock"].delay(env.db, bound=True)
    wait_until(lambda: len(env.files("outcome")) == 2, 30, "both lock tasks to finish",
               alive=[worker])
    unbound, bound = sorted(env.files("outcome"), key=lambda f: f["bound"])
    assert unbound["outcome"].startswith("WriteLockHeld: "), unbound
    assert "publish tracked tasks before" in unbound["outcome"]
    assert unbound["seconds"] < 10
    # bound to the task's transaction, the record goes in it and the task is sent on commit
    assert bound["outcome"] == "sent", bound
    wait_until(lambda: env.counts("run")["from-lock"] == 1, 30, "the bound send to run",
               alive=[worker])


def test_transactional_task_sends_tracked_and_enqueues_in_its_own_transaction(
        inbox_any: OutboxEnv) -> None:
    """A tracked transactional task sends a tracked task onto its queue and onto a queue
    whose table does not exist yet: nothing opens a second write transaction beside the
    task's own (on SQLite it would wait for the task's own write lock), it finishes at
    once, and the worker stops on SIGTERM."""
    env = inbox_any
    app, _ = env.sender()
    worker = env.worker()
    fresh = f"{env.queue}.fresh"
    app.tasks["ob.tx_send"].delay("here")
    app.tasks["ob.tx_send"].delay("there", queue=fresh)
    wait_until(lambda: env.effects() == {"here": 1, "there": 1}, 15,
               "both transactional tasks to commit", alive=[worker])
    wait_until(lambda: env.counts("run")["here"] == 1, 15, "the tracked send to run",
               alive=[worker])
    with app.connection_for_write() as conn:
        waiting = Queue(fresh, channel=conn.default_channel).queue_declare(passive=True)
    assert waiting.message_count == 1
    marked = [r["processed"] for r in env.records() if r["task_name"] == "ob.tx_send"]
    assert marked == [True, True]
    assert worker.stop(15) == 0
    assert "database is locked" not in worker.output()


def test_sqlite_bound_send_creates_the_tables_in_the_callers_transaction(
        sqlite_inbox: OutboxEnv) -> None:
    """A service's first tracked send, bound to its transaction that has already written
    (and so holds SQLite's write lock), before the outbox table or the queue's table
    exists: both are created in that transaction, at once; a rollback takes them back
    and the next send creates them again."""
    env = sqlite_inbox
    app, _ = env.sender(create=False)
    effects = env.quote(env.table + "_effects")

    def send(commit: bool) -> float:
        began = time.monotonic()
        with env.engine.connect() as conn, conn.begin() as transaction:
            conn.execute(text(f"INSERT INTO {effects} (k) VALUES ('first')"))
            with celery_ext.bind(conn):
                app.tasks["ob.check"].delay("bound")
            if not commit:
                transaction.rollback()
        return time.monotonic() - began

    assert send(commit=False) < 5
    with env.engine.connect() as conn:
        assert not inspect(conn).has_table(env.table)
    assert send(commit=True) < 5
    (record,) = env.records()
    assert record["task_name"] == "ob.check" and env.queue_depth(app) == 1
