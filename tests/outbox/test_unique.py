"""Tracked sends of unique tasks (the sqlinbox broker): a send whose key another task holds
leaves its record processed, never to be sent; a republish finding the key held by the
record's own message (it waits) counts it sent, by another task discards it."""

from __future__ import annotations

import pytest

from celery_ext.binding import bind
from kombu_sqlinbox.errors import DuplicateTask
from tests.outbox.conftest import OutboxEnv


def test_a_tracked_send_whose_key_is_held_is_never_sent(inbox_any: OutboxEnv) -> None:
    env = inbox_any
    app, outbox = env.sender()
    note = app.tasks["ob.note"]
    first = note.apply_async(("a",), unique_key="k")
    with pytest.raises(DuplicateTask) as raised:
        note.apply_async(("b",), unique_key="k")
    assert raised.value.task_id == first.id
    with env.engine.connect() as conn:
        conn.begin()
        with bind(conn), pytest.raises(DuplicateTask):
            note.apply_async(("c",), unique_key="k")
        conn.commit()
    assert [(r["task_id"] == first.id, r["processed"]) for r in env.records()] == [
        (True, False), (False, True), (False, True)]
    republished = outbox.republish(older_than=0)
    assert (republished.sent, republished.failed) == (1, ()), "its own message waits"
    assert env.queue_depth(app) == 1
    assert [r["processed"] for r in env.records()] == [False, True, True]


def test_a_republished_record_whose_key_another_task_took_is_discarded(
        inbox_any: OutboxEnv) -> None:
    env = inbox_any
    app, outbox = env.sender()
    note = app.tasks["ob.note"]
    lost = note.apply_async(("a",), unique_key="k")
    env.purge(app)  # the broker lost it; meanwhile another task takes the key
    other = note.apply_async(("b",), unique_key="k")
    republished = outbox.republish(older_than=0)  # the other's own message waits
    assert (republished.sent, republished.failed) == (2, ())
    assert {r["task_id"]: r["processed"] for r in env.records()} == {lost.id: True,
                                                                     other.id: False}
    assert env.queue_depth(app) == 1
