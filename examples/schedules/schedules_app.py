"""The schedules guide's example (docs/schedules.rst): periodic tasks kept in the database,
a scheduler in every worker (``celery -A schedules_app worker -B --scheduler
celery_ext.beat:DatabaseScheduler``), each tick sent once.

``SCHEDULES_DATABASE_URL`` names the database; ``heartbeat`` appends its task id to the
file ``SCHEDULES_LOG`` names, so that each tick can be counted.
"""

from __future__ import annotations

import os
from typing import Any

from celery import Celery
from celery.schedules import crontab

DATABASE_URL = os.environ.get("SCHEDULES_DATABASE_URL", "sqlite:///schedules.db")
LOG = os.environ.get("SCHEDULES_LOG", "heartbeats.log")

app = Celery("schedules_app", broker="sqlinbox+" + DATABASE_URL)
app.conf.broker_transport_options = {"table_prefix": "schedules_", "polling_interval": 0.1}
app.conf.beat_schedule = {
    "heartbeat": {"task": "schedules_app.heartbeat", "schedule": 1.0},
    "nightly-report": {"task": "schedules_app.report", "schedule": crontab(minute=0, hour=3),
                       "misfire": "catch_up"},
}


@app.task(bind=True)
def heartbeat(self: Any) -> None:
    with open(LOG, "a") as log:
        log.write(f"{self.request.id}\n")


@app.task
def report() -> str:
    return "report sent"
