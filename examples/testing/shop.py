"""A small shop service whose tests run on a real inbox with the sqlinbox_* fixtures."""

from __future__ import annotations

import threading

from celery import Celery
from celery.exceptions import Reject

import celery_ext
import kombu_sqlinbox  # noqa: F401  (registers the sqlinbox+ broker URLs)

app = Celery("shop", broker="sqlinbox+sqlite:///shop.db")
app.conf.update(
    task_ignore_result=True,
    broker_connection_retry_on_startup=True,
    broker_transport_options={
        "visibility_timeout": 30,
        "queues": {"celery": {"dead_letter_queue": "celery.parked", "max_attempts": 3}},
    },
)
# every task is recorded before it is sent, and sent again when unprocessed after a minute
outbox = celery_ext.install(app, table="shop_outbox", grace=60.0)

#: set when the worker has shipped an order (the worker runs in the test's process)
shipped = threading.Event()


@app.task
def remind(order_id: int) -> str:
    return f"reminded {order_id}"


@app.task
def charge(order_id: int) -> str:
    return f"charged {order_id}"


@app.task(bind=True, max_retries=1)
def notify_courier(self, order_id: int) -> str:
    if not self.request.retries:  # the courier's API is down: again in a minute
        raise self.retry(countdown=60)
    return f"courier notified of order {order_id}"


@app.task(acks_late=True)
def flaky_import(order_id: int) -> None:
    # the supplier's feed is down: give the message back, again and again
    raise Reject("supplier feed down", requeue=True)


@app.task
def ship(order_id: int) -> str:
    shipped.set()
    return f"shipped {order_id}"
