"""The web front end's part: a refund request and its task commit together.

A view records the customer's request and queues the refund in one SQLAlchemy
transaction. Inside ``celery_ext.bind(session)`` the task's queue row is written
by the session's own connection, so the refund task exists if and only if the
request commits: a view that fails after this call, or rolls back, leaves no
task behind, and no task runs before the request is visible.
"""

from __future__ import annotations

import time

from refunds_app import refund, refund_requests
from sqlalchemy.orm import Session

import celery_ext


def request_refund(session: Session, order_id: str, amount_cents: int) -> None:
    """Record the request and queue its refund in ``session``'s transaction; the caller
    commits (or rolls back) as it always does."""
    with celery_ext.bind(session):
        session.execute(refund_requests.insert().values(
            order_id=order_id, amount_cents=amount_cents, requested_at=time.time()))
        refund.delay(order_id, amount_cents)
