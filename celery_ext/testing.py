"""pytest fixtures: a service's own Celery app on a real inbox, with a clock it controls.

Load with ``-p celery_ext.testing`` or ``pytest_plugins = ["celery_ext.testing"]`` (the
options come from :mod:`celery_ext.pytest_plugin`, installed with the distribution).
Name the app in the pytest ini (``sqlinbox_app = proj.celery:app``) or override the
``sqlinbox_service_app`` fixture.

Each test gets its own tables (a fresh SQLite file by default; on ``--sqlinbox-url``'s
server, tables under a table prefix of its own, dropped after it). Time is the
database's until the test moves the clock (``sqlinbox_clock.advance(3600)``): every
statement of this process then reads the pinned time, so countdowns, ``retry_after``,
expired leases and outbox grace periods come due at once. A worker in another process
keeps the database's own time.
"""

from __future__ import annotations

import dataclasses
import os
import re
import select
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from importlib import import_module
from pathlib import Path
from typing import Any, TypeVar

import pytest
from celery import Celery
from celery.app.trace import build_tracer
from celery.contrib.testing.worker import start_worker
from celery.signals import worker_ready
from celery.states import REJECTED
from sqlalchemy import create_engine, inspect

from kombu_sqlinbox import clock as clocks
from kombu_sqlinbox.brokers import broker_for, close_all
from kombu_sqlinbox.codec import DEATH_HEADER
from kombu_sqlinbox.options import parse_options
from kombu_sqlinbox.tables import TableSpec
from kombu_sqlinbox.urls import sqlalchemy_url

from .declaration import OutboxSpec
from .outbox import Outbox, OutboxError, outbox_of

T = TypeVar("T", TableSpec, OutboxSpec)
PREFIX = "sqlinbox+"
#: where the worker process finds the inbox URL: any local user reads a command line
#: (``ps``), the environment only its owner
WORKER_URL = "SQLINBOX_WORKER_URL"
#: tasks one drain() runs at most: a task that keeps requeueing itself would never end
DRAIN_LIMIT = 1000


@dataclass(frozen=True)
class Ran:
    """One task drain() ran: its name, arguments and outcome (a Celery state: SUCCESS,
    FAILURE, RETRY, REJECTED, IGNORED) with its return value or exception."""

    task: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    state: str
    result: Any


@dataclass(frozen=True)
class DeadLetter:
    """A message parked in a dead-letter queue, with why (the death record's reason)."""

    task: str | None
    args: tuple[Any, ...]
    reason: str
    death: dict[str, Any] = field(repr=False)


def own_table(spec: T, prefix: str) -> T:
    """``spec`` (a queue's or an outbox's declaration) with its table renamed under a
    test's ``prefix``: a test never writes to, nor drops, the service's own table. A
    declared publish statement's mentions of the table are renamed too."""
    table = prefix + spec.table
    changes: dict[str, Any] = {"table": table}
    publish = getattr(spec, "publish", None)
    if publish is not None:
        changes["publish"] = re.sub(rf"(?<!\w)([\"`]?){re.escape(spec.table)}\1(?!\w)",
                                    lambda found: f"{found[1]}{table}{found[1]}", publish)
    return dataclasses.replace(spec, **changes)


def bind_app(app: Celery, url: str, prefix: str) -> Callable[[], None]:
    """Point ``app`` at the inbox ``url``, its tables under ``prefix`` (the queues' own,
    their declared tables, the outbox's table if it has one, at the same database), made
    on first use whatever the service's settings say (they are the test's tables);
    returns what points it back at what it was bound to before."""
    saved = (app.conf.broker_url, app.conf.broker_transport_options)
    options = dict(app.conf.broker_transport_options or {})
    queues = dict(options.get("queues") or {})
    for name, settings in parse_options(options).queues.items():
        if settings.table is not None:
            queues[name] = {**queues[name], "table": own_table(settings.table, prefix)}
    outbox = outbox_or_none(app)
    table = None if outbox is None else own_table(outbox.spec, prefix)
    app.conf.broker_url = url
    app.conf.broker_transport_options = {**options, "table_prefix": prefix,
                                         "create_tables": True,
                                         **({"queues": queues} if queues else {})}
    if outbox is None or table is None:
        before = None
    else:
        before = (outbox.use_table(table), outbox.store.create_table)
        outbox.store.create_table = True
        outbox.bind_engine(url[len(PREFIX):])

    def restore() -> None:
        app.conf.broker_url, app.conf.broker_transport_options = saved
        if outbox is not None and before is not None:
            outbox.use_table(before[0])
            outbox.store.create_table = before[1]

    return restore


