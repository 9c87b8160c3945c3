"""Fixtures of the transactional suite: the refund example under real workers.

One :class:`Service` per database and pool: a database of its own (a fresh
PostgreSQL or MariaDB database, or a SQLite file) holding the example's tables
and queues, the fake card processor, and one ``celery worker`` of
:mod:`tests.transactional.apps.service` consuming every queue. It is shared by
the tests of this package (package scope: ``database`` and ``pool`` are
parametrised at that scope), so each worker starts once; tests use order ids of
their own and leave the queues drained. The test process's
side of the example app (``refund.delay``, ``web.request_refund``) is pointed at
the service's database while its tests run.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import kombu.pools
import pytest
from sqlalchemy import Engine, create_engine, func, select, text

from tests.databases import DATABASES, fresh_database
from tests.processes import Proc, Processes, wait_until
from tests.transactional.apps import service as service_app
from tests.transactional.apps.service import card_processor, refunds_app

POOLS = ("prefork", "threads", "solo")
#: the card client's timeout in the workers: a timed-out call costs this much, and a held
#: one (a test looking at the open transaction) must be released within it
CARD_TIMEOUT = 2.0
#: the lease of the example's queues: a row a dead process held comes back this soon
VISIBILITY_TIMEOUT = 5.0
#: the longest any outcome may take to show
SETTLE_LIMIT = 30.0
REFUND = "refunds.refund"
RECEIPT = "refunds.send_receipt"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "pools(*names): run a service test only on these worker pools")


@pytest.hookimpl(tryfirst=True)  # before the ``database`` fixture parametrises at its scope
def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Each test using ``service`` runs once per database and pool (the ``databases`` marker
    and option narrow the databases as everywhere, the ``pools`` marker the pools); tests
    with the same pair share one service, in package scope."""
    if "service" not in metafunc.fixturenames:
        return
    pools = metafunc.definition.get_closest_marker("pools")
    metafunc.parametrize("database", DATABASES, scope="package")
    metafunc.parametrize("pool", pools.args if pools else POOLS, scope="package")


def drop_app_connections() -> None:
    """Close the connections and producers this process pooled (kombu keeps them in
    process-wide pools, keyed by URL), so the example app's next publish opens new ones."""
    kombu.pools.reset()
    app = service_app.app
    app.close()
    app.amqp._producer_pool = None


@contextmanager
def pointed_at(db_url: str) -> Iterator[None]:
    """Point the test process's side of the example app at ``db_url`` for the block, then
    back where it was."""
    previous = str(service_app.app.conf.broker_url).removeprefix("sqlinbox+")
    drop_app_connections()
    service_app.configure(db_url)
    try:
        yield
    finally:
        drop_app_connections()
        service_app.configure(previous)


@pytest.fixture(autouse=True)
def _fresh_app_connections() -> None:
    """tests/conftest.py closes this process's brokers after every test, and a pooled kombu
    connection would keep using its closed one: each test starts with new connections."""
    drop_app_connections()


def queue_rows(engine: Engine, queue: str) -> int:
    """Rows of a queue's table committed and visible to a connection of our own."""
    table = engine.dialect.identifier_preparer.quote(service_app.table_of(queue))
    with engine.connect() as conn:
        return int(conn.execute(text(f"SELECT COUNT(*) FROM {table}")).scalar_one())


