"""``dead requeue`` racing a live worker: the worker takes requeued messages as they land
and parks new dead letters in the same dead-letter queue meanwhile; nothing is lost and
nothing is run or parked twice."""

from __future__ import annotations

import json
from collections import Counter
from contextlib import closing
from pathlib import Path

from celery import Celery

from kombu_sqlinbox.operations import Operations
from kombu_sqlinbox.options import parse_options
from tests.ops.apps import RUNS_ENV
from tests.ops.conftest import Cli
from tests.processes import Processes, wait_until

CURED = 60  # rejected until cured, then requeued: each must run exactly once
ALWAYS = 60  # rejected on every delivery: each must end in the dead-letter queue once


def dead_args(cli: Cli) -> Counter[int]:
    """The first argument of every dead letter as the CLI lists them, counted."""
    listed = json.loads(cli("dead", "list", "--json").stdout)
    return Counter(int(dead["task_id"].split("-")[1]) for dead in listed)


def dead_count(ops: Operations) -> int:
    """How many dead letters there are (read in this process: polled often)."""
    return sum(1 for _ in ops.dead_letters())


def runs(directory: Path) -> Counter[int]:
    return Counter(int(path.name.split(".")[0]) for path in directory.iterdir()
                   if path.name != "cured")


def test_requeue_racing_a_worker_loses_and_duplicates_nothing(
        cli: Cli, app: Celery, processes: Processes, ops_env: dict[str, str]) -> None:
    with closing(Operations(app.conf.broker_url, parse_options(
            app.conf.broker_transport_options), list(app.amqp.queues))) as ops:
        race(cli, app, processes, ops_env, ops)


def race(cli: Cli, app: Celery, processes: Processes, ops_env: dict[str, str],
         ops: Operations) -> None:
    """Park the cured-to-be tasks, then requeue them while the worker parks the others."""
    directory = Path(ops_env[RUNS_ENV])
    worker = processes.worker("tests.ops.apps", env=ops_env, args=["-Q", "jobs"])
    for key in range(CURED):
        app.send_task("ops.record", (key, "cured"), queue="jobs", task_id=f"t-{key}")
    wait_until(lambda: dead_count(ops) == CURED, 60, "every cured-to-be task to be parked",
               alive=[worker])
    (directory / "cured").touch()
    # while the requeue runs, a batch per transaction, the worker runs what comes back
    # and parks these in the same dead-letter queue (those parked before the requeue
    # looked are requeued too, and parked again)
    for key in range(CURED, CURED + ALWAYS):
        app.send_task("ops.record", (key, "always"), queue="jobs", task_id=f"t-{key}")
    moved = cli("dead", "requeue", "--task", "ops.record", "--batch", "5")
    assert int(moved.stdout.split(":")[1]) >= CURED
    wait_until(lambda: sum(runs(directory).values()) >= CURED and dead_count(ops) >= ALWAYS,
               60, "the requeued tasks to run and the others to be parked", alive=[worker])
    assert runs(directory) == Counter(range(CURED))
    assert dead_args(cli) == Counter(range(CURED, CURED + ALWAYS))
    figures = {entry["queue"]: entry for entry in json.loads(cli("queues", "--json").stdout)}
    assert figures["jobs"]["ready"] + figures["jobs"]["in_work"] == 0
