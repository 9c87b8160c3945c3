"""Outbox fixtures: a unique outbox table and queue per test, real brokers, real workers.

Brokers: RabbitMQ (``SQLINBOX_TEST_AMQP``), Redis (``SQLINBOX_TEST_REDIS``) and the
sqlinbox transport. Outbox databases: PostgreSQL, MariaDB and SQLite files, as the
``database`` fixture gives them. Every table, queue and process a test makes is removed
when it ends.
"""

from __future__ import annotations

import json
import os
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from sqlalchemy import create_engine, text
from sqlalchemy.engine import Engine

from celery_ext import Outbox
from celery_ext.outbox import engine_from_url
from kombu_sqlinbox.broker import sqlalchemy_url
from kombu_sqlinbox.dialects import dialect_for
from tests.databases import database_url, drop_tables, require_server
from tests.outbox import app as worker_app
from tests.processes import Proc, Processes

AMQP_URL = os.environ.get("SQLINBOX_TEST_AMQP", "amqp://guest:guest@127.0.0.1:5672//")
REDIS_URL = os.environ.get("SQLINBOX_TEST_REDIS", "redis://127.0.0.1:6379/7")
#: a port nothing listens on: a broker that is down
DOWN_AMQP_URL = "amqp://guest:guest@127.0.0.1:5673//"
#: outbox databases that are down: ports nothing listens on, a file that cannot be opened
DOWN_DB_URLS = {
    "postgresql": "postgresql://postgres@127.0.0.1:5439/test",
    "mysql": "mysql+pymysql://root@127.0.0.1:3309/test",
    "sqlite": "sqlite:////nonexistent-directory/outbox.db",
}


def broker_url(name: str, db_url: str) -> str:
    """``sqlinbox`` keeps its queues in the outbox database itself."""
    if name == "rabbitmq":
        return AMQP_URL
    if name == "redis":
        return REDIS_URL
    assert name == "sqlinbox", name
    return "sqlinbox+" + db_url


