"""The rate limits guide's per-task example (docs/rate-limits.rst): a partner's API that
takes at most 10 calls a second from us, however many workers call it, beside thumbnails
made as fast as the workers go, in one queue.

``RATE_DATABASE_URL`` names the database and ``RATE_PREFIX`` the table prefix; each task
appends its name, when it ran and its number to the file ``RATE_LOG`` names, so that the
calls of every worker can be counted per second.
"""

from __future__ import annotations

import os
import time

from celery import Celery

import kombu_sqlinbox  # noqa: F401  (registers the sqlinbox+ broker URLs)
from celery_ext.rate_limits import global_rate_limits

DATABASE_URL = os.environ.get("RATE_DATABASE_URL", "sqlite:///rate.db")
LOG = os.environ.get("RATE_LOG", "calls.log")

app = Celery("task_rate_app", broker="sqlinbox+" + DATABASE_URL)
app.conf.broker_transport_options = {"table_prefix": os.environ.get("RATE_PREFIX", "rate_")}
global_rate_limits(app)  # each task's rate_limit, across every worker


def note(task: str, number: int) -> None:
    with open(LOG, "a") as log:
        log.write(f"{task} {time.time()} {number}\n")


@app.task(rate_limit="10/s")
def call_api(number: int) -> None:
    note("call_api", number)


@app.task
def make_thumbnail(number: int) -> None:
    note("make_thumbnail", number)
