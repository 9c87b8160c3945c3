"""The Celery app of the chaos soak (``bench/soak.py``): its queues, tasks and ledger.

``celery -A bench.soak_app worker`` reads its configuration from ``SOAK_CONFIG`` (JSON:
``db_url``, ``prefix``, ``keyed_claim``); the soak builds the same app with
:func:`make_app` to publish. One queue per kind of task, named after it:

* ``plain`` -- an :class:`~celery_ext.tasks.InboxTask` (late ack): at least once;
* ``fifo`` -- the same, on a table with a FIFO group (``group_key`` header);
* ``keyed`` -- the same, on a table with a partition key (``partition_key`` header);
* ``tx`` -- a transactional task: its effect commits with the row's completion, once;
* ``txout`` -- a transactional task the outbox also tracks;
* ``outbox`` -- a task the outbox tracks, its effect written in ``Outbox.transaction()``.

Every task's effect is a ``done`` row in the ledger table; ``task_prerun`` adds a
``start`` row per run. A task's second argument is its fate, the failure the soak injects:
``ok``; ``flaky`` (raises once, Celery's retry policy runs it again); ``retry`` (retries
in place once, ``retry_after``); ``doomed`` (fails every time: dead-lettered); ``nonnull``
(violates a NOT NULL constraint every time: a failure, dead-lettered); ``twice``
(published twice, guarded by a unique key: one effect).
"""

from __future__ import annotations

import json
import logging
import os
import random
import time
from collections.abc import Callable
from functools import cache
from typing import Any

from celery import Celery, Task
from celery.exceptions import Reject
from celery.signals import task_prerun
from sqlalchemy import Column, Double, Integer, MetaData, String, Table
from sqlalchemy.engine import Engine
from sqlalchemy.exc import InterfaceError, OperationalError

import celery_ext
import kombu_sqlinbox  # noqa: F401  (registers the sqlinbox+ alias)
from bench.ordering import inbox_table
from celery_ext.outbox import engine_from_url, outbox_of
from celery_ext.tasks import InboxTask, delivered_row
from kombu_sqlinbox.tables import table_name_for_queue

CONFIG_ENV = "SOAK_CONFIG"
#: every kind of task, and the queue it goes to
KINDS = ("plain", "fifo", "keyed", "tx", "txout", "outbox")
#: kinds whose effect must land exactly once; the others at least once
EXACTLY_ONCE = frozenset({"tx", "txout", "outbox"})
#: fates that fail every time: their messages end in the dead-letter queue
PERMANENT = frozenset({"doomed", "nonnull"})
DEAD = "dead"
#: the lease: a killed worker's rows come back this soon
LEASE = 10.0
#: deliveries before a row is dead-lettered (kills count); far above what the chaos causes
MAX_ATTEMPTS = 25
#: how long a task keeps retrying a ledger write while the database is away
WRITE_LIMIT = 90.0
#: seconds a ``retry`` fate waits in place; a ``flaky`` one before Celery's retry
RETRY_DELAY = 0.3
#: a task's own work before its effect, and again after it, seconds: long enough that
#: kills land inside tasks, after an effect as well as before it
WORK = (0.0, 0.02)


# a log line per task received and per task finished would make the worker logs the
# soak's busiest writer; failures and retries still show
for _name in ("celery.app.trace", "celery.worker.strategy"):
    logging.getLogger(_name).setLevel(logging.WARNING)


class Flaky(RuntimeError):
    """The injected transient failure; the task's retry policy runs it again."""


class Doomed(RuntimeError):
    """The injected permanent failure."""


@cache
def tables(prefix: str) -> tuple[Table, Table]:
    """The ledger (a row per run start and per effect) and the unique keys of ``twice``."""
    metadata = MetaData()
    ledger = Table(
        f"{prefix}ledger", metadata,
        Column("n", Integer, primary_key=True, autoincrement=True),
        Column("kind", String(16), nullable=False),
        Column("key", String(64), nullable=False),
        Column("event", String(8), nullable=False),
        Column("pid", Integer, nullable=False),
        Column("attempt", Integer, nullable=False),
        Column("at", Double, nullable=False),
    )
    once = Table(f"{prefix}once", metadata, Column("key", String(64), primary_key=True))
    return ledger, once


def queue_table(prefix: str, queue: str) -> str:
    """The table of a soak queue: ``fifo`` and ``keyed`` are declared, the others default."""
    if queue in ("fifo", "keyed"):
        return f"{prefix}{queue}"
    return table_name_for_queue(queue, prefix)


def transport_options(prefix: str, keyed_claim: str) -> dict[str, Any]:
    queues: dict[str, dict[str, Any]] = {kind: {} for kind in KINDS}
    queues["fifo"]["table"] = inbox_table(queue_table(prefix, "fifo"), "fifo")
    queues["keyed"] = {"table": inbox_table(queue_table(prefix, "keyed"), "keyed"),
                       "claim": keyed_claim}
    queues[DEAD] = {"dead_letter_queue": None, "max_attempts": None}
    return {"table_prefix": prefix, "polling_interval": 0.2, "visibility_timeout": LEASE,
            "max_attempts": MAX_ATTEMPTS, "dead_letter_queue": DEAD, "queues": queues}


