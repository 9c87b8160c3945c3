"""Results in the service's database: the queues and the task results in one database.

``RESULTS_DATABASE_URL`` (an SQLAlchemy URL) names the database; the default is a SQLite
file in the working directory. ``python run.py`` beside this file runs it.
"""

from __future__ import annotations

import os

from celery import Celery

import kombu_sqlinbox  # noqa: F401  (registers the sqlinbox+ broker URLs)

DATABASE_URL = os.environ.get("RESULTS_DATABASE_URL", "sqlite:///results.db")

app = Celery("results_app", broker="sqlinbox+" + DATABASE_URL,
             backend="sqlinbox+" + DATABASE_URL)
app.conf.update(
    # the queue tables and the result tables under one prefix of the example's own
    broker_transport_options={"table_prefix": "results_"},
    # store each task's name, arguments and worker beside its result
    result_extended=True,
    # Celery's backend_cleanup (run daily by celery beat) deletes results older than this
    result_expires=24 * 3600,
)


@app.task
def add(x: int, y: int) -> int:
    return x + y


@app.task
def charge(order: int, amount: int) -> dict[str, int]:
    if amount <= 0:
        raise ValueError(f"order {order}: nothing to charge")
    return {"order": order, "charged": amount}
