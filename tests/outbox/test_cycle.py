"""The core cycle with real workers: record before dispatch, mark after, republish the lost.

Runs on every broker (RabbitMQ, Redis, sqlinbox) with a PostgreSQL outbox, and on
SQLite and MariaDB outboxes.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest

from tests.outbox.conftest import OutboxEnv, make_env
from tests.processes import Processes, wait_until

CYCLES = [
    ("rabbitmq", "postgresql"),
    ("redis", "postgresql"),
    ("sqlinbox", "postgresql"),
    ("rabbitmq", "sqlite"),
    ("redis", "mysql"),
]


@pytest.fixture
def cycle(processes: Processes, broker: str, database: str) -> Iterator[OutboxEnv]:
    yield from make_env(processes, broker, database)


@pytest.mark.parametrize(("broker", "database"), CYCLES, ids=[f"{b}-{d}" for b, d in CYCLES])
def test_records_before_dispatch_marks_after_and_republishes_the_lost(cycle: OutboxEnv) -> None:
    env = cycle
    app, outbox = env.sender()
    check = app.tasks["ob.check"]
    lost = ["lost0", "lost1"]
    sent = {key: check.delay(key).id for key in lost}
    env.purge(app)  # the broker loses them; their records stay
    kept = ["kept0", "kept1", "kept2"]
    sent.update({key: check.delay(key).id for key in kept})

    records = env.records()
    assert sorted(r["task_id"] for r in records) == sorted(sent.values())  # one per send
    assert not any(r["processed"] for r in records)
    assert {r["task_name"] for r in records} == {"ob.check"}

    worker = env.worker(start_grace="0")  # republish at start sends every unprocessed record
    wait_until(lambda: set(env.counts("run")) == set(sent), 60, "every task to run",
               alive=[worker])
    wait_until(lambda: all(r["processed"] for r in env.records()), 30,
               "every record to be marked processed", alive=[worker])

    republished = wait_until(lambda: re.search(r"republished (\d+) record", worker.output()),
                             10, "the republish at worker start", alive=[worker])
    duplicates = int(republished.group(1)) - len(lost)  # kept tasks that had not run yet
    wait_until(lambda: worker.output().count("duplicate delivery") == duplicates, 30,
               f"{duplicates} duplicate deliveries to be skipped", alive=[worker])

    for run in env.files("run"):
        record = run["record"]
        assert record["found"] and not record["processed"], run  # recorded before consumed
        assert record["task_id"] == run["task_id"] == sent[run["key"]]
    assert env.counts("run") == dict.fromkeys(sent, 1)
    status = outbox.status()
    assert (status.unprocessed, status.processed, status.oldest_unprocessed_age) == (0, 5, None)
