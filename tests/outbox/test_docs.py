"""docs/outbox.rst runs as written: examples/outbox on RabbitMQ, Redis and sqlinbox."""

from __future__ import annotations

import importlib
import sys
import uuid
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import celery._state as celery_state
import pytest
from click.testing import CliRunner
from sqlalchemy import text
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from celery_ext.outbox import engine_from_url
from celery_ext.outbox_cli import main
from kombu_sqlinbox.tables import table_name_for_queue
from tests.databases import require_server
from tests.docs.support import EXAMPLES
from tests.outbox.conftest import AMQP_URL, REDIS_URL
from tests.processes import Processes, wait_until

EXAMPLE = EXAMPLES / "outbox"


class Shop:
    """The example's modules, imported as the docs run them, and what they leave."""

    def __init__(self, env: dict[str, str], engine: Engine) -> None:
        self.env = env
        self.engine = engine
        self.proj: ModuleType = importlib.import_module("proj")
        self.orders: ModuleType = importlib.import_module("orders")

    def receipts(self) -> list[int]:
        with self.engine.connect() as conn:
            return [r[0] for r in conn.execute(text("SELECT order_id FROM shop_receipts"))]

    def cli(self, *args: str) -> str:
        """``python -m celery_ext.outbox_cli -A proj ...``, run in this process."""
        done = CliRunner().invoke(main, ["-A", "proj", *args], catch_exceptions=False)
        assert done.exit_code == 0, done.output
        return done.output


@pytest.fixture(params=["rabbitmq", "redis", "sqlinbox"])
def shop(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
         ) -> Iterator[Shop]:
    database = require_server("postgresql")
    broker = {"rabbitmq": AMQP_URL, "redis": REDIS_URL,
              "sqlinbox": "sqlinbox+" + database}[request.param]
    tag = uuid.uuid4().hex[:8]
    settings = {"BROKER_URL": broker, "DATABASE_URL": database,
                "SHOP_QUEUE": f"shop_{tag}", "SHOP_OUTBOX": f"shop_outbox_{tag}"}
    for name, value in settings.items():
        monkeypatch.setenv(name, value)
    monkeypatch.syspath_prepend(str(EXAMPLE))
    env = {"PYTHONPATH": str(EXAMPLE)}  # the worker's, over this process's environment
    engine = engine_from_url(database)
    for module in ("proj", "orders"):
        sys.modules.pop(module, None)
    # the example's shared task would join every app created later in this process
    finalizers = set(celery_state._on_app_finalizers)
    made = Shop(env, engine)
    try:
        yield made
    finally:
        cleanup(made, settings, request.param)
        celery_state._on_app_finalizers.intersection_update(finalizers)


def cleanup(shop: Shop, settings: dict[str, str], broker: str) -> None:
    app, outbox = shop.proj.app, shop.proj.outbox
    if broker == "sqlinbox":
        from kombu_sqlinbox.brokers import close_all

        close_all()
        tables = [table_name_for_queue(settings["SHOP_QUEUE"])]
    else:
        with app.connection_for_write() as conn:
            conn.default_channel.queue_delete(settings["SHOP_QUEUE"])
        tables = []
    outbox.uninstall()
    app.close()
    with shop.engine.begin() as conn:
        for table in [*tables, settings["SHOP_OUTBOX"], "shop_orders", "shop_receipts"]:
            conn.execute(text(f'DROP TABLE IF EXISTS "{table}"'))
    shop.engine.dispose()
    for module in ("proj", "orders"):
        sys.modules.pop(module, None)


def test_the_shop_sends_a_receipt_for_committed_orders_only(shop: Shop, processes: Processes
                                                            ) -> None:
    shop.orders.start(shop.engine)
    with Session(shop.engine) as session:
        shop.orders.place_order(session, 1, 1999)
        session.commit()
    with Session(shop.engine) as session:
        shop.orders.place_order(session, 2, 500)
        session.rollback()

    worker = processes.worker("proj", "shop", shop.env, pool="solo")
    wait_until(lambda: shop.receipts() == [1], 30, "the receipt of order 1", alive=[worker])
    status: dict[str, Any] = {}

    def processed() -> bool:
        out = shop.cli("status")
        for line in out.splitlines():
            name, _, value = line.partition(": ")
            status[name] = value
        return status.get("processed") == "1"

    wait_until(processed, 30, "the record to be processed", alive=[worker])
    assert status["unprocessed"] == "0"
    assert shop.cli("republish", "--older-than", "0") == (
        "republished: 0\nfailed (see the log): none\nheld back for their eta: 0\n")
    assert shop.cli("prune", "--older-than", "0") == "pruned: 1\n"