class OutboxEnv:
    """One test's outbox table, queue, broker, processes and task files."""

    def __init__(self, processes: Processes, broker: str, db: str) -> None:
        self.processes = processes
        self.broker = broker
        self.db = db
        tag = uuid.uuid4().hex[:8]
        self.table = f"ob{tag}"
        self.queue = f"outbox.test.{tag}"
        self.runs = processes.tmp / "runs"
        self.runs.mkdir()
        self.engine: Engine = engine_from_url(db)
        self.apps: list[tuple[Celery, Outbox]] = []
        self.quote = self.engine.dialect.identifier_preparer.quote
        with self.engine.begin() as conn:
            conn.execute(text(f"CREATE TABLE {self.quote(self.table + '_effects')} "
                              "(k VARCHAR(100) NOT NULL)"))

    # -- the two sides ---------------------------------------------------------------
    def sender(self, broker: str | None = None, create: bool = True,
               **options: Any) -> tuple[Celery, Outbox]:
        """An app of the test process with this test's outbox (the service sending tasks);
        ``create`` makes the table at start-up, as a service does (workers do it anyway);
        ``db`` replaces the outbox database (None: none yet)."""
        db = options.pop("db", self.db)
        made = worker_app.make_app(broker or self.broker, db, self.table, self.queue,
                                   **options)
        self.apps.append(made)
        if create:
            made[1].create()
        return made

    def worker(self, name: str = "w1", pool: str = "solo", concurrency: int = 1,
               start_grace: str = "off", db: str | None = None) -> Proc:
        """A real ``celery worker`` on this test's broker and outbox (or the outbox database
        ``db``), returned once ready."""
        env = {worker_app.BROKER_ENV: self.broker, worker_app.DB_ENV: db or self.db,
               worker_app.TABLE_ENV: self.table, worker_app.QUEUE_ENV: self.queue,
               worker_app.RUNS_ENV: str(self.runs), worker_app.GRACE_ENV: start_grace}
        return self.processes.worker("tests.outbox.app", name, env, pool, concurrency)

    # -- looking -------------------------------------------------------------------
    def files(self, kind: str) -> list[dict[str, Any]]:
        return [json.loads(p.read_text()) for p in self.runs.glob(f"*.{kind}")]

    def counts(self, kind: str) -> Counter[str]:
        return Counter(record["key"] for record in self.files(kind))

    def effects(self) -> Counter[str]:
        with self.engine.connect() as conn:
            rows = conn.execute(text(f"SELECT k FROM {self.quote(self.table + '_effects')}"))
            return Counter(row[0] for row in rows)

    def records(self) -> list[dict[str, Any]]:
        """Every record: id, task id, task name, whether processed."""
        with self.engine.connect() as conn:
            rows = conn.execute(text(
                f"SELECT id, task_id, task_name, processed_at FROM {self.quote(self.table)} "
                "ORDER BY id")).all()
        return [{"id": r[0], "task_id": r[1], "task_name": r[2], "processed": r[3] is not None}
                for r in rows]

    def release(self, key: str) -> None:
        (self.runs / f"{key}.release").touch()

    def queue_depth(self, app: Celery) -> int:
        """Messages waiting in the queue (declared as Celery declares it)."""
        with app.connection_for_write() as conn:
            queue = app.amqp.queues[self.queue](conn.default_channel)
            return int(queue.queue_declare().message_count)

    def purge(self, app: Celery) -> None:
        """The broker loses every waiting message."""
        with app.connection_for_write() as conn:
            queue = app.amqp.queues[self.queue](conn.default_channel)
            queue.declare()
            queue.purge()

    # -- cleaning up -----------------------------------------------------------------
    def close(self) -> None:
        """Kill the processes first: a worker still running could hold the tables."""
        self.processes.kill()
        for app, outbox in self.apps:
            if not self.broker.startswith("sqlinbox+") and app.conf.broker_url != (
                    DOWN_AMQP_URL):
                try:
                    with app.connection_for_write() as conn:
                        conn.default_channel.queue_delete(self.queue)
                except Exception as exc:  # the test may have pointed it at a dead broker
                    print(f"could not delete queue {self.queue}: {exc}")
            outbox.uninstall()
            outbox.close()
            app.close()
        with self.engine.begin() as conn:
            for name in (self.table, self.table + "_effects"):
                conn.execute(text(f"DROP TABLE IF EXISTS {self.quote(name)}"))
        if self.broker.startswith("sqlinbox+"):
            from kombu_sqlinbox.brokers import close_all

            close_all()
            broker_engine = create_engine(sqlalchemy_url(self.db))
            drop_tables(broker_engine, f"{self.table}_q_")
            broker_engine.dispose()
        self.engine.dispose()


def make_env(processes: Processes, broker: str, database: str) -> Iterator[OutboxEnv]:
    """An :class:`OutboxEnv` on ``broker`` with the outbox in ``database``, closed after."""
    db = database_url(database, processes.tmp, "outbox.db")
    made = OutboxEnv(processes, broker_url(broker, db), db)
    try:
        yield made
    finally:
        made.close()


@pytest.fixture
def rabbit_pg(processes: Processes) -> Iterator[OutboxEnv]:
    """RabbitMQ broker, PostgreSQL outbox: the most common production shape."""
    yield from make_env(processes, "rabbitmq", "postgresql")


@pytest.fixture
def any_db(processes: Processes, database: str) -> Iterator[OutboxEnv]:
    """RabbitMQ broker, the outbox on each database in turn."""
    yield from make_env(processes, "rabbitmq", database)


@pytest.fixture
def inbox_any(processes: Processes, database: str) -> Iterator[OutboxEnv]:
    """The sqlinbox broker and the outbox in one database, each database in turn."""
    yield from make_env(processes, "sqlinbox", database)


def age(env: OutboxEnv, column: str, ids: list[Any], seconds: float) -> None:
    """Move ``column`` of the records ``ids`` to ``seconds`` ago (the dialect's own clock)."""
    ago = dialect_for(env.engine).outbox_ago()
    with env.engine.begin() as conn:
        for record_id in ids:
            conn.execute(text(f"UPDATE {env.quote(env.table)} SET {column} = {ago} "
                              "WHERE id = :id"), {"older_than": seconds, "id": record_id})


@pytest.fixture
def pg_engine() -> Iterator[Engine]:
    engine = engine_from_url(require_server("postgresql"))
    yield engine
    engine.dispose()