class Service:
    """The refund example on one database under one worker pool."""

    def __init__(self, kind: str, pool: str, db_url: str, processes: Processes) -> None:
        self.kind = kind
        self.pool = pool
        self.db_url = db_url
        self.processes = processes
        self.runs = processes.tmp / "runs"
        self.runs.mkdir()
        self.mail = processes.tmp / "mail"
        self.engine: Engine = create_engine(db_url)
        refunds_app.metadata.create_all(self.engine)
        service_app.probe_metadata.create_all(self.engine)
        self.card = card_processor.FakeCardProcessor(late_by=CARD_TIMEOUT + 1.0)
        self.worker: Proc | None = None

    def start(self) -> None:
        """A ``celery worker`` on every queue of the service (pool ``-c 2``), once ready."""
        env = {"REFUNDS_DATABASE_URL": self.db_url, "REFUNDS_CARD_URL": self.card.url,
               "REFUNDS_CARD_TIMEOUT": str(CARD_TIMEOUT), "REFUNDS_RETRY_SECONDS": "0.1",
               "REFUNDS_MAIL_DIR": str(self.mail), service_app.RUNS_ENV: str(self.runs),
               service_app.VISIBILITY_ENV: str(VISIBILITY_TIMEOUT)}
        self.worker = self.processes.worker(
            "tests.transactional.apps.service", "w1", env, self.pool, 2,
            args=["-Q", ",".join(self.queues())])

    def close(self, failed: bool) -> None:
        self.processes.close(failed)
        self.card.close()
        self.engine.dispose()

    # -- waiting ----------------------------------------------------------------------------
    def wait(self, predicate: Callable[[], Any], what: str,
             timeout: float = SETTLE_LIMIT) -> Any:
        """Poll until ``predicate()`` is truthy; fail early if the worker died."""
        alive = [self.worker] if self.worker is not None else []
        return wait_until(predicate, timeout, what, alive=alive, interval=0.05)

    def wait_drained(self) -> None:
        """Every queue of the service is empty: nothing waits, runs or is held."""
        self.wait(self.drained, "every queue to drain")

    def drained(self) -> bool:
        return not any(self.queue_rows(queue) for queue in self.queues())

    def check_refunded_once(self, order_id: str) -> None:
        """One ``refunds`` row carrying the processor's one refund, one receipt sent once,
        and every queue drained."""
        self.wait(lambda: self.receipts(order_id) == 1, f"the receipt of {order_id}")
        self.wait_drained()
        key = f"refund-{order_id}"
        assert self.refund_rows(order_id) == [(order_id, self.card.refunded()[key])]
        assert self.receipts(order_id) == 1
        assert len(self.runs_of(RECEIPT, order_id)) == 1
        assert (self.mail / f"receipt-{order_id}.eml").exists()

    # -- looking ----------------------------------------------------------------------------
    def queues(self) -> list[str]:
        return ["refunds", "mail", *service_app.probe_queues(self.db_url)]

    def queue_rows(self, queue: str) -> int:
        return queue_rows(self.engine, queue)

    def count(self, table: Any, *where: Any) -> int:
        with self.engine.connect() as conn:
            return int(conn.execute(select(func.count()).select_from(table)
                                    .where(*where)).scalar_one())

    def refund_rows(self, order_id: str) -> list[tuple[Any, ...]]:
        refunds = refunds_app.refunds
        with self.engine.connect() as conn:
            return [tuple(row) for row in conn.execute(
                select(refunds.c.order_id, refunds.c.card_reference)
                .where(refunds.c.order_id == order_id))]

    def receipts(self, order_id: str) -> int:
        return self.count(refunds_app.receipts, refunds_app.receipts.c.order_id == order_id)

    def note(self, key: str) -> str | None:
        """What a probe task noted under ``key``, if it ran."""
        path = self.runs / f"{key}.note"
        return str(json.loads(path.read_text())["what"]) if path.exists() else None

    def runs_of(self, task: str, first_arg: str) -> list[dict[str, Any]]:
        """The ``task_prerun`` records of ``task`` called with ``first_arg``."""
        found = [json.loads(path.read_text()) for path in self.runs.glob("*.prerun")]
        return [run for run in found if run["task"] == task and run["args"][:1] == [first_arg]]

    def effects(self, key: str) -> int:
        """How many effect rows of ``key`` are committed (at most one: it is the key)."""
        return self.count(service_app.probe_effects,
                          service_app.probe_effects.c.effect_key == key)

    def failure(self, task_id: str) -> dict[str, Any] | None:
        path = self.runs / f"{task_id}.failure"
        return json.loads(path.read_text()) if path.exists() else None


@pytest.fixture(scope="package")
def service(request: pytest.FixtureRequest, database: str, pool: str,
            tmp_path_factory: pytest.TempPathFactory,
            failed: Callable[[pytest.Item], bool]) -> Iterator[Service]:
    tmp = tmp_path_factory.mktemp(f"tx-{database}-{pool}")
    with fresh_database(database, tmp) as db_url:
        made = Service(database, pool, db_url, Processes(tmp))
        try:
            made.start()
            with pointed_at(db_url):
                yield made
        finally:
            made.close(failed=any(
                failed(item) for item in request.session.items
                if "service" in getattr(item, "fixturenames", ())
                and item.callspec.params["database"] == database
                and item.callspec.params["pool"] == pool))


@pytest.fixture
def order_id() -> str:
    """An order id no other test uses."""
    return f"o-{uuid.uuid4().hex[:10]}"
