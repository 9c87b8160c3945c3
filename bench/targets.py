"""What the benchmark runs against: brokers, databases, sizes, and the run's scratch names."""

from __future__ import annotations

import gc
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kombu import Connection, Exchange, Queue
from sqlalchemy import create_engine, inspect, text
from sqlalchemy.engine import make_url

import kombu_sqlinbox  # noqa: F401  (registers the sqlinbox+ alias)

from .registry import gist

SERVERS = {
    "postgresql": os.environ.get(
        "BENCH_POSTGRES_URL", "postgresql+psycopg2://postgres@127.0.0.1:5432/test"),
    "mysql": os.environ.get("BENCH_MYSQL_URL", "mysql+pymysql://root@127.0.0.1:3306/test"),
}
REDIS_URL = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")
AMQP_URL = os.environ.get("BENCH_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//")
#: the port of the latency section's redis-server with ``appendfsync always``
REDIS_ALWAYS_PORT = 6390
DATABASES = ("postgresql", "mysql", "sqlite")
#: database-backed broker kinds; redis and rabbitmq are measured once and shown in every group
SQL_BROKERS = ("sqlinbox", "sqla", "raw")
SERVER_BROKERS = ("redis", "rabbitmq")
BROKERS = SQL_BROKERS + SERVER_BROKERS
#: the polling interval every polling transport gets (kombu's virtual transports sleep it
#: between empty polls; Redis and RabbitMQ push instead)
POLLING_INTERVAL = 0.1
#: one per bench process: kombu sqla declares its model classes, and with them its table
#: names (``<prefix>kombu_queue``), once per process, so every context uses the same ones
RUN_ID = uuid.uuid4().hex[:6]


