"""Remote-control fixtures: the example app's workers on one broker, shared by a module.

Each broker (PostgreSQL, MariaDB, a SQLite file, and Redis as the control that shows what
Celery does on a broker it supports natively) gets two real ``celery worker`` processes,
``a@<host>`` and ``b@<host>``, started once per module from ``examples/monitoring``, with
events (``-E``) and heartbeats on. The test process sends tasks through the same app,
runs the ``celery`` command line as a user does, and records every event the workers send.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

import pytest
from celery import Celery
from kombu import Connection
from sqlalchemy import create_engine

from tests.databases import database_url, drop_tables
from tests.docs.support import EXAMPLES, load_example
from tests.processes import START_LIMIT, Proc, Processes, wait_until

REDIS_URL = os.environ.get("SQLINBOX_TEST_REDIS_REMOTE", "redis://127.0.0.1:6379/9")
#: the brokers each test runs on: Redis first, as the control
BROKERS = ("redis", "postgresql", "mysql", "sqlite")
EXAMPLE = EXAMPLES / "monitoring"
HOST = socket.gethostname()
#: a ``celery`` command that does not end in this time fails its test
COMMAND_LIMIT = 60.0
#: a remote-control command's reply window (Celery's default is 1 s; a worker on a loaded
#: two-core machine can answer later): a command to named workers returns as soon as each
#: replied, so it waits this long only for a reply that never comes
REPLY_LIMIT = 5.0
T = TypeVar("T")


def example_app() -> ModuleType:
    return load_example("monitoring/monitor_app.py")


class Events:
    """Every event the workers (and the test's sender) publish, as a receiver in this
    process sees it, recorded from before the workers start until the module ends."""

    def __init__(self, app: Celery) -> None:
        self.app = app
        self.seen: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.ready = threading.Event()
        self.receiver: Any = None
        self.thread = threading.Thread(target=self._run, name="events", daemon=True)
        self.thread.start()
        assert self.ready.wait(START_LIMIT), "the event receiver did not start consuming"

    def _run(self) -> None:
        with self.app.connection_for_read() as conn:
            self.receiver = self.app.events.Receiver(conn, handlers={"*": self._record})
            self.receiver.on_consume_ready = lambda *args, **kwargs: self.ready.set()
            self.receiver.capture(limit=None, timeout=None, wakeup=False)

    def _record(self, event: dict[str, Any]) -> None:
        with self.lock:
            self.seen.append(event)

    def of(self, **match: Any) -> list[dict[str, Any]]:
        """The events so far whose fields include ``match``."""
        with self.lock:
            return [event for event in self.seen
                    if all(event.get(key) == value for key, value in match.items())]

    def types_of(self, task_id: str) -> set[str]:
        return {event["type"] for event in self.of(uuid=task_id)}

    def stop(self) -> None:
        if self.receiver is not None:
            self.receiver.should_stop = True
        self.thread.join(10)


class Cluster:
    """Two workers of the example app on one broker, the app's test side, the ``celery``
    command line, the event record, and the directory the tasks leave markers in."""

    def __init__(self, broker: str, broker_url: str, table_prefix: str, tmp: Path) -> None:
        self.broker = broker
        self.broker_url = broker_url
        self.table_prefix = table_prefix
        self.tmp = tmp
        self.marks = tmp / "marks"
        self.marks.mkdir()
        self.env = {"MONITOR_BROKER": broker_url, "MONITOR_TABLE_PREFIX": table_prefix,
                    "MONITOR_DIR": str(self.marks), "PYTHONPATH": str(EXAMPLE)}
        self.processes = Processes(tmp)
        self.app: Celery = example_app().make_app(broker_url, table_prefix)
        self.events: Events | None = None
        self.names = [f"a@{HOST}", f"b@{HOST}"]
        #: how ``inspect stats`` names the workers' transport
        self.transport = str(Connection(broker_url).transport_cls)

    # -- processes ---------------------------------------------------------------------
    def start(self) -> None:
        self.events = Events(self.app)
        self.workers = self.start_workers(["a", "b"])

    def start_workers(self, names: Sequence[str], *args: str) -> list[Proc]:
        """``celery -A monitor_app worker -E`` for each name, returned once all are ready.
        Gossip and mingle are off on every broker, so all run the same way (Celery
        turns them off by itself on a sqlinbox broker)."""
        argv = [sys.executable, "-m", "celery", "-A", "monitor_app", "worker", "-E",
                "-P", "prefork", "-c", "2", "--without-gossip", "--without-mingle",
                "-l", "info", *args]
        started = [self.processes.spawn(name, [*argv, "-n", f"{name}@%h"], self.env)
                   for name in names]
        for proc in started:
            wait_until(lambda proc=proc: f"{proc.name}@{HOST} ready." in proc.output(),
                       START_LIMIT, f"worker {proc.name} to be ready", alive=started)
        return started

    def spawn(self, name: str, *args: str, **env: str) -> Proc:
        """``celery -A monitor_app <args>`` running alongside the test (``env``: more
        variables)."""
        return self.processes.spawn(
            name, [sys.executable, "-m", "celery", "-A", "monitor_app", *args],
            {**self.env, **env})

    def celery(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run ``celery -A monitor_app <args>`` in the example's directory, as a user does,
        and return its result (exit 0 required unless ``check`` is false)."""
        done = subprocess.run(
            [sys.executable, "-m", "celery", "-A", "monitor_app", *args],
            cwd=EXAMPLE, env={**os.environ, **self.env}, capture_output=True, text=True,
            timeout=COMMAND_LIMIT)
        if check:
            assert done.returncode == 0, (
                f"celery {' '.join(args)} exited {done.returncode}\n{done.stdout}{done.stderr}")
        return done

    def inspect(self, *args: str) -> dict[str, Any]:
        """``celery inspect <args> --json`` to both workers: the replies by node name."""
        done = self.celery("inspect", *args, "--json", "-t", str(REPLY_LIMIT),
                           "-d", ",".join(self.names))
        replies: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
        assert sorted(replies) == sorted(self.names), done.stdout
        return replies

    def ask(self, command: str, *args: Any) -> dict[str, Any]:
        """The same question through the Python API (no process to start): for the checks
        that follow a command rather than test it."""
        inspect = self.app.control.inspect(destination=self.names, timeout=COMMAND_LIMIT)
        replies: dict[str, Any] = getattr(inspect, command)(*args) or {}
        return replies

    def control(self, *args: str, destination: Sequence[str] = ()) -> str:
        """``celery control <args>`` to ``destination``, by default both workers by name:
        the command then returns once both replied, not after its whole reply timeout
        (:data:`REPLY_LIMIT`; a broadcast to no one in particular cannot know how many
        replies to await); its output."""
        target = ",".join(destination or self.names)
        return self.celery("control", *args, "-t", str(REPLY_LIMIT), "-d", target).stdout

    # -- tasks ---------------------------------------------------------------------------
    def send(self, name: str, *args: Any, **options: Any) -> str:
        """Send the task ``monitor.<name>``; its id."""
        return str(self.app.send_task(f"monitor.{name}", args=args, **options).id)

    def queue_size(self, queue: str) -> int:
        """The messages in ``queue``, as the broker counts them."""
        with self.app.connection_for_write() as conn:
            return int(conn.default_channel.queue_declare(queue, passive=True).message_count)

    def marker(self, key: str, suffix: str) -> dict[str, Any] | None:
        """The record a task left in ``<key>.<suffix>``, or None."""
        path = self.marks / f"{key}.{suffix}"
        return json.loads(path.read_text()) if path.exists() else None

    def wait_marker(self, key: str, suffix: str, what: str, timeout: float = 30.0
                    ) -> dict[str, Any]:
        found: dict[str, Any] = self.wait(lambda: self.marker(key, suffix), what, timeout)
        return found

    def wait(self, predicate: Any, what: str, timeout: float = 30.0) -> Any:
        """A bounded wait that fails as soon as a worker has exited."""
        return wait_until(predicate, timeout, what, alive=self.workers)

    def release(self, key: str) -> None:
        (self.marks / f"{key}.release").touch()

    def close(self, failed: bool) -> None:
        if self.events is not None:
            self.events.stop()
        self.processes.close(failed)
        self.app.close()


def at_once(calls: Sequence[Callable[[], T]]) -> list[T]:
    """The results of ``calls``, run each in a thread of its own: independent ``celery``
    commands overlap their start-up (a second or more of imports each) and their wait
    for replies. Each call bounds its own wait."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return [future.result() for future in [pool.submit(call) for call in calls]]


@pytest.fixture(autouse=True)
def _close_brokers() -> Iterator[None]:
    """Replaces the suite's per-test closing of this process's broker connections: the
    module's event receiver and sender keep theirs from test to test, and
    :func:`cluster` closes them when the module ends."""
    yield


def broker_url_for(broker: str, tmp: Path) -> str:
    return REDIS_URL if broker == "redis" else "sqlinbox+" + database_url(broker, tmp)


@contextlib.contextmanager
def cluster_on(broker: str, tmp: Path, failed: Callable[[], bool]) -> Iterator[Cluster]:
    """A :class:`Cluster` on ``broker`` (nothing started yet) with a table prefix of its
    own; afterwards its processes are killed (their output printed when the block raised
    or ``failed()``),
    its connections closed and its tables dropped."""
    made = Cluster(broker, broker_url_for(broker, tmp), f"r{uuid.uuid4().hex[:8]}_", tmp)
    if broker == "redis":
        # this database number is the suite's own: no task or reply of an earlier run
        # that was cut short reaches these workers
        with Connection(made.broker_url) as conn:
            conn.default_channel.client.flushdb()
    raised = False
    try:
        yield made
    except BaseException:
        raised = True
        raise
    finally:
        made.close(raised or failed())
        if broker != "redis":
            from kombu_sqlinbox.broker import sqlalchemy_url
            from kombu_sqlinbox.brokers import close_all

            close_all()
            engine = create_engine(sqlalchemy_url(made.broker_url.removeprefix("sqlinbox+")))
            drop_tables(engine, made.table_prefix)
            engine.dispose()


@pytest.fixture(scope="module", params=BROKERS)
def cluster(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[Cluster]:
    """Two workers on one broker for every test of a module; their output is printed
    when a test of the module failed."""
    broker = str(request.param)
    failed_before = request.session.testsfailed
    with cluster_on(broker, tmp_path_factory.mktemp(f"remote-{broker}"),
                    lambda: request.session.testsfailed > failed_before) as made:
        made.start()
        yield made
