"""A shop that never loses a receipt: the transactional outbox on any Celery broker.

    BROKER_URL=amqp://guest:guest@localhost//        # RabbitMQ
    BROKER_URL=redis://localhost:6379/0              # Redis
    BROKER_URL=sqlinbox+postgresql://app@db/app      # the sqlinbox transport
    DATABASE_URL=postgresql://app@db/app celery -A proj worker
"""

from __future__ import annotations

import os

from celery import Celery
from sqlalchemy import text

import celery_ext
import kombu_sqlinbox  # noqa: F401  (registers the sqlinbox+ broker URLs)

BROKER_URL = os.environ.get("BROKER_URL", "amqp://guest:guest@127.0.0.1:5672//")
DATABASE_URL = os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1/test")

app = Celery("proj", broker=BROKER_URL)
app.conf.update(
    task_default_queue=os.environ.get("SHOP_QUEUE", "shop"),
    task_ignore_result=True,
    broker_connection_retry_on_startup=True,
    # where the outbox writes: read when first needed, so the engine can come later
    outbox_url=DATABASE_URL,
)

# One call: every task this app sends is recorded in shop_outbox before the broker sees
# it, marked processed when its worker is done, and sent again if it was not after a
# minute. Processed records are kept for a week.
outbox = celery_ext.install(
    app, table=os.environ.get("SHOP_OUTBOX", "shop_outbox"), grace=60.0,
    retention=7 * 86400.0)

# celery beat prunes every hour
app.conf.beat_schedule = outbox.beat_schedule(prune_every=3600.0)


@app.task(acks_late=True)
def send_receipt(order_id: int) -> None:
    """A transactional consumer: the receipt and its record's mark commit together, so a
    second delivery of this message finds the record processed and is skipped."""
    with outbox.transaction() as conn:
        conn.execute(text("INSERT INTO shop_receipts (order_id) VALUES (:order_id)"),
                     {"order_id": order_id})
