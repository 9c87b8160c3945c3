"""Fixtures of the ordering suite: real consumer and worker processes on each database.

:class:`Ordering` is bound to one database and one table prefix. It starts the
kombu consumer program (:mod:`tests.ordering.apps.consumer`), ``celery worker``
processes of the ordering app (:mod:`tests.ordering.apps.tasks`) or of an
example app, and test-side kombu connections; the processes belong to the test's
``processes`` fixture (killed when it ends, their output printed when it failed).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from kombu import Connection
from sqlalchemy.engine import Engine

from tests.ordering.apps import tasks
from tests.ordering.apps.common import WorkLog, transport_options
from tests.processes import START_LIMIT, Proc, Processes, wait_until

CONSUMER = "tests.ordering.apps.consumer"


class Ordering:
    """One test's database, table prefix, work log and processes."""

    def __init__(self, db_url: str, broker_url: str, prefix: str, engine: Engine,
                 processes: Processes) -> None:
        self.db_url = db_url
        self.broker_url = broker_url
        self.prefix = prefix
        self.engine = engine
        self.processes = processes
        self.tmp = processes.tmp
        self.log = WorkLog(db_url, prefix)
        self.log.create()
        self.connections: list[Connection] = []
        self.apps: list[Celery] = []

    # -- processes -------------------------------------------------------------------------
    def consumer(self, name: str, queue: str, kind: str, *, wait: bool = True,
                 **config: Any) -> Proc:
        """The kombu consumer program; returned once it consumes (``wait``)."""
        config = {"broker": self.broker_url, "db_url": self.db_url, "prefix": self.prefix,
                  "queue": queue, "kind": kind, "out": str(self.tmp / name), **config}
        proc = self.processes.spawn(name, [sys.executable, "-m", CONSUMER, json.dumps(config)])
        if wait:
            wait_until(self.marker(name, "ready").exists, START_LIMIT,
                       f"consumer {name} to consume", alive=[proc])
        return proc

    def marker(self, name: str, what: str) -> Path:
        """A file the consumer program leaves (``ready``, ``held``) or reads (``stop``)."""
        return self.tmp / f"{name}.{what}"

    def workers(self, names: Iterable[str], queue: str, kind: str, pool: str = "prefork",
                concurrency: int = 2, **queue_options: Any) -> list[Proc]:
        """Workers of the ordering app consuming ``queue`` (a ``kind`` of table)."""
        env = tasks.worker_env(self.broker_url, self.db_url, self.prefix, queue, kind,
                               **queue_options)
        return self.processes.workers("tests.ordering.apps.tasks", list(names), env, pool,
                                      concurrency)

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

    def close(self) -> None:
        """Kill the processes (before the fixtures under them drop their tables), release
        the test side."""
        self.processes.kill()
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
def ordering(db_url: str, broker_url: str, table_prefix: str, engine: Engine,
             processes: Processes) -> Iterator[Ordering]:
    made = Ordering(db_url, broker_url, table_prefix, engine, processes)
    try:
        yield made
    finally:
        made.close()
