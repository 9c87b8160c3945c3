"""The Celery app of the chaos runs (``bench/chaos.py``): one task, and a ledger of its runs.

``celery -A bench.chaos_app worker`` reads its configuration from ``CHAOS_CONFIG`` (JSON:
``broker``, ``options`` (the transport options), ``queue``, ``ledger`` (a SQLite file),
``max_priority``, ``prefetch``); the chaos command builds the same app with
:func:`make_app` to publish.

The ledger is a SQLite file of its own, away from the broker under test, so a fault of
the broker's database cannot hide or delay what is written: a ``start`` row when a
delivery begins to run, ``done`` when its body finished, ``acked`` once kombu's ack of its
message returned (Celery's late ack, in the worker's main process). A delivery is one
message: the job's key and Celery's retry count (a retry is a new message).

A job that ran again after its ack counts as run twice after finishing, whatever the
reason; ``bench/chaos.py`` tells whether its worker was killed after the ack (an ack this
transport had queued but not yet written, or one still on its way to Redis or RabbitMQ)
or not.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import time
from functools import cache
from typing import Any

from celery import Celery, Task
from kombu import Queue
from kombu.message import Message

import kombu_sqlinbox  # noqa: F401  (registers the sqlinbox+ alias)

CONFIG_ENV = "CHAOS_CONFIG"
TASK = "chaos.job"
#: seconds before a failing job's retry runs
RETRY_DELAY = 0.2

# a log line per task would make the worker logs the busiest writer; failures still show
for _name in ("celery.app.trace", "celery.worker.strategy"):
    logging.getLogger(_name).setLevel(logging.WARNING)


@cache
def ledger(path: str, pid: int) -> sqlite3.Connection:
    """This process's connection to the ledger (``pid``: a new one after a fork); the chaos
    run made the file, in WAL mode (switching needs the file to itself: a task doing it
    failed now and then, its job lost to the run and not to the broker)."""
    conn = sqlite3.connect(path, timeout=60.0, isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA synchronous=NORMAL")
    return conn


#: the ledger's one table: a row per event (``kill``: of process ``pid``, by the chaos run)
LEDGER = ("CREATE TABLE IF NOT EXISTS runs (key TEXT NOT NULL, retries INTEGER NOT NULL, "
          "event TEXT NOT NULL, pid INTEGER NOT NULL, at REAL NOT NULL)")


def record(path: str, key: str, retries: int, event: str, pid: int | None = None,
           at: float | None = None) -> None:
    """One ledger row (by default of this process, now), committed before this returns."""
    ledger(path, os.getpid()).execute("INSERT INTO runs VALUES (?, ?, ?, ?, ?)",
                                      (key, retries, event, pid or os.getpid(), at or time.time()))


def job(self: Task, key: str, fails: int, work: float) -> None:
    """Fail (Celery's retry: a new message) the first ``fails`` deliveries, then work for
    ``work`` seconds and record it done."""
    path, retries = self.app.conf.chaos["ledger"], int(self.request.retries or 0)
    record(path, key, retries, "start")
    if retries < fails:
        raise self.retry(countdown=RETRY_DELAY, max_retries=fails)
    time.sleep(work)
    record(path, key, retries, "done")


def acknowledge(self: Message, multiple: bool = False) -> None:
    """kombu's ack (where Celery's late ack lands, in the worker's main process, at once or
    on its event loop's next turn), then an ``acked`` row for a chaos job's message."""
    _acknowledge(self, multiple)
    if CONFIG and self.headers.get("task") == TASK:
        record(CONFIG["ledger"], str(self.payload[0][0]), int(self.headers.get("retries") or 0),
               "acked")


_acknowledge = Message.ack
Message.ack = acknowledge  # type: ignore[method-assign]


def make_app(config: dict[str, Any]) -> Celery:
    """The chaos app on ``config['broker']``, its one queue and task."""
    made = Celery("chaos", broker=config["broker"], set_as_current=False)
    arguments = {"x-max-priority": config["max_priority"]} if config.get("max_priority") else {}
    made.conf.update(
        broker_transport_options=config.get("options", {}),
        broker_connection_retry_on_startup=True,
        broker_connection_max_retries=None,
        task_queues=[Queue(config["queue"], routing_key=config["queue"],
                           queue_arguments=arguments or None)],
        task_default_queue=config["queue"],
        task_acks_late=True,
        task_ignore_result=True,
        worker_prefetch_multiplier=config.get("prefetch", 4),
        worker_redirect_stdouts=False,
        worker_enable_remote_control=False,
        chaos=config,
    )
    made.task(name=TASK, bind=True, shared=False)(job)
    return made


CONFIG: dict[str, Any] | None = json.loads(os.environ.get(CONFIG_ENV, "null"))
app = make_app(CONFIG or {"broker": "memory://", "queue": "chaos",
                          "ledger": "/tmp/chaos-unconfigured.db"})
