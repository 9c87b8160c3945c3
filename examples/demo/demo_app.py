"""The demo's Celery app: task queues in a SQLite file, results in another.

``DEMO_DIR`` names the directory that holds both files; ``run.py`` sets it for
itself and for the worker it starts, so the two share the same queues.
"""

from __future__ import annotations

import os
import time

from celery import Celery
from celery.exceptions import Reject

import kombu_sqlinbox  # noqa: F401  (registers the sqlinbox+ broker URLs)

DIRECTORY = os.environ.get("DEMO_DIR", os.getcwd())

app = Celery(
    "demo",
    broker=f"sqlinbox+sqlite:///{DIRECTORY}/demo.db",
    backend=f"db+sqlite:///{DIRECTORY}/results.db",
)
app.conf.broker_connection_retry_on_startup = True
app.conf.broker_transport_options = {
    "polling_interval": 0.1,
    "queues": {
        # a message rejected without requeue, or delivered a fourth time,
        # moves to the table of queue "celery.parked" instead of vanishing
        "celery": {"dead_letter_queue": "celery.parked", "max_attempts": 3},
    },
}


@app.task
def add(x: int, y: int) -> int:
    return x + y


@app.task
def remind(note: str, sent_at: float) -> dict[str, float | str]:
    """Sent with a countdown: reports how long after sending it ran."""
    return {"note": note, "ran_after": round(time.time() - sent_at, 1)}


@app.task(acks_late=True)
def parse_order(text: str) -> int:
    """Bad input is rejected without requeue, so the message goes to the dead-letter queue.

    ``acks_late`` keeps the message unacknowledged while the task runs; an early
    ack would leave nothing to reject.
    """
    try:
        return int(text)
    except ValueError:
        raise Reject(f"not an order number: {text!r}", requeue=False) from None
