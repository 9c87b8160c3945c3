"""Acceptance fixtures: real worker processes over the real databases.

Each test gets an :class:`Acceptance` bound to one database and one table
prefix. The processes it starts belong to the test's ``processes`` fixture
(:class:`tests.processes.Processes`): each is killed when the test ends,
whatever happened, and a failed test prints their output.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from sqlalchemy import bindparam, text
from sqlalchemy.engine import Engine

from bench.chaos_faults import process_ports
from kombu_sqlinbox.tables import table_name_for_queue
from tests.acceptance.apps import tasks
from tests.processes import Proc, Processes, wait_until

APP = "tests.acceptance.apps.tasks"


class Runs:
    """The files tasks leave behind (``<key>.<run>.start``, ``<key>.<run>.done``) and the
    ``release/<key>`` files a held task waits for."""

    def __init__(self, path: Path) -> None:
        self.path = path
        (path / "release").mkdir(parents=True)

    def _count(self, suffix: str) -> Counter[str]:
        return Counter(name.split(".", 1)[0] for name in os.listdir(self.path)
                       if name.endswith(suffix))

    def starts(self) -> Counter[str]:
        return self._count(".start")

    def done(self) -> Counter[str]:
        return self._count(".done")

    def records(self, key: str = "*") -> list[dict[str, Any]]:
        """The start records of ``key`` (of every key by default), oldest first."""
        found = [json.loads(p.read_text()) for p in self.path.glob(f"{key}.*.start")]
        return sorted(found, key=lambda record: record["at"])

    def started_on(self, worker: str) -> int:
        """How many runs started on the worker named ``worker``."""
        return sum(1 for record in self.records()
                   if str(record.get("worker", "")).startswith(worker + "@"))

    def release(self, key: str) -> None:
        (self.path / "release" / key).touch()


def check_exactly_once(counts: Counter[str], expected: Iterable[str]) -> None:
    expected = set(expected)
    missing = sorted(expected - set(counts))
    twice = {key: n for key, n in counts.items() if n > 1}
    strange = sorted(set(counts) - expected)
    assert not missing and not twice and not strange, (
        f"{len(missing)} never ran (first {missing[:10]}), {len(twice)} ran more than once "
        f"({dict(list(twice.items())[:10])}), {len(strange)} unexpected")


class Acceptance:
    """One test's database, table prefix, transport options, processes and task records."""

    def __init__(self, broker_url: str, table_prefix: str, engine: Engine,
                 processes: Processes) -> None:
        self.broker_url = broker_url
        self.table_prefix = table_prefix
        self.engine = engine
        self.processes = processes
        self.tmp = processes.tmp
        self.options: dict[str, Any] = {"table_prefix": table_prefix, "polling_interval": 0.1}
        self.runs = Runs(self.tmp / "runs")
        self._app: Celery | None = None

    def configure(self, **options: Any) -> None:
        """Add transport options; only before the first process or app uses them."""
        assert not self.processes.procs and self._app is None, (
            "configure before starting anything")
        self.options.update(options)

    # -- processes -------------------------------------------------------------
    def spawn(self, name: str, argv: Sequence[str], **env: str) -> Proc:
        return self.processes.spawn(name, argv, env)

    def worker(self, pool: str = "prefork", concurrency: int = 2, name: str = "w1",
               broker_url: str | None = None, **conf: Any) -> Proc:
        """A real ``celery worker`` on this database, returned once it is ready."""
        return self.workers([name], pool, concurrency, broker_url, **conf)[0]

    def workers(self, names: Sequence[str], pool: str = "prefork", concurrency: int = 2,
                broker_url: str | None = None, **conf: Any) -> list[Proc]:
        """Several workers started together (``conf``: Celery settings), once all are ready;
        ``broker_url`` reaches the same database another way (through a proxy)."""
        env = {tasks.BROKER_ENV: broker_url or self.broker_url,
               tasks.OPTIONS_ENV: json.dumps(self.options), tasks.CONF_ENV: json.dumps(conf),
               tasks.RUNS_ENV: str(self.runs.path)}
        if len(names) > 1:
            # the queue's table exists before they start: first use of a new table from
            # several processes at once is racy on PostgreSQL
            self.declare("celery")
        return self.processes.workers(APP, names, env, pool, concurrency)

    def close(self) -> None:
        """Kill the processes (before the fixtures under them drop their tables), close
        the app."""
        self.processes.kill()
        if self._app is not None:
            self._app.close()

    # -- publishing and looking -------------------------------------------------
    @property
    def app(self) -> Celery:
        """The test side of the Celery app, to send tasks with."""
        if self._app is None:
            self._app = tasks.make_app(self.broker_url, dict(self.options))
        return self._app

    def send(self, name: str, keys: Iterable[str], **options: Any) -> None:
        """Send one task per key through Celery's own producer path."""
        kwargs = options.pop("kwargs", {})
        with self.app.producer_or_acquire() as producer:
            for key in keys:
                self.app.send_task(name, args=(key,), kwargs=kwargs, producer=producer,
                                   **options)

    def declare(self, queue: str) -> None:
        with self.app.connection_for_write() as conn:
            conn.default_channel.queue_declare(queue)

    def table(self, queue: str) -> str:
        name = table_name_for_queue(queue, self.table_prefix)
        return str(self.engine.dialect.identifier_preparer.quote(name))

    def rows(self, queue: str = "celery") -> int:
        """Every row of the queue's table: waiting, leased or running."""
        with self.engine.connect() as conn:
            return int(conn.execute(text(f"SELECT COUNT(*) FROM {self.table(queue)}")).scalar_one())

    def suspend(self, proc: Proc) -> None:
        """SIGSTOP ``proc``'s main process between two of its transactions. Stopped inside
        one it would keep its locks (on SQLite the whole database's) until resumed: the
        other processes of the test would wait on it instead of taking its rows over."""
        pid = proc.popen.pid
        for _ in range(SUSPEND_TRIES):
            wait_until(lambda: not self.in_transaction(pid), 10,
                       f"{proc.name} to end its transaction", alive=[proc])
            os.kill(pid, signal.SIGSTOP)
            wait_until(lambda: process_state(pid) == "T", 10, f"{proc.name} to stop")
            if not self.in_transaction(pid):
                return
            os.kill(pid, signal.SIGCONT)
        raise AssertionError(f"{proc.name} was inside a transaction at {SUSPEND_TRIES} stops")

    def in_transaction(self, pid: int) -> bool:
        """Whether a session of the process ``pid`` is inside a transaction (on SQLite:
        whether any process holds the write lock, which is what blocks the others)."""
        if self.engine.dialect.name == "sqlite":
            with closing(sqlite3.connect(str(self.engine.url.database), timeout=0.2,
                                         isolation_level=None)) as conn:
                try:
                    conn.execute("BEGIN IMMEDIATE")
                except sqlite3.OperationalError:
                    return True
                conn.execute("ROLLBACK")
                return False
        ports = sorted(process_ports(pid))
        if not ports:
            return False
        with self.engine.connect() as conn:
            return bool(conn.execute(
                text(OPEN_TRANSACTIONS[self.engine.dialect.name]).bindparams(
                    bindparam("ports", expanding=True)), {"ports": ports}).scalar_one())

    def wait_acked(self, worker: Proc, queue: str = "celery") -> None:
        """Wait until ``worker`` has acknowledged every task of ``queue`` (its table is empty),
        before a warm shutdown of a prefork worker in Celery's event loop. Celery acks a task
        once the pool process's "accepted" reached the main process; a SIGTERM before that
        makes Celery drop the task from its pool's books although the pool process runs it
        (``AsynPool.flush``), then stop reading the pool's results once the books are empty
        (``ResultHandler.on_stop_not_started``), and billiard's pool process waits 30 s for
        its result to be read before it exits (``Worker._ensure_messages_consumed``): the
        worker's exit then takes more than the tests allow, by Celery's doing alone."""
        wait_until(lambda: self.rows(queue) == 0, 30, f"{worker.name} to ack every task",
                   alive=[worker])


