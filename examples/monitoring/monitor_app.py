"""A Celery app set up for remote control and monitoring on a sqlinbox broker.

Workers started from it answer ``celery inspect`` and ``celery control``, send task
events and heartbeats (``-E``), and beat started from it answers ``celery inspect
ping``. ``MONITOR_BROKER`` names the broker (a SQLite file in the current directory
when unset); ``MONITOR_DIR`` is where the tasks leave their marker files, so that a
script can see what ran without a result backend.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from celery import Celery

import kombu_sqlinbox  # noqa: F401  (registers the sqlinbox+ broker URLs)

#: how long a held task waits for its release file before giving up
HOLD_LIMIT = 60.0


def make_app(broker_url: str, table_prefix: str = "sqlinbox_") -> Celery:
    """The app on ``broker_url``; a script and its workers build the same one."""
    made = Celery("monitor", broker=broker_url, set_as_current=False)
    made.conf.update(
        broker_connection_retry_on_startup=True,
        broker_transport_options={"table_prefix": table_prefix, "polling_interval": 0.1},
        task_ignore_result=True,
        # events: "task-sent" from the sender; the worker's own come with ``-E``
        task_send_sent_event=True,
        # beat answers ``celery inspect ping`` as celerybeat@<host>
        beat_enable_remote_control=True,
        # how long a caller's reply queue and a monitor's event queue outlive their
        # last use (seconds): a crashed caller leaves nothing behind for longer
        control_queue_expires=10.0,
        event_queue_expires=60.0,
    )
    return made


app = make_app(os.environ.get("MONITOR_BROKER", "sqlinbox+sqlite:///monitor.db"),
               os.environ.get("MONITOR_TABLE_PREFIX", "sqlinbox_"))


def _marker(key: str, suffix: str, **record: Any) -> None:
    """Leave ``<key>.<suffix>`` (written whole) in ``MONITOR_DIR``."""
    path = Path(os.environ.get("MONITOR_DIR", ".")) / f"{key}.{suffix}"
    partial = path.with_name(path.name + ".part")
    partial.write_text(json.dumps({"at": time.time(), "pid": os.getpid(),
                                   "host": socket.gethostname(), **record}))
    partial.rename(path)


@app.task(name="monitor.add")
def add(x: int, y: int) -> int:
    return x + y


@app.task(name="monitor.fail")
def fail(reason: str) -> None:
    raise ValueError(reason)


def mark(self: Any, key: str) -> None:
    """Leave ``<key>.ran``, naming the worker that ran it."""
    _marker(key, "ran", worker=self.request.hostname)


def hold(self: Any, key: str) -> None:
    """Leave ``<key>.started``, wait for ``<key>.release`` (bounded), leave ``<key>.done``."""
    _marker(key, "started", worker=self.request.hostname, task_id=self.request.id)
    release = Path(os.environ.get("MONITOR_DIR", ".")) / f"{key}.release"
    deadline = time.monotonic() + HOLD_LIMIT
    while not release.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {release} after {HOLD_LIMIT}s")
        time.sleep(0.05)
    _marker(key, "done")


app.task(name="monitor.mark", bind=True)(mark)
app.task(name="monitor.hold", bind=True)(hold)
# the same two under names of their own, whose rate and time limits are changed at run time
app.task(name="monitor.paced", bind=True)(mark)
app.task(name="monitor.hold_limited", bind=True)(hold)
