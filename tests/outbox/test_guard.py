"""The duplicate check on the worker: ids it cannot look up, its database down, late tasks."""

from __future__ import annotations

from celery import Celery

from celery_ext import mark_processed
from tests.outbox.conftest import DOWN_DB_URLS, OutboxEnv
from tests.processes import wait_until


def test_an_id_of_the_wrong_type_runs_the_task_untracked(any_db: OutboxEnv) -> None:
    """Another service's header names a record of another kind (a text id against this
    outbox's integer ids): the task runs, once, and the log says why it is untracked; a
    transactional consumer (``outbox.transaction()``) commits its effect untracked."""
    env = any_db
    app, _ = env.sender()
    worker = env.worker()
    plain = Celery("elsewhere", broker=app.conf.broker_url, set_as_current=False)
    plain.conf.task_default_queue = env.queue
    try:
        plain.send_task("ob.note", ("foreign",), headers={"outbox_id": "7c1e-not-ours"})
        plain.send_task("ob.credit", ("foreign-tx",), headers={"outbox_id": "7c1e-not-ours"})
        wait_until(lambda: env.counts("run")["foreign"] == 1, 20, "the task to run",
                   alive=[worker])
        wait_until(lambda: env.effects() == {"foreign-tx": 1}, 20,
                   "the transactional consumer to commit", alive=[worker])
    finally:
        plain.close()
    wait_until(lambda: "runs untracked" in worker.output(), 10, "the untracked log",
               alive=[worker])
    assert "'7c1e-not-ours'" in worker.output()
    assert "could not mark" not in worker.output() and env.records() == []


def test_the_outbox_database_down_requeues_the_delivery(any_db: OutboxEnv,
                                                        database: str) -> None:
    """The check cannot read the record: the message goes back to the broker, the body does
    not run; once a worker reaches the database the task runs once and is marked."""
    env = any_db
    app, _ = env.sender()
    app.tasks["ob.note"].delay("kept")
    (record,) = env.records()
    cut_off = env.worker("w1", db=DOWN_DB_URLS[database])
    wait_until(lambda: cut_off.output().count("requeued") >= 2, 30,
               "the delivery to be requeued", alive=[cut_off])
    assert cut_off.stop() == 0
    assert env.counts("run")["kept"] == 0
    assert env.queue_depth(app) == 1  # back in the queue, not acked

    worker = env.worker("w2")
    wait_until(lambda: env.counts("run")["kept"] == 1, 20, "the task to run", alive=[worker])
    wait_until(lambda: env.records()[0]["processed"], 10, "the record to be processed")
    assert env.records()[0]["id"] == record["id"]


def test_a_task_registered_after_finalize_is_guarded(rabbit_pg: OutboxEnv) -> None:
    """ob.late is registered after the app was finalized (as a late import's tasks are): a
    delivery of an already processed record is skipped all the same."""
    env = rabbit_pg
    app, _ = env.sender()
    app.tasks["ob.late"].delay("late")
    (record,) = env.records()
    with env.engine.begin() as conn:  # processed elsewhere: this delivery is a duplicate
        assert mark_processed(conn, record["id"], app=app)
    worker = env.worker()
    wait_until(lambda: "duplicate delivery" in worker.output(), 20,
               "the duplicate to be skipped", alive=[worker])
    assert env.counts("run")["late"] == 0