#: how many times :meth:`Acceptance.suspend` stops a process before giving up
SUSPEND_TRIES = 50
#: per server: how many of the sessions at the client ports ``:ports`` are in a transaction
OPEN_TRANSACTIONS = {
    "postgresql": "SELECT count(*) FROM pg_stat_activity "
                  "WHERE client_port IN :ports AND xact_start IS NOT NULL",
    "mysql": "SELECT count(*) FROM information_schema.innodb_trx t "
             "JOIN information_schema.processlist p ON p.id = t.trx_mysql_thread_id "
             "WHERE SUBSTRING_INDEX(p.host, ':', -1) IN :ports",
}


def process_state(pid: int) -> str:
    """The state letter of ``/proc/<pid>/stat`` (``T``: stopped)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


#: how long the caller waits for a result: a worker takes a second or two to start
RESULT_LIMIT = 60.0
#: the size limit the workers' backend is given, to drive the refusal without 1 GB
MAX_RESULT_BYTES = 10_000


def results_conf(db_url: str, **more: Any) -> dict[str, Any]:
    return {"result_backend": "sqlinbox+" + db_url, "task_ignore_result": False,
            "result_extended": True,
            "result_backend_transport_options": {"max_result_bytes": MAX_RESULT_BYTES},
            **more}


@pytest.fixture
def caller(acceptance: Acceptance, db_url: str) -> Iterator[Celery]:
    app = tasks.make_app(acceptance.broker_url, dict(acceptance.options),
                         **results_conf(db_url, result_expires=60))
    yield app
    app.close()


@pytest.fixture
def acceptance(broker_url: str, table_prefix: str, engine: Engine, processes: Processes
               ) -> Iterator[Acceptance]:
    made = Acceptance(broker_url, table_prefix, engine, processes)
    try:
        yield made
    finally:
        made.close()
