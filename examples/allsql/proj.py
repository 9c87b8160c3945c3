"""The all-SQL stack: task queues and task results in one PostgreSQL database.

The broker is kombu-sqlinbox; the result backend is Celery's own SQLAlchemy
backend (``db+``). Both need nothing beyond SQLAlchemy and a driver.

    DATABASE_URL=postgresql://app@db/app celery -A proj worker
"""

from __future__ import annotations

import os

from celery import Celery

import kombu_sqlinbox  # noqa: F401  (registers the sqlinbox+ broker URLs)

DATABASE_URL = os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1/test")

app = Celery("proj", broker=f"sqlinbox+{DATABASE_URL}", backend=f"db+{DATABASE_URL}")
app.conf.update(
    broker_connection_retry_on_startup=True,
    task_default_queue="proj",  # its table: sqlinbox_proj
    # Celery's default result tables are celery_taskmeta / celery_groupmeta
    database_table_names={"task": "proj_taskmeta", "group": "proj_groupmeta"},
)


@app.task
def invoice_total(prices: list[float]) -> float:
    return round(sum(prices), 2)