def outbox_or_none(app: Celery) -> Outbox | None:
    try:
        return outbox_of(app)
    except OutboxError:  # the service sends without an outbox
        return None


class Inbox:
    """The service's app bound to a test inbox: its queues' tables created, its outbox (if
    it has one) on the same database, every table under a prefix of the test's own."""

    def __init__(self, app: Celery, url: str, clock: clocks.Clock) -> None:
        self.app, self.url, self.clock = app, url, clock
        self.prefix = f"t{uuid.uuid4().hex[:10]}_"
        self._engine = create_engine(sqlalchemy_url(url[len(PREFIX):]))
        #: tables under the prefix that were there before (none, but never dropped)
        self._found = self._own_tables()
        self._restore = bind_app(app, url, self.prefix)
        self.outbox = outbox_or_none(app)
        self.options = parse_options(app.conf.broker_transport_options)
        try:
            self._fresh_connections()
            if self.outbox is not None:
                self.outbox.create()
            with app.connection_for_write() as conn:
                channel = conn.default_channel
                for queue in self.queues:
                    queue(channel).declare()
        except BaseException:  # the app as it was for the next test, nothing left here
            self.close()
            raise

    @property
    def queues(self) -> list[Any]:
        return list(self.app.amqp.queues.values())

    def _fresh_connections(self) -> None:
        """Drop the app's pooled broker connections: they were made for another inbox."""
        app = self.app
        if app._pool is not None:
            app._pool.force_close_all()
        app._pool = None
        app.amqp._producer_pool = None

    def _own_tables(self) -> set[tuple[str | None, str]]:
        """The tables under the test's prefix: in the default schema, and in those of
        declared tables."""
        options = parse_options(self.app.conf.broker_transport_options)
        schemas = {None, *(settings.table.schema for settings in options.queues.values()
                           if settings.table is not None)}
        outbox = outbox_or_none(self.app)
        if outbox is not None:
            schemas.add(outbox.spec.schema)
        with self._engine.connect() as conn:
            inspector = inspect(conn)
            return {(schema, name) for schema in schemas
                    for name in inspector.get_table_names(schema=schema)
                    if name.startswith(self.prefix)}

    def close(self) -> None:
        """Drop the tables the test made (the database may outlive the test: only those
        under its prefix that were not there before) and let go of the inbox. The app
        is pointed back at what it was bound to also where that fails (the database is
        gone): the next test must not find it bound to this one's."""
        try:
            try:
                if self.outbox is not None:
                    self.outbox.close()
            finally:
                self._fresh_connections()
                close_all()  # no connection of ours may hold a lock the drops wait for
            made = self._own_tables() - self._found
            quote = self._engine.dialect.identifier_preparer.quote
            with self._engine.begin() as conn:
                for schema, name in sorted(made, key=lambda table: (table[0] or "", table[1])):
                    where = "" if schema is None else f"{quote(schema)}."
                    conn.exec_driver_sql(f"DROP TABLE IF EXISTS {where}{quote(name)}")
        finally:
            self._restore()
            self._engine.dispose()

    # -- running tasks here ----------------------------------------------------------
    def drain(self, limit: int = DRAIN_LIMIT) -> list[Ran]:
        """Run every task that is ready now, in this process, until none is; returns what
        ran, in order. Retries and tasks they send that are ready run too; a countdown
        runs once the clock reaches it. More than ``limit`` runs is an error (a task that
        keeps sending itself)."""
        ran: list[Ran] = []
        with self.app.connection_for_write() as conn:
            channel = conn.default_channel
            progress = True
            while progress:
                progress = False
                for queue in self.queues:
                    message = channel.basic_get(queue.name, no_ack=False)
                    if message is None:
                        continue
                    progress = True
                    ran.append(self._run(message))
                    # settlements are written in batches: this one before the next claim
                    if not conn.transport.broker.keeper.flush():
                        raise RuntimeError("drain(): a settlement was not written in 30 s")
                    if len(ran) >= limit:
                        raise RuntimeError(f"drain() ran {limit} tasks and more are ready: "
                                           "does a task keep sending itself?")
        return ran

    def _run(self, message: Any) -> Ran:
        """Run one message the way a worker does (signals, retries, rejects), then settle
        it: a reject with requeue puts it back, anything else acks it."""
        headers = message.headers
        args, kwargs, embed = message.decode()
        task = self.app.tasks[headers["task"]]
        request = {**headers, **embed, "delivery_info": message.delivery_info,
                   "reply_to": message.properties.get("reply_to"),
                   "correlation_id": message.properties.get("correlation_id"),
                   "hostname": "drain@sqlinbox", "is_eager": False}
        tracer = build_tracer(task.name, task, app=self.app, hostname="drain@sqlinbox",
                              eager=False, propagate=False)
        outcome = tracer(headers["id"], args, kwargs, request)
        state = "SUCCESS" if outcome.info is None else outcome.info.state
        if state == REJECTED:
            message.reject(requeue=outcome.info.retval.requeue)
        else:
            message.ack()
        result = outcome.retval if outcome.info is None else outcome.info.retval
        return Ran(task.name, tuple(args), kwargs, state, result)

    def crash(self, queue: str = "celery", limit: int = 1) -> int:
        """Claim up to ``limit`` ready rows of ``queue`` the way a worker does, then hold
        them as a worker that died holding them: no one extends or settles their lease.
        Returns how many were taken."""
        broker = broker_for(self.url[len(PREFIX):], self.options)
        table = broker.table(queue)
        lease = table.options.visibility_timeout
        rows = broker.run(lambda conn: broker.dialect.claim(conn, table.spec, limit, lease))
        return len(rows)

    def wait_for(self, condition: Callable[[], Any], timeout: float = 30.0) -> Any:
        """``condition()`` once it is true (what a worker process did shows only in the
        database: it is asked again every 50 ms), or TimeoutError after ``timeout``."""
        deadline = time.monotonic() + timeout
        while not (value := condition()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{condition!r} still false after {timeout} s")
            time.sleep(0.05)
        return value

    # -- what is left -------------------------------------------------------------------
    def dead_letters(self, queue: str = "celery") -> list[DeadLetter]:
        """The messages parked in ``queue``'s dead-letter queue, left there."""
        parked = self.options.for_queue(queue).dead_letter_queue
        if parked is None:
            raise ValueError(f"queue {queue!r} has no dead_letter_queue option")
        found: list[DeadLetter] = []
        with self.app.connection_for_write() as conn:
            channel = conn.default_channel
            taken = []
            while (message := channel.basic_get(parked, no_ack=False)) is not None:
                taken.append(message)
                args = message.decode()[0]
                death = message.headers[DEATH_HEADER]
                found.append(DeadLetter(message.headers.get("task"), tuple(args),
                                        death["reason"], death))
            for message in taken:
                message.reject(requeue=True)
        return found


def _import(path: str) -> Any:
    module, _, name = path.partition(":")
    return getattr(import_module(module), name)


@pytest.fixture
def sqlinbox_service_app(request: pytest.FixtureRequest) -> Celery:
    """The service's Celery app: the pytest ini's ``sqlinbox_app`` (module:attribute).
    Override this fixture to build it otherwise."""
    path = request.config.getini("sqlinbox_app")
    if not path:
        raise pytest.UsageError("set sqlinbox_app = module:attribute in the pytest ini, or "
                                "override the sqlinbox_service_app fixture")
    app: Celery = _import(path)
    return app


@pytest.fixture
def sqlinbox_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The test's inbox, as a broker URL: ``--sqlinbox-url``, ``$SQLINBOX_URL``, or a new
    SQLite file."""
    url = request.config.getoption("sqlinbox_url") or os.environ.get("SQLINBOX_URL")
    if not url:
        return f"{PREFIX}sqlite:///{tmp_path / 'inbox.db'}"
    return url if url.startswith(PREFIX) else PREFIX + url


@pytest.fixture
def sqlinbox_clock(sqlinbox_url: str) -> Iterator[clocks.Clock]:
    """The inbox's clock: the database's time until the test pins or advances it."""
    url = sqlalchemy_url(sqlinbox_url[len(PREFIX):])
    yield clocks.install(url)
    clocks.uninstall(url)


@pytest.fixture
def sqlinbox(sqlinbox_service_app: Celery, sqlinbox_url: str,
             sqlinbox_clock: clocks.Clock) -> Iterator[Inbox]:
    """The service's app bound to the test's inbox (see :class:`Inbox`)."""
    inbox = Inbox(sqlinbox_service_app, sqlinbox_url, sqlinbox_clock)
    yield inbox
    inbox.close()


@pytest.fixture
def sqlinbox_app(sqlinbox: Inbox) -> Celery:
    """The service's app, bound to the test's inbox."""
    return sqlinbox.app


@pytest.fixture
def sqlinbox_drain(sqlinbox: Inbox) -> Callable[[], list[Ran]]:
    """``drain()``: run every ready task now, in this process; returns what ran."""
    return sqlinbox.drain


@pytest.fixture
def sqlinbox_dead_letters(sqlinbox: Inbox) -> Callable[..., list[DeadLetter]]:
    """``dead_letters(queue="celery")``: the messages parked in the queue's dead-letter
    queue."""
    return sqlinbox.dead_letters


@pytest.fixture
def sqlinbox_outbox(sqlinbox: Inbox) -> Outbox:
    """The app's outbox, on the test's database."""
    if sqlinbox.outbox is None:
        raise pytest.UsageError("the service's app has no outbox (celery_ext.install)")
    return sqlinbox.outbox


@pytest.fixture
def sqlinbox_worker(sqlinbox: Inbox) -> Iterator[Any]:
    """Celery's in-process test worker on the inbox (solo pool), stopped after the test."""
    with start_worker(sqlinbox.app, pool="solo", perform_ping_check=False,
                      shutdown_timeout=30.0) as worker:
        yield worker


@pytest.fixture
def sqlinbox_worker_process(request: pytest.FixtureRequest, sqlinbox: Inbox,
                            tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A real ``celery worker`` process (solo pool) on the test's inbox, started before the
    test and stopped (SIGTERM: a warm shutdown) after it. It reads the database's time,
    not the test's clock; its log is ``worker.log`` in the test's ``tmp_path``."""
    path = request.config.getini("sqlinbox_app")
    if not path:
        raise pytest.UsageError("a worker process imports the app by name: set sqlinbox_app")
    patience = float(request.config.getini("sqlinbox_worker_start"))
    ready, signal_end = os.pipe()
    log = tmp_path / "worker.log"
    with log.open("wb") as output:
        process = subprocess.Popen(
            [sys.executable, "-m", "celery_ext.testing", path, sqlinbox.prefix, str(signal_end)],
            env={**os.environ, WORKER_URL: sqlinbox.url}, stdout=output,
            stderr=subprocess.STDOUT, pass_fds=(signal_end,))
    os.close(signal_end)
    try:
        readable, _, _ = select.select([ready], [], [], patience)
        if not readable:
            raise RuntimeError(f"the worker process was not ready within {patience:g} s; "
                               f"its log:\n{log.read_text()}")
        if not os.read(ready, 1):  # its end of the pipe closed: it exited
            raise RuntimeError(f"the worker process exited with code {process.wait(30)} "
                               f"before it was ready; its log:\n{log.read_text()}")
        yield process
    finally:
        os.close(ready)
        process.terminate()
        try:
            process.wait(timeout=30)
        finally:
            if process.poll() is None:  # it did not stop: end it
                process.kill()
                process.wait()


def main(argv: list[str]) -> None:
    """A worker process for :func:`sqlinbox_worker_process`: ``python -m celery_ext.testing
    APP PREFIX FD``, the URL in ``$SQLINBOX_WORKER_URL``, binds the app as the fixtures do
    and writes one byte to FD once the worker is ready."""
    path, prefix, fd = argv
    app: Celery = _import(path)
    bind_app(app, os.environ[WORKER_URL], prefix)  # for the life of the process

    def announce(**kwargs: Any) -> None:
        os.write(int(fd), b"r")
        os.close(int(fd))

    worker_ready.connect(announce, weak=False)
    app.worker_main(["worker", "--pool=solo", "--loglevel=INFO", "--without-gossip",
                     "--without-mingle", "--without-heartbeat"])


if __name__ == "__main__":
    main(sys.argv[1:])
