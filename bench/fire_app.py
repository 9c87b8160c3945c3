"""The Celery app of ``bench/fire.py``: chord parts, a chord body and plain jobs, each run
recorded in a ledger of its own.

``celery -A bench.fire_app worker`` reads its configuration from ``FIRE_CONFIG`` (JSON:
``broker``, ``backend``, ``prefix`` (the tables'), ``queue``, ``lease``, ``ledger`` (a
SQLite file)) and its worker's name from ``FIRE_WORKER``; the bench builds the same app
with :func:`make_app` to publish and wait.

The ledger is away from the broker and the result backend under test, so what it says
does not depend on them: a ``start`` row as a run begins, ``end`` as its body returns
(before its result is written), each with the run's random token, which is also what
the run returns; ``body`` as a chord's body begins. A stored result therefore names the
run that wrote it, and a run after it in the ledger ran a task whose result was stored.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from typing import Any

from celery import Celery, Task
from kombu import Queue

import kombu_sqlinbox  # noqa: F401  (registers the sqlinbox+ alias)
from bench.chaos_app import ledger  # (also quiets the per-task log lines of the workers)

CONFIG_ENV, WORKER_ENV = "FIRE_CONFIG", "FIRE_WORKER"
PART, BODY, JOB = "fire.part", "fire.body", "fire.job"
#: the ledger's one table: a row per event of a run (``worker``: its worker's name)
RUNS = ("CREATE TABLE IF NOT EXISTS runs (task_id TEXT NOT NULL, token TEXT NOT NULL, "
        "event TEXT NOT NULL, worker TEXT NOT NULL, at REAL NOT NULL)")


def note(task: Task, token: str, event: str) -> None:
    """One ledger row for this run, committed before this returns."""
    ledger(task.app.conf.fire["ledger"], os.getpid()).execute(
        "INSERT INTO runs VALUES (?, ?, ?, ?, ?)",
        (task.request.id, token, event, os.environ.get(WORKER_ENV, "?"), time.time()))


def run(task: Task, work: float) -> str:
    """A recorded run of ``work`` seconds; its token."""
    token = uuid.uuid4().hex[:12]
    note(task, token, "start")
    time.sleep(work)
    note(task, token, "end")
    return token


def part(self: Task, n: int, work: float) -> list[Any]:
    """A chord's header task: its place and its run's token."""
    return [n, run(self, work)]


def body(self: Task, values: list[Any]) -> list[Any]:
    """A chord's body: recorded as it begins; returns the values it got."""
    note(self, "-", "body")
    return values


def job(self: Task, work: float) -> str:
    return run(self, work)


def make_app(config: dict[str, Any]) -> Celery:
    """The fire app: late acks, results kept, one queue."""
    made = Celery("fire", broker=config["broker"], backend=config["backend"],
                  set_as_current=False)
    made.conf.update(
        broker_transport_options={"table_prefix": config["prefix"], "polling_interval": 0.2,
                                  "visibility_timeout": config["lease"]},
        broker_connection_retry_on_startup=True,
        task_queues=[Queue(config["queue"], routing_key=config["queue"])],
        task_default_queue=config["queue"],
        task_acks_late=True,
        task_ignore_result=False,
        result_expires=3600,
        worker_redirect_stdouts=False,
        worker_enable_remote_control=False,
        fire=config,
    )
    for name, function in ((PART, part), (BODY, body), (JOB, job)):
        made.task(name=name, bind=True, shared=False)(function)
    return made


CONFIG: dict[str, Any] | None = json.loads(os.environ.get(CONFIG_ENV, "null"))
app = make_app(CONFIG or {"broker": "memory://", "backend": "cache+memory://",
                          "prefix": "fire_", "queue": "fire", "lease": 10.0,
                          "ledger": "/tmp/fire-unconfigured.db"})
