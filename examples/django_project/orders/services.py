"""Placing an order: the order, its stock reservation and its receipt commit together."""

from __future__ import annotations

from django.db import connection, transaction

import celery_ext

from .models import Order
from .tasks import reserve_stock, send_receipt


# place-order-start
def place_order(item: str) -> Order:
    with transaction.atomic(), celery_ext.bind(connection):
        order = Order.objects.create(item=item)
        reserve_stock.delay(order.id)  # a queue row, in this transaction
        send_receipt.delay(order.id)  # an outbox record now, sent on commit
    return order
# place-order-end