def make_app(config: dict[str, Any]) -> Celery:
    """The soak's app on ``config['db_url']``: queues, tasks and the outbox installed."""
    made = Celery("soak", broker=f"sqlinbox+{config['db_url']}", set_as_current=False)
    made.conf.update(
        broker_transport_options=transport_options(config["prefix"], config["keyed_claim"]),
        broker_connection_retry_on_startup=True,
        broker_connection_max_retries=None,
        task_ignore_result=True,
        # a failed task is rejected: it lands in the dead-letter queue, where the soak counts
        task_acks_on_failure_or_timeout=False,
        worker_redirect_stdouts=False,
        soak=config,
    )
    retry = {"base": InboxTask, "bind": True, "shared": False, "autoretry_for": (Flaky,),
             "max_retries": 5, "default_retry_delay": RETRY_DELAY}
    for kind in ("plain", "fifo", "keyed"):
        made.task(name=f"soak.{kind}", **retry)(work)
    made.task(name="soak.tx", transactional=True, **retry)(transactional)
    made.task(name="soak.txout", transactional=True, **retry)(transactional)
    made.task(name="soak.outbox", **retry)(tracked)
    celery_ext.install(made, config["db_url"], table=f"{config['prefix']}outbox_records",
                       tasks={"soak.txout", "soak.outbox"}, grace=60.0)
    return made


# -- the tasks ----------------------------------------------------------------------------
def kind_of(task: Task) -> str:
    return str(task.name).removeprefix("soak.")


def attempt(task: Task) -> int:
    """The delivery's attempt (1 the first time its row was claimed)."""
    return int((delivered_row(task.request) or {}).get("attempt", 1))


def effect(task: Task, key: str | None) -> dict[str, Any]:
    return {"kind": kind_of(task), "key": key, "event": "done", "pid": os.getpid(),
            "attempt": attempt(task), "at": time.time()}


def inject(task: Task, key: str, fate: str) -> None:
    """The failures that come before the work: a retry in place, a doomed task."""
    time.sleep(random.uniform(*WORK))
    if fate == "retry" and attempt(task) == 1:
        raise task.retry_after(RETRY_DELAY)
    if fate == "doomed":
        if kind_of(task) == "fifo":
            raise Reject(f"{key}: doomed", requeue=False)
        raise Doomed(key)


def work(self: InboxTask, key: str, fate: str) -> None:
    """plain, fifo, keyed: the effect commits on a connection of the task's own, then the
    row is acked (a kill in between runs it again)."""
    inject(self, key, fate)
    if fate == "flaky" and self.request.retries == 0:
        raise Flaky(key)
    write(self.app, effect(self, key))
    time.sleep(random.uniform(*WORK))


def transactional(self: InboxTask, key: str, fate: str) -> None:
    """tx, txout: the effect in the delivery's transaction; ``flaky`` raises after writing
    it (rolled back), ``nonnull`` writes a NULL key."""
    inject(self, key, fate)
    ledger, once = tables(self.app.conf.soak["prefix"])
    if fate == "twice":
        self.connection.execute(once.insert(), {"key": key})
    self.connection.execute(ledger.insert(), effect(self, None if fate == "nonnull" else key))
    time.sleep(random.uniform(*WORK))
    if fate == "flaky" and self.request.retries == 0:
        raise Flaky(key)


def tracked(self: InboxTask, key: str, fate: str) -> None:
    """outbox: the effect and the record's mark commit together (``Outbox.transaction``),
    the whole transaction retried while the database is away, as a careful task would."""
    inject(self, key, fate)
    ledger, _ = tables(self.app.conf.soak["prefix"])

    def commit() -> None:
        with outbox_of(self.app).transaction() as conn:
            conn.execute(ledger.insert(), effect(self, key))
            time.sleep(random.uniform(*WORK))
            if fate == "flaky" and self.request.retries == 0:
                raise Flaky(key)

    retrying(commit)


# -- the ledger ---------------------------------------------------------------------------
@cache
def ledger_engine(url: str, pid: int) -> Engine:
    """This process's engine for ledger writes of its own (``pid``: made after a fork)."""
    return engine_from_url(url)


def retrying(work: Callable[[], None]) -> None:
    """Run ``work``, again while the database is away (restarting, or SQLite busy), for at
    most :data:`WRITE_LIMIT` s."""
    deadline = time.monotonic() + WRITE_LIMIT
    while True:
        try:
            return work()
        except (OperationalError, InterfaceError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def write(app: Celery, row: dict[str, Any]) -> None:
    """Commit one ledger row on a connection of this process's own (retrying)."""
    config = app.conf.soak
    ledger, _ = tables(config["prefix"])

    def commit() -> None:
        with ledger_engine(config["db_url"], os.getpid()).begin() as conn:
            conn.execute(ledger.insert(), row)

    retrying(commit)


def started(task: Task, args: Any = (), **_: Any) -> None:
    """A ``start`` row per run of a soak task (before a transactional task's transaction)."""
    if str(task.name).startswith("soak.") and args:
        write(task.app, {"kind": kind_of(task), "key": args[0], "event": "start",
                         "pid": os.getpid(), "attempt": attempt(task), "at": time.time()})


task_prerun.connect(started, weak=False)


app = make_app(json.loads(os.environ.get(CONFIG_ENV, "null")) or {
    "db_url": "sqlite:////tmp/soak-unconfigured.db", "prefix": "soak_", "keyed_claim": "lease"})
