"""Orders and their tasks commit, or roll back, with Django's transaction."""

from __future__ import annotations

import pytest
from celery import Celery
from django.db import connection, transaction
from orders.models import Order
from orders.services import place_order
from orders.tasks import reserve_stock, send_receipt
from shopsite import celery_app
from shopsite.celery import mail
from sqlalchemy import create_engine, inspect

import celery_ext
import celery_ext.django


def queued(app: Celery = celery_app) -> list[str]:
    """The tasks waiting in the app's queue, as another connection sees them (left
    waiting)."""
    with app.connection_for_write() as conn:
        channel = conn.default_channel
        messages = []
        while (message := channel.basic_get("celery")) is not None:
            messages.append(message)
        for message in messages:
            message.reject(requeue=True)
    return sorted(message.headers["task"] for message in messages)


def test_the_migrations_created_the_inbox_and_outbox_tables() -> None:
    engine = create_engine(celery_ext.django.database_url())
    tables = set(inspect(engine).get_table_names())
    engine.dispose()
    assert {"sqlinbox_celery", "shop_outbox"} <= tables


def test_an_order_and_its_tasks_commit_together() -> None:
    order = place_order("book")
    assert Order.objects.filter(id=order.id).exists()
    assert queued() == ["orders.tasks.reserve_stock"]
    assert queued(mail) == ["mail.send_receipt"]


def test_an_order_rolled_back_leaves_no_task_and_no_record() -> None:
    before = celery_ext.outbox_of(mail).status().unprocessed
    with pytest.raises(RuntimeError), transaction.atomic(), celery_ext.bind(connection):
        Order.objects.create(item="lamp")
        reserve_stock.delay(0)
        send_receipt.delay(0)
        raise RuntimeError("payment declined")
    assert not Order.objects.filter(item="lamp").exists()
    assert queued() == queued(mail) == []
    assert celery_ext.outbox_of(mail).status().unprocessed == before


def test_the_receipt_is_sent_when_django_commits() -> None:
    with transaction.atomic(), celery_ext.bind(connection):
        order = Order.objects.create(item="pen")
        send_receipt.delay(order.id)
        assert len(connection.run_on_commit) == 1  # the send, waiting for the commit
        assert queued(mail) == []
    assert queued(mail) == ["mail.send_receipt"]


def test_the_inbox_tables_migrate_back_and_forth() -> None:
    from django.core.management import call_command

    made = {"sqlinbox_celery", "shop_outbox", "sqlinbox_schedules", "sqlinbox_schedule_ticks"}
    engine = create_engine(celery_ext.django.database_url())
    call_command("migrate", "sqlinbox", "zero", verbosity=0)
    assert not made & set(inspect(engine).get_table_names())
    call_command("migrate", "sqlinbox", verbosity=0)
    assert made <= set(inspect(engine).get_table_names())
    engine.dispose()


def test_orders_go_on_after_django_reconnects() -> None:
    connection.close()  # as at the end of a request, or after CONN_MAX_AGE
    place_order("cup")
    assert queued() == ["orders.tasks.reserve_stock"]