@dataclass(frozen=True)
class Sizes:
    publish: int = 2000
    consume: int = 5000
    tasks: int = 2000
    latency: int = 60
    #: longest any one measurement may take before it stops and reports what it got
    cap: float = 30.0

    def quick(self) -> Sizes:
        return Sizes(self.publish // 5, self.consume // 5, self.tasks // 5, 20, 15.0)


@dataclass(frozen=True)
class Target:
    """One broker on one database (or a message server, database None)."""

    broker: str
    database: str | None
    url: str
    transport_options: dict[str, Any] = field(default_factory=dict)
    polling_interval: float | None = None
    #: share of the message counts it gets: kombu sqla is two orders of magnitude slower
    scale: float = 1.0

    @property
    def label(self) -> str:
        return f"{self.broker}@{self.database}" if self.database else self.broker


@dataclass
class Context:
    """State of one section's run: its id, sizes and scratch space; leaving it cleans up."""

    sizes: Sizes = field(default_factory=Sizes)
    #: driver of the sqlinbox and sqla PostgreSQL URLs (the raw loop is psycopg2 throughout)
    pg_driver: str = "psycopg2"
    run_id: str = RUN_ID
    scratch: Path = field(init=False)
    _names: int = 0

    def __post_init__(self) -> None:
        self.scratch = Path(f"/tmp/sqlinbox-bench-{self.run_id}")
        self.scratch.mkdir(parents=True, exist_ok=True)

    @property
    def prefix(self) -> str:
        """Every table this run creates starts with it, so cleanup finds them all."""
        return f"b{self.run_id}_"

    def queue_name(self, tag: str) -> str:
        """A queue name no earlier measurement (or run) used."""
        self._names += 1
        return f"bench{self._names}_{tag}"

    def count(self, target: Target, size: int) -> int:
        return max(20, int(size * target.scale))

    def deadline(self) -> float:
        return time.monotonic() + self.sizes.cap

    def sqlite_url(self, name: str) -> str:
        return f"sqlite:///{self.scratch / name}.db"

    def url(self, database: str, sqlite_name: str) -> str:
        """SQLAlchemy URL of a database server (with this run's PostgreSQL driver), or of a
        SQLite file in the scratch directory."""
        if database == "sqlite":
            return self.sqlite_url(sqlite_name)
        url = make_url(SERVERS[database])
        if database == "postgresql":
            url = url.set(drivername=f"postgresql+{self.pg_driver}")
        return url.render_as_string(hide_password=False)

    def sqlinbox(self, database: str, sqlite_name: str = "sqlinbox", **options: Any) -> Target:
        """The sqlinbox transport on ``database``, tables prefixed for this run."""
        return Target("sqlinbox", database, "sqlinbox+" + self.url(database, sqlite_name),
                      {"table_prefix": self.prefix, "polling_interval": POLLING_INTERVAL,
                       **options}, POLLING_INTERVAL)

    def targets(self, database: str, brokers: set[str]) -> list[Target]:
        made = [self.sqlinbox(database)] if "sqlinbox" in brokers else []
        if "sqla" in brokers:
            # no polling_interval in its options: kombu sqla hands every unknown option to
            # create_engine, which refuses it; the interval is set on the transport instead
            made.append(Target(
                "sqla", database, "sqla+" + self.url(database, "sqla"),
                {"queue_tablename": self.prefix + "kombu_queue",
                 "message_tablename": self.prefix + "kombu_message"},
                POLLING_INTERVAL, scale=0.1))
        if "raw" in brokers:  # psycopg2 throughout: the raw loop drives the DBAPI itself
            made.append(Target("raw", database, SERVERS.get(database) or self.sqlite_url("raw")))
        return made

    def server_targets(self, brokers: set[str]) -> list[Target]:
        made = [Target("redis", None, REDIS_URL)] if "redis" in brokers else []
        if "rabbitmq" in brokers:
            made.append(Target("rabbitmq", None, AMQP_URL))
        return made

    def __enter__(self) -> Context:
        return self

    def __exit__(self, *exc: object) -> None:
        """Close this process's transport engines, then drop every table of this run on the
        servers and remove the SQLite files."""
        from kombu_sqlinbox.brokers import close_all

        close_all()
        gc.collect()  # let closed kombu sqla channels give their sessions back
        forget_kombu_sqla_engines()
        for url in SERVERS.values():
            try:
                drop_tables(url, self.prefix)
            except Exception as exc:  # a server that is down has nothing of ours
                print(f"cleanup of {url}: {gist(str(exc))}", file=sys.stderr)
        shutil.rmtree(self.scratch, ignore_errors=True)


def forget_kombu_sqla_engines() -> None:
    """Close kombu sqla's engines: it creates its tables when it first opens an engine for
    a URL and keeps that engine for the process, so once this run dropped the tables the
    next context's first channel must open (and create them) anew."""
    from kombu.transport.sqlalchemy import Channel

    for engine, _ in Channel._engines.values():
        engine.dispose()
    Channel._engines.clear()


def drop_tables(url: str, prefix: str) -> None:
    """Drop tables named with ``prefix``; sorted, so kombu_message goes before kombu_queue."""
    engine = create_engine(url)
    try:
        with engine.begin() as conn:
            quote = conn.dialect.identifier_preparer.quote
            for name in sorted(inspect(conn).get_table_names()):
                if name.startswith(prefix):
                    conn.execute(text(f"DROP TABLE IF EXISTS {quote(name)}"))
    finally:
        engine.dispose()


def celery_env(target: Target, queue: str) -> dict[str, str]:
    """The environment that points ``bench.celery_app`` (a worker, or the ``celery`` command)
    at ``target`` and ``queue``."""
    return {
        "BENCH_BROKER_URL": target.url,
        "BENCH_TRANSPORT_OPTIONS": json.dumps(target.transport_options),
        "BENCH_POLLING_INTERVAL": str(target.polling_interval or ""),
        "BENCH_QUEUE": queue,
        "BENCH_REDIS_URL": REDIS_URL,
    }


def connect(target: Target) -> Connection:
    """A connected kombu Connection for a broker target, with its polling interval set."""
    conn = Connection(target.url, transport_options=dict(target.transport_options),
                      connect_timeout=10)
    conn.ensure_connection(max_retries=2)
    if target.polling_interval is not None:
        conn.transport.polling_interval = target.polling_interval
    return conn


def kombu_queue(name: str) -> Queue:
    return Queue(name, Exchange(name, type="direct"), routing_key=name)


@contextmanager
def scratch_queue(target: Target, name: str) -> Iterator[Queue]:
    """A measurement's own queue, deleted from the broker when the block ends."""
    try:
        yield kombu_queue(name)
    finally:
        delete_queue(target, name)


def delete_queue(target: Target, name: str) -> None:
    """Remove a measurement's queue (and its exchange) from the broker; best effort."""
    try:
        with connect(target) as conn:
            queue = kombu_queue(name)
            bound = queue(conn.default_channel)
            bound.declare()
            bound.delete()
            if queue.exchange is not None and target.broker in SERVER_BROKERS:
                queue.exchange(conn.default_channel).delete()
    except Exception as exc:  # cleanup must not hide the figures
        print(f"cleanup of {target.label} queue {name}: {gist(str(exc))}")


@contextmanager
def redis_always(port: int = REDIS_ALWAYS_PORT) -> Iterator[str]:
    """A redis-server of our own on ``port`` (AOF, fsync on every write: the durability of
    a committed row), removed afterwards; the shared server's settings are left alone."""
    with socket.socket() as probe:
        if probe.connect_ex(("127.0.0.1", port)) == 0:
            raise RuntimeError(f"port {port} is taken")
    folder = Path(f"/tmp/sqlinbox-bench-redis-{port}")
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    server = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1",
         "--appendonly", "yes", "--appendfsync", "always", "--save", "",
         "--dir", str(folder)], stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    break
            if time.monotonic() > deadline or server.poll() is not None:
                raise RuntimeError("redis-server with appendfsync always did not start")
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        server.terminate()
        server.wait(10)
        shutil.rmtree(folder, ignore_errors=True)
