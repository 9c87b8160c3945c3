"""The rate limits guide's example (docs/rate-limits.rst): a partner's API that takes at
most 20 calls a second from us, however many workers call it.

``RATE_DATABASE_URL`` names the database and ``RATE_PREFIX`` the table prefix;
``call_partner`` appends when it ran and its number to the file ``RATE_LOG`` names, so
that the calls of every worker can be counted per second.
"""

from __future__ import annotations

import os
import time

from celery import Celery

import kombu_sqlinbox  # noqa: F401  (registers the sqlinbox+ broker URLs)

DATABASE_URL = os.environ.get("RATE_DATABASE_URL", "sqlite:///rate.db")
LOG = os.environ.get("RATE_LOG", "calls.log")

app = Celery("rate_app", broker="sqlinbox+" + DATABASE_URL)
app.conf.broker_transport_options = {
    "table_prefix": os.environ.get("RATE_PREFIX", "rate_"),
    "queues": {"partner": {"rate_limit": "20/s"}},  # every worker together
}
app.conf.task_routes = {"rate_app.call_partner": {"queue": "partner"}}


@app.task
def call_partner(number: int) -> None:
    with open(LOG, "a") as log:
        log.write(f"{time.time()} {number}\n")
