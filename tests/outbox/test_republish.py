"""Republish on every database: bad records, once per grace period, republishers racing."""

from __future__ import annotations

import json
import threading
from collections import Counter
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from celery import Celery
from kombu import Queue
from kombu.exceptions import OperationalError
from sqlalchemy import text

from celery_ext import Outbox, Republished
from celery_ext.declaration import default_outbox_table
from kombu_sqlinbox.dialects import dialect_for
from kombu_sqlinbox.errors import SchemaMismatch
from tests.outbox.conftest import DOWN_AMQP_URL, OutboxEnv, age
from tests.processes import wait_until

GRACE = 600.0


def lost_records(env: OutboxEnv, count: int, grace: float = GRACE,
                 **options: Any) -> tuple[Celery, Outbox, list[Any]]:
    """``count`` tracked tasks the broker lost, recorded longer than ``grace`` ago."""
    app, outbox = env.sender(start_grace=str(grace), **options)
    for i in range(count):
        app.tasks["ob.note"].delay(f"k{i}")
    env.purge(app)
    ids = [r["id"] for r in env.records()]
    age(env, "created_at", ids, 2 * grace)
    return app, outbox, ids


def drain(env: OutboxEnv, app: Celery, expected: int) -> Counter[Any]:
    """Take every message off the test's queue (``expected`` of them, awaited): how often
    each record id arrived."""
    wait_until(lambda: env.queue_depth(app) >= expected, 20,
               f"{expected} messages in the queue")
    arrived: Counter[Any] = Counter()
    with app.connection_for_write() as conn:
        queue = Queue(env.queue, channel=conn.default_channel)
        while (message := queue.get(no_ack=True)) is not None:
            arrived[message.headers["outbox_id"]] += 1
    return arrived


def test_a_bad_record_is_logged_and_the_others_are_sent(
        any_db: OutboxEnv, caplog: pytest.LogCaptureFixture) -> None:
    env = any_db
    app, outbox, ids = lost_records(env, 5)
    quoted = env.quote(env.table)
    with env.engine.begin() as conn:  # records another program damaged
        conn.execute(text(f"UPDATE {quoted} SET headers = 'not json' WHERE id = :id"),
                     {"id": ids[1]})
        conn.execute(text(f"UPDATE {quoted} SET properties = '[1, 2]' WHERE id = :id"),
                     {"id": ids[3]})

    result = outbox.republish()
    assert (result.sent, result.failed) == (3, (ids[1], ids[3]))
    assert drain(env, app, 3) == dict.fromkeys((ids[0], ids[2], ids[4]), 1)
    for bad in (ids[1], ids[3]):
        assert f"outbox: record {bad} could not be sent again" in caplog.text
    assert "Expecting value" in caplog.text  # the reason: its headers are not JSON


def test_a_record_is_sent_again_once_per_grace_period(any_db: OutboxEnv) -> None:
    env = any_db
    app, outbox, ids = lost_records(env, 3)
    assert outbox.republish().sent == 3
    assert outbox.republish().sent == 0  # within the grace period of that resend
    assert drain(env, app, 3) == dict.fromkeys(ids, 1)

    age(env, "republished_at", ids[:1], 2 * GRACE)  # one grace period later, still lost
    assert outbox.republish().sent == 1
    assert drain(env, app, 1) == {ids[0]: 1}


def test_a_task_whose_eta_is_ahead_is_not_sent_again_before_it(any_db: OutboxEnv) -> None:
    """Its first message waits for the eta on a worker; copies sent meanwhile would all run
    at the eta, side by side. Republish holds it back (looking again a grace period later)
    and sends it once the eta has passed."""
    env = any_db
    app, outbox = env.sender(start_grace=str(GRACE))
    app.tasks["ob.note"].apply_async(("later",), countdown=3600)
    env.purge(app)
    (record_id,) = [r["id"] for r in env.records()]
    age(env, "created_at", [record_id], 2 * GRACE)
    assert outbox.republish() == Republished(sent=0, held=1)
    assert outbox.republish() == Republished(sent=0)  # looked at once per grace period

    passed = (datetime.now(timezone.utc) - timedelta(seconds=1)).isoformat()
    with env.engine.begin() as conn:  # the eta has passed and the task still did not run
        headers = json.loads(conn.execute(text(
            f"SELECT headers FROM {env.quote(env.table)} WHERE id = :id"),
            {"id": record_id}).scalar_one())
        conn.execute(text(f"UPDATE {env.quote(env.table)} SET headers = :h WHERE id = :id"),
                     {"h": json.dumps({**headers, "eta": passed}), "id": record_id})
    age(env, "republished_at", [record_id], 2 * GRACE)
    assert outbox.republish() == Republished(sent=1)
    assert drain(env, app, 1) == {record_id: 1}


def test_one_run_sends_each_record_once_whatever_the_age(any_db: OutboxEnv) -> None:
    """``older_than=0``: records this run claimed are due again at once, yet the run
    sends each once, batch after batch, and ends."""
    env = any_db
    app, outbox, ids = lost_records(env, 5, batch=2)
    assert outbox.republish(older_than=0, limit=20).sent == 5
    assert drain(env, app, 5) == dict.fromkeys(ids, 1)


def test_racing_republishers_send_each_record_once(any_db: OutboxEnv) -> None:
    """Two instances of the service, each its own engine, republish at the same moment in
    small batches: every record goes out once in the round."""
    env = any_db
    app, outbox, ids = lost_records(env, 40, batch=4)
    _, other = env.sender(start_grace=str(GRACE), batch=4)
    gate = threading.Barrier(2, timeout=10)
    sent: list[int] = []

    def republish(instance: Outbox) -> None:
        gate.wait()
        sent.append(instance.republish().sent)

    threads = [threading.Thread(target=republish, args=(o,)) for o in (outbox, other)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert sum(sent) == 40 and len(sent) == 2
    assert drain(env, app, 40) == dict.fromkeys(ids, 1)
    assert outbox.republish().sent == other.republish().sent == 0


def test_a_table_of_the_previous_release_gets_the_alter_table(any_db: OutboxEnv) -> None:
    """The previous layout has no republished_at column: the check says how to add it, and
    once added the outbox works."""
    env = any_db
    dialect = dialect_for(env.engine)
    columns = default_outbox_table(env.table).column_names()
    del columns["republished_at"]
    with env.engine.begin() as conn:
        for statement in dialect.outbox_create_ddl(env.table, None, columns, True):
            conn.exec_driver_sql(statement)
    app, outbox = env.sender(create=False)
    with pytest.raises(SchemaMismatch, match="column 'republished_at'") as found:
        outbox.create()
    alter = str(found.value).split("\n", 1)[1].rstrip(";")
    assert alter.startswith("ALTER TABLE")
    with env.engine.begin() as conn:
        conn.exec_driver_sql(alter)
    outbox.create()
    app.tasks["ob.note"].delay("after")
    env.purge(app)
    assert outbox.republish(older_than=0).sent == 1


def test_a_broker_error_leaves_the_unsent_records_due(any_db: OutboxEnv) -> None:
    """The broker is down for a republish: the run fails, and the records it claimed but
    could not send are sent by the next one, without waiting a grace period."""
    env = any_db
    app, _, ids = lost_records(env, 3)
    down, outbox = env.sender(broker=DOWN_AMQP_URL, start_grace=str(GRACE))
    down.conf.task_publish_retry = False
    with pytest.raises(OperationalError):
        outbox.republish()
    _, back = env.sender(start_grace=str(GRACE))
    assert back.republish().sent == 3
    assert drain(env, app, 3) == dict.fromkeys(ids, 1)
