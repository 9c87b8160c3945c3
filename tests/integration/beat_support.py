"""What the scheduler's tests share: an app on the database under test, its schedules, the
task ids sent to its queue, and the racing scheduler processes."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, NoReturn

from celery import Celery
from kombu import Connection
from sqlalchemy import event

from celery_ext.beat import Schedules


def make_app(broker_url: str, prefix: str) -> Celery:
    app = Celery("beat_tests", broker=broker_url, set_as_current=False)
    app.conf.broker_transport_options = {"table_prefix": prefix, "polling_interval": 0.05}
    app.conf.task_default_queue = "beat"
    return app


def sent_ids(broker_url: str, prefix: str) -> list[str]:
    """The ids of the tasks in the ``beat`` queue (each drained once)."""
    found: list[str] = []
    with Connection(broker_url, transport_options={"table_prefix": prefix}) as conn:
        queue = conn.SimpleQueue("beat")
        while True:
            try:
                message = queue.get(timeout=0.2)
            except queue.Empty:
                return found
            found.append(message.headers["id"])
            message.ack()


def race(broker_url: str, prefix: str, ready: Any, go: Any, seconds: float, out: str
         ) -> None:
    """A scheduler process: once ``go`` is set (after it set ``ready``), tick as fast as
    it can for ``seconds``, then write how many ticks it sent to ``out``."""
    store = Schedules.for_app(make_app(broker_url, prefix))
    store.ensure()
    ready.set()
    go.wait(60)
    sent = 0
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        sent += len(store.run_due())
    Path(out).write_text(str(sent))
    store.close()


def stall(broker_url: str, prefix: str, flag: str) -> NoReturn:
    """A scheduler that stops inside its tick's transaction once its tick row and its
    task's row are written (as it moves the schedule on), and says so in ``flag``: a
    parent kills it there."""
    def hold(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if "SET next_run_at" in statement:
            Path(flag).write_text(str(os.getpid()))
            time.sleep(600)

    store = Schedules.for_app(make_app(broker_url, prefix))
    event.listen(store.database.engine, "before_cursor_execute", hold)
    while True:  # until the schedule falls due here and the tick stops in it
        store.run_due()
