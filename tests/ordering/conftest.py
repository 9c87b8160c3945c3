"""Fixtures of the ordering suite: real consumer and worker processes on each database.

:class:`Ordering` is bound to one database and one table prefix. It starts the
kombu consumer program (:mod:`tests.ordering.apps.consumer`), ``celery worker``
processes of the ordering app (:mod:`tests.ordering.apps.tasks`) or of an
example app, and test-side kombu connections; everything it started is killed
when the test ends, and a failed test prints the processes' output.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from kombu import Connection
from sqlalchemy.engine import Engine

from tests.acceptance.conftest import (  # noqa: F401  (the hook marks failed tests)
    FAILED,
    START_LIMIT,
    Proc,
    pytest_runtest_makereport,
    wait_until,
    worker_ready,
)
from tests.ordering.apps import tasks
from tests.ordering.apps.common import WorkLog, transport_options

ROOT = Path(__file__).resolve().parents[2]
CONSUMER = "tests.ordering.apps.consumer"


class Ordering:
    """One test's database, table prefix, work log and processes."""

    def __init__(self, db_url: str, broker_url: str, prefix: str, engine: Engine,
                 tmp: Path) -> None:
        self.db_url = db_url
        self.broker_url = broker_url
        self.prefix = prefix
        self.engine = engine
        self.tmp = tmp
        self.log = WorkLog(db_url, prefix)
        self.log.create()
        self.procs: list[Proc] = []
        self.connections: list[Connection] = []
        self.apps: list[Celery] = []

    # -- processes -------------------------------------------------------------------------
    def spawn(self, name: str, argv: Sequence[str], env: dict[str, str] | None = None) -> Proc:
        env = {**os.environ, **(env or {})}
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
        proc = Proc(name, argv, env, self.tmp / f"{name}.log")
        self.procs.append(proc)
        return proc

    def consumer(self, name: str, queue: str, kind: str, *, wait: bool = True,
                 **config: Any) -> Proc:
        """The kombu consumer program; returned once it consumes (``wait``)."""
        config = {"broker": self.broker_url, "db_url": self.db_url, "prefix": self.prefix,
                  "queue": queue, "kind": kind, "out": str(self.tmp / name), **config}
        proc = self.spawn(name, [sys.executable, "-m", CONSUMER, json.dumps(config)])
        if wait:
            wait_until(self.marker(name, "ready").exists, START_LIMIT,
                       f"consumer {name} to consume", alive=[proc])
        return proc

    def marker(self, name: str, what: str) -> Path:
        """A file the consumer program leaves (``ready``, ``held``) or reads (``stop``)."""
        return self.tmp / f"{name}.{what}"

    def celery_workers(self, names: Iterable[str], app: str, env: dict[str, str],
                       pool: str = "prefork", concurrency: int = 2) -> list[Proc]:
        """Real ``celery -A app worker`` processes, returned once all are ready."""
        argv = [sys.executable, "-m", "celery", "-A", app, "worker", "-P", pool,
                "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "info"]
        if pool != "solo":
            argv += ["-c", str(concurrency)]
        started = [self.spawn(name, [*argv, "-n", f"{name}@%h"], env) for name in names]
        for proc in started:
            wait_until(partial(worker_ready, proc), START_LIMIT,
                       f"worker {proc.name} to be ready", alive=started)
        return started

    def workers(self, names: Iterable[str], queue: str, kind: str, pool: str = "prefork",
                concurrency: int = 2, **queue_options: Any) -> list[Proc]:
        """Workers of the ordering app consuming ``queue`` (a ``kind`` of table)."""
        env = tasks.worker_env(self.broker_url, self.db_url, self.prefix, queue, kind,
                               **queue_options)
        return self.celery_workers(names, "tests.ordering.apps.tasks", env, pool, concurrency)

    # -- the test side -----------------------------------------------------------------------
    def connect(self, queue: str, kind: str, **queue_options: Any) -> Connection:
        """A kombu connection whose transport options give ``queue`` its ``kind`` of table."""
        conn = Connection(self.broker_url, transport_options=transport_options(
            self.prefix, queue, kind, **queue_options))
        self.connections.append(conn)
        return conn

    def app(self, queue: str, kind: str, **queue_options: Any) -> Celery:
        """The ordering app on the test side, to send its tasks with."""
        made = tasks.make_app({"broker": self.broker_url, "db_url": self.db_url,
                               "prefix": self.prefix, "queue": queue, "kind": kind,
                               "options": queue_options})
        self.apps.append(made)
        return made

    def cleanup(self, failed: bool) -> None:
        for proc in self.procs:
            proc.kill_group()
            if proc.popen.poll() is None:
                proc.popen.wait(10)
            if failed:
                print(f"\n===== {proc.name} ({proc.log}) =====\n{proc.tail(200)}")
        for conn in reversed(self.connections):
            conn.release()
        for app in self.apps:
            app.close()
        self.log.close()


def publish(conn: Connection, queue: str, bodies: Iterable[tuple[dict[str, Any], dict[str, Any]]]
            ) -> None:
    """Declare ``queue`` and publish each (body, headers) through the default exchange."""
    conn.default_channel.queue_declare(queue)
    producer = conn.Producer()
    for body, headers in bodies:
        producer.publish(body, routing_key=queue, headers=headers)


def interleaved(groups: int, rows: int, header: str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """``rows`` messages of each of ``groups`` groups, one of each group in turn."""
    return [({"grp": f"g{g}", "seq": seq}, {header: f"g{g}"})
            for seq in range(rows) for g in range(groups)]


def wait_for_count(count: Callable[[], int], target: int, what: str, alive: Sequence[Proc],
                   stall: float = 15.0, limit: float = 120.0) -> None:
    """Wait until ``count()`` reaches ``target``; fail early when it stops moving for
    ``stall`` seconds (a stuck queue), at ``limit``, or when a process in ``alive`` exits."""
    last = {"count": -1, "at": time.monotonic()}

    def reached() -> bool:
        now = count()
        if now != last["count"]:
            last.update(count=now, at=time.monotonic())
        assert time.monotonic() - last["at"] < stall, (
            f"{what}: stuck at {now} of {target} for {stall:.0f} s")
        return now >= target

    wait_until(reached, limit, what, alive=alive)


@pytest.fixture
def ordering(request: pytest.FixtureRequest, db_url: str, broker_url: str,
             table_prefix: str, engine: Engine, tmp_path: Path) -> Iterator[Ordering]:
    made = Ordering(db_url, broker_url, table_prefix, engine, tmp_path)
    try:
        yield made
    finally:
        made.cleanup(request.node.stash.get(FAILED, False))
