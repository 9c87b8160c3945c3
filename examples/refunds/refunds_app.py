"""A refund service: exactly once inside the database, idempotency keys outside it.

A refund arrives as a task on the ``refunds`` queue. The task runs in the
delivery's own transaction (``transactional=True``): it writes the order's row
in ``refunds``, queues the customer's receipt on the mailer's inbox queue
``mail`` through the same transaction, and asks the card processor to pay the
money back. Everything in the database commits together with the completion of
the queue row, or not at all:

* a second delivery of the same refund hits the unique ``order_id`` and is
  dropped with nothing changed;
* a card call that times out rolls the refund row and the receipt job back and
  retries the same queue row later;
* a worker killed mid-task commits nothing and the row comes back.

The card processor and the mail relay are outside the transaction: the task
may call them again after a timeout or a crash, so each call carries a key the
other side deduplicates on (the order id).

Settings come from the environment: ``REFUNDS_DATABASE_URL`` (an SQLAlchemy
URL; default a SQLite file here), ``REFUNDS_CARD_URL``, ``REFUNDS_CARD_TIMEOUT``,
``REFUNDS_RETRY_SECONDS`` and ``REFUNDS_MAIL_DIR``. ``python run.py`` beside this
file runs the whole service once.
"""

from __future__ import annotations

import json
import os
import time
import urllib.request
from functools import cache
from pathlib import Path
from urllib.error import URLError

from celery import Celery
from sqlalchemy import Column, Double, Integer, MetaData, String, Table, create_engine, update
from sqlalchemy.engine import Engine

import kombu_sqlinbox  # noqa: F401  (registers the sqlinbox+ broker URLs)
from celery_ext.tasks import InboxTask

DATABASE_URL = os.environ.get("REFUNDS_DATABASE_URL", "sqlite:///refunds.db")
CARD_URL = os.environ.get("REFUNDS_CARD_URL", "http://127.0.0.1:8765")
CARD_TIMEOUT = float(os.environ.get("REFUNDS_CARD_TIMEOUT", "5"))
RETRY_SECONDS = float(os.environ.get("REFUNDS_RETRY_SECONDS", "10"))
MAIL_DIR = Path(os.environ.get("REFUNDS_MAIL_DIR", "outgoing-mail"))

# -- the service's own tables --------------------------------------------------------
metadata = MetaData()
refund_requests = Table(  # written by the web front end
    "refund_requests", metadata,
    Column("order_id", String(64), primary_key=True),
    Column("amount_cents", Integer, nullable=False),
    Column("requested_at", Double, nullable=False),
)
refunds = Table(  # one row per refunded order: the unique key stops a second refund
    "refunds", metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("order_id", String(64), nullable=False, unique=True),
    Column("amount_cents", Integer, nullable=False),
    Column("card_reference", String(64)),
)
receipts = Table(  # the mailer's record of receipts sent
    "receipts", metadata,
    Column("order_id", String(64), primary_key=True),
    Column("sent_at", Double, nullable=False),
)

# -- the Celery app: two inbox queues in the same database -----------------------------
app = Celery("refunds", broker=f"sqlinbox+{DATABASE_URL}")
app.conf.update(
    broker_connection_retry_on_startup=True,
    task_ignore_result=True,
    task_default_queue="refunds",
    task_routes={"refunds.send_receipt": {"queue": "mail"}},
    broker_transport_options={
        "queues": {
            # a refund the card processor keeps refusing is parked after five deliveries
            "refunds": {"max_attempts": 5, "dead_letter_queue": "refunds.parked"},
            "mail": {"max_attempts": 10},
        },
    },
)


@cache
def engine() -> Engine:
    """The service's engine, for the web front end and for reading (tasks use theirs)."""
    return create_engine(DATABASE_URL)


def create_tables() -> None:
    """The service's tables and its queues' (a migration, in production).

    Queue tables are made on first use too, but not from inside a caller's transaction
    on SQLite: there the table must exist before the first transactional enqueue.
    """
    metadata.create_all(engine())
    with app.connection_for_write() as conn:
        for queue in ("refunds", "mail"):
            conn.default_channel.queue_declare(queue)


# -- outside the database: the card processor and the mail relay -----------------------
class CardUnavailable(Exception):
    """The card processor did not answer in time: the refund may or may not have happened."""


def refund_card(order_id: str, amount_cents: int) -> str:
    """Ask the card processor to pay ``amount_cents`` back; returns its reference.

    The order id is the idempotency key: asked again after a timeout, the processor
    answers with the first refund instead of paying twice.
    """
    request = urllib.request.Request(
        f"{CARD_URL}/refunds", method="POST",
        data=json.dumps({"order_id": order_id, "amount_cents": amount_cents}).encode(),
        headers={"Content-Type": "application/json", "Idempotency-Key": f"refund-{order_id}"})
    try:
        with urllib.request.urlopen(request, timeout=CARD_TIMEOUT) as response:
            return str(json.load(response)["reference"])
    except (TimeoutError, URLError) as exc:
        raise CardUnavailable(f"card processor: {exc}") from exc


def deliver_mail(order_id: str, text: str) -> None:
    """Hand a receipt to the mail relay, which keeps one message per Message-ID (a file
    per order here), so a second delivery replaces the first instead of doubling it."""
    MAIL_DIR.mkdir(parents=True, exist_ok=True)
    partial = MAIL_DIR / f".receipt-{order_id}.eml"
    partial.write_text(f"Message-ID: <receipt-{order_id}@refunds>\n\n{text}\n")
    partial.rename(MAIL_DIR / f"receipt-{order_id}.eml")


# -- the tasks ------------------------------------------------------------------------
@app.task(base=InboxTask, transactional=True, bind=True, name="refunds.refund")
def refund(self: InboxTask, order_id: str, amount_cents: int) -> str:
    """Refund one order, once: the row, the receipt job and the queue row commit together."""
    conn = self.connection  # the delivery's transaction
    # a second refund of this order stops here: the unique key drops it, nothing changed
    conn.execute(refunds.insert().values(order_id=order_id, amount_cents=amount_cents))
    # a row in the mail queue, written in this transaction: it exists only if we commit
    send_receipt.delay(order_id, amount_cents)
    try:
        reference = refund_card(order_id, amount_cents)
    except CardUnavailable:
        # roll back the refund row and the receipt job; retry this same queue row later
        raise self.retry_after(RETRY_SECONDS) from None
    conn.execute(update(refunds).where(refunds.c.order_id == order_id)
                 .values(card_reference=reference))
    return reference


@app.task(base=InboxTask, transactional=True, bind=True, name="refunds.send_receipt")
def send_receipt(self: InboxTask, order_id: str, amount_cents: int) -> None:
    """Mail the customer's receipt, recorded once in ``receipts``."""
    self.connection.execute(receipts.insert().values(order_id=order_id, sent_at=time.time()))
    deliver_mail(order_id, f"We refunded {amount_cents / 100:.2f} for order {order_id}.")
