"""What the outbox is for: a broker down, a worker killed, republishers racing, SQLite locks."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from kombu.exceptions import OperationalError

from tests.acceptance.conftest import wait_until
from tests.outbox.conftest import DOWN_AMQP_URL, OutboxEnv, make_env


def test_broker_down_keeps_the_record_and_republish_delivers_it(rabbit_pg: OutboxEnv) -> None:
    env = rabbit_pg
    down, _ = env.sender(broker=DOWN_AMQP_URL)
    with pytest.raises(OperationalError, match="refused"):
        down.tasks["ob.check"].apply_async(("down",), retry=False)
    (record,) = env.records()
    assert record["task_name"] == "ob.check" and not record["processed"]

    worker = env.worker()
    _, outbox = env.sender()  # the same service once the broker answers
    assert outbox.republish(older_than=0) == 1
    wait_until(lambda: env.counts("run")["down"] == 1, 30, "the republished task to run",
               alive=[worker])
    (run,) = env.files("run")
    assert run["task_id"] == record["task_id"] and run["outbox_id"] == record["id"]
    assert run["record"]["found"]
    wait_until(lambda: env.records()[0]["processed"], 10, "the record to be processed")
    assert outbox.republish(older_than=0) == 0


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


def test_two_republishers_at_once_effect_once(rabbit_pg: OutboxEnv) -> None:
    env = rabbit_pg
    app, outbox = env.sender()
    _, other = env.sender()  # a second instance of the service
    keys = [f"r{i}" for i in range(5)]
    for key in keys:
        app.tasks["ob.credit"].delay(key)
    env.purge(app)  # lost by the broker

    gate = threading.Barrier(2, timeout=10)
    sent: list[int] = []

    def republish(instance: object) -> None:
        gate.wait()
        sent.append(instance.republish(older_than=0))  # type: ignore[attr-defined]

    threads = [threading.Thread(target=republish, args=(o,)) for o in (outbox, other)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    assert sent == [5, 5] and env.queue_depth(app) == 10

    worker = env.worker(pool="prefork", concurrency=2)
    wait_until(lambda: worker.output().count("duplicate delivery") == 5, 60,
               "five duplicate deliveries to be skipped", alive=[worker])
    assert all(r["processed"] for r in env.records())
    assert env.effects() == dict.fromkeys(keys, 1)


@pytest.fixture
def sqlite_inbox(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[OutboxEnv]:
    """The sqlinbox broker and the outbox in one SQLite file."""
    yield from make_env(request, tmp_path, "sqlinbox", "sqlite")


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
