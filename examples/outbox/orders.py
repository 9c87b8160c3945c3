"""The shop's own code: an order and its receipt task commit together, or neither happens."""

from __future__ import annotations

from proj import send_receipt
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

import celery_ext

SCHEMA = (
    "CREATE TABLE IF NOT EXISTS shop_orders (id INTEGER PRIMARY KEY, cents INTEGER NOT NULL)",
    "CREATE TABLE IF NOT EXISTS shop_receipts (order_id INTEGER NOT NULL)",
)


def place_order(session: Session, order_id: int, cents: int) -> None:
    """The record of ``send_receipt`` is written in the session's transaction; the message
    leaves only once that transaction commits, and never if it rolls back."""
    with celery_ext.bind(session):
        session.execute(text("INSERT INTO shop_orders (id, cents) VALUES (:id, :cents)"),
                        {"id": order_id, "cents": cents})
        send_receipt.delay(order_id)


def start(engine: Engine) -> None:
    """At start-up: the shop's tables and the outbox's, on the shop's own engine."""
    with engine.begin() as conn:
        for statement in SCHEMA:
            conn.execute(text(statement))
    from proj import outbox

    outbox.bind_engine(engine)  # share the shop's pool instead of opening another
    outbox.create()
