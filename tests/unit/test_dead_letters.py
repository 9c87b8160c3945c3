"""What the operations commands read from a dead letter, and their refusals: a parked row
that does not read back names no task, and one with a column its queue no longer
declares is refused, never written somewhere else."""

from __future__ import annotations

import json
import uuid
from typing import cast

import pytest
from sqlalchemy import create_engine

from kombu_sqlinbox import ConfigurationError, TableBuilder
from kombu_sqlinbox.broker import QueueTable
from kombu_sqlinbox.claims import ClaimForm
from kombu_sqlinbox.codec import DEATH_HEADER, ROW_TASK_NAMESPACE
from kombu_sqlinbox.dead_letters import DeadLetter, restored, row_task
from kombu_sqlinbox.dialects import dialect_for
from kombu_sqlinbox.options import QueueOptions

EVENTS = TableBuilder("events").id().payload().attempt().locked_until().task(
    column="task").build()


def parked(body: str, columns: dict[str, str | None], **death: object) -> DeadLetter:
    record = {"queue": "events", "id": 4, "columns": columns, **death}
    message = {"body": body, "headers": {DEATH_HEADER: record}, "properties": {}}
    return DeadLetter("events.dead", 9, "events", "why", 1, 0.0, None, None, message)


def test_a_parked_row_that_does_not_read_back_names_no_task() -> None:
    dead = parked("{oops", {"payload": "utf-8", "task": None})
    assert dead.parked
    assert row_task(EVENTS, "events", dead.death, dead.message or {}) == (
        None, str(uuid.uuid5(ROW_TASK_NAMESPACE, "events/4")))


def test_a_parked_row_with_a_column_its_queue_lacks_is_refused() -> None:
    dead = parked(json.dumps({"payload": "{}", "task": "t", "gone": 1}),
                  {"payload": "utf-8", "task": None, "gone": None})
    target = QueueTable("events", EVENTS, QueueOptions(), False, False, cast(ClaimForm, None))
    dialect = dialect_for(create_engine("sqlite://"))
    with pytest.raises(ConfigurationError, match="its row has columns gone that queue "
                       "'events' does not declare"):
        restored(dialect, dead, target)


def test_the_origin_is_the_queue_of_the_first_death_record() -> None:
    dead = parked("{}", {}, previous={"queue": "jobs.dead", "previous": {"queue": "jobs"}})
    assert (dead.queue, dead.origin) == ("events", "jobs")
    assert dead.left(requeue=True) is None
    orphan = DeadLetter("events.dead", 9, None, None, None, None, None, None,
                        {"headers": {}})
    assert orphan.left(requeue=False) == "without a death record"
    assert orphan.why == "no death record: not a dead letter"
