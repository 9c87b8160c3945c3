"""The Celery app the ordering tests run as real ``celery worker`` processes.

Configured from the environment (see :func:`worker_env`): the broker, the
test's table prefix, the queue its tasks go to, the kind of table that queue
has and its queue options. Tasks use :class:`celery_ext.tasks.InboxTask`
(late acks, retry in place) and write every run to the test's work log.
"""

from __future__ import annotations

import json
import os
import random
import time
from typing import Any

from celery import Celery
from celery.exceptions import Reject

from celery_ext.tasks import InboxTask
from tests.ordering.apps.common import WorkLog, transport_options

ENV = "SQLINBOX_ORDERING"


def worker_env(broker: str, db_url: str, prefix: str, queue: str, kind: str,
               **queue_options: Any) -> dict[str, str]:
    """The environment that configures this app (the test side passes it to workers)."""
    return {ENV: json.dumps({"broker": broker, "db_url": db_url, "prefix": prefix,
                             "queue": queue, "kind": kind, "options": queue_options})}


def make_app(config: dict[str, Any]) -> Celery:
    import kombu_sqlinbox  # noqa: F401  (registers the sqlinbox alias)

    made = Celery("ordering", broker=config["broker"], set_as_current=False)
    made.conf.update(
        broker_transport_options=transport_options(
            config["prefix"], config["queue"], config["kind"], **config["options"]),
        broker_connection_retry_on_startup=True,
        task_default_queue=config["queue"],
        task_ignore_result=True,
        worker_redirect_stdouts=False,
    )
    return made


CONFIG: dict[str, Any] = json.loads(os.environ.get(ENV, "null")) or {
    "broker": "memory://", "db_url": "sqlite://", "prefix": "x_", "queue": "jobs",
    "kind": "plain", "options": {}}
app = make_app(CONFIG)
_log: WorkLog | None = None


def log() -> WorkLog:
    """The work log, opened on first use: in the process that runs the task, never before a
    fork."""
    global _log
    if _log is None:
        _log = WorkLog(CONFIG["db_url"], CONFIG["prefix"])
    return _log


@app.task(base=InboxTask, bind=True, name="ord.step")
def step(self: InboxTask, grp: str, seq: int, requeue_rate: float = 0.0,
         retry_rate: float = 0.0) -> None:
    """One row of a FIFO group: a few milliseconds of work, then at random given back in
    place (requeue or retry_after(0))."""
    started = time.time()
    time.sleep(random.uniform(0.001, 0.005))
    roll = random.random()
    if roll < requeue_rate:
        log().record(grp, seq, "requeue", started, time.time())
        raise Reject("requeued at random", requeue=True)
    if roll < requeue_rate + retry_rate:
        log().record(grp, seq, "retry", started, time.time())
        raise self.retry_after(0)
    log().record(grp, seq, "done", started, time.time())


@app.task(base=InboxTask, bind=True, name="ord.retry_once")
def retry_once(self: InboxTask, key: str, seconds: float) -> None:
    """Retry in place once, ``seconds`` later; the second delivery completes."""
    started = time.time()
    if not (self.request.delivery_info or {}).get("redelivered"):
        log().record(key, 0, "retry", started, time.time())
        raise self.retry_after(seconds)
    log().record(key, 1, "done", started, time.time())


@app.task(base=InboxTask, name="ord.run_for")
def run_for(grp: str, seq: int, seconds: float) -> None:
    """A row that is in work for ``seconds`` (a long task holds its key meanwhile)."""
    started = time.time()
    time.sleep(seconds)
    log().record(grp, seq, "done", started, time.time())
