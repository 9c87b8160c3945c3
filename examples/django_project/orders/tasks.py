from __future__ import annotations

from celery import shared_task
from shopsite.celery import mail


@shared_task
def reserve_stock(order_id: int) -> str:
    return f"reserved stock for order {order_id}"


@mail.task(name="mail.send_receipt")
def send_receipt(order_id: int) -> str:
    return f"sent the receipt of order {order_id}"
