"""The refund example as the tests run it: ``celery -A tests.transactional.apps.service worker``.

The example app (``examples/refunds``) is imported as it is; this module adds what
only the tests need, without touching the example's tasks:

* probe queues with their own transport options (isolation level, SQLite begin mode,
  ``claim='row_lock'``, a table without ``available_at``) and probe tasks that note what
  they saw, or write an effect row to ``probe_effects`` (breaking a constraint on request);
* an outbox on the service's database that tracks no task (:data:`OUTBOX`);
* marker files from Celery signals: ``<uuid>.prerun`` (task, args and the pool
  process's pid, to ``kill -9`` it) and ``<task id>.failure`` (the exception type).

The example reads its settings from ``REFUNDS_*`` variables; ``TX_RUNS`` names
the marker directory; ``TX_VISIBILITY_TIMEOUT`` sets the example queues' lease.
"""

from __future__ import annotations

import json
import os
import sqlite3
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from celery import Celery
from celery.signals import task_failure, task_prerun
from sqlalchemy import (
    CheckConstraint,
    Column,
    Connection,
    ForeignKey,
    Integer,
    MetaData,
    String,
    Table,
    text,
)
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError

import celery_ext
from celery_ext.tasks import InboxTask, delivered_row
from kombu_sqlinbox.tables import TableBuilder, table_name_for_queue

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "refunds"
if str(EXAMPLE) not in sys.path:
    sys.path.insert(0, str(EXAMPLE))

# the example's modules, found through the path above (re-exported for the test side)
import card_processor as card_processor  # noqa: E402
import refunds_app as refunds_app  # noqa: E402
import web as web  # noqa: E402

RUNS_ENV = "TX_RUNS"
VISIBILITY_ENV = "TX_VISIBILITY_TIMEOUT"
#: the longest :func:`hold` keeps its transaction open
HOLD_LIMIT = 60.0
#: the lease of ``probe.short`` (seconds): short beside a nap, long enough that its keeper's
#: extension (every third of it) may come two seconds late on a loaded machine
SHORT_LEASE = 3.0
#: a queue table without available_at: a retry in place cannot be delayed on it
PROMPT_TABLE = TableBuilder("probe_prompt").id().payload().headers().locked_until().attempt()
#: probe queues of every database
COMMON_PROBES: dict[str, dict[str, Any]] = {"probe.prompt": {"table": PROMPT_TABLE.build()}}
#: probe queue -> its transport options, per kind of database
PROBE_QUEUES: dict[str, dict[str, dict[str, Any]]] = {
    "server": {
        **COMMON_PROBES,
        "probe": {},
        "probe.repeatable": {"isolation_level": "REPEATABLE READ"},
        "probe.serializable": {"isolation_level": "SERIALIZABLE"},
        "probe.rowlock": {"claim": "row_lock"},
        "probe.short": {"visibility_timeout": SHORT_LEASE},
    },
    "sqlite": {
        **COMMON_PROBES,
        "probe": {},
        "probe.deferred": {"sqlite_begin": "deferred"},
        "probe.immediate": {"sqlite_begin": "immediate"},
    },
}

app: Celery = refunds_app.app
#: the example's own transport options, before :func:`configure` adds to them
EXAMPLE_OPTIONS: dict[str, Any] = dict(app.conf.broker_transport_options)
#: an outbox on the service's database that records nothing itself: tests write records
#: and send deliveries naming them (or naming none it holds) in the ``outbox_id`` header
OUTBOX = celery_ext.install(app, tasks=(), republish_on_start=False)


def kind_of(db_url: str) -> str:
    return "sqlite" if make_url(db_url).get_backend_name() == "sqlite" else "server"


def probe_queues(db_url: str) -> list[str]:
    return list(PROBE_QUEUES[kind_of(db_url)])


def table_of(queue: str) -> str:
    """The table of ``queue``: the one its probe settings declare, or the default one."""
    declared = COMMON_PROBES.get(queue, {}).get("table")
    return declared.table if declared is not None else table_name_for_queue(queue, "sqlinbox_")


def configure(db_url: str) -> None:
    """Point the app at ``db_url`` with the example's queues plus the probe queues."""
    queues = dict(EXAMPLE_OPTIONS["queues"])
    lease = os.environ.get(VISIBILITY_ENV)
    if lease:
        queues = {name: {**settings, "visibility_timeout": float(lease)}
                  for name, settings in queues.items()}
    queues.update(PROBE_QUEUES[kind_of(db_url)])
    app.conf.update(
        broker_url=f"sqlinbox+{db_url}",
        broker_transport_options={**EXAMPLE_OPTIONS, "queues": queues, "polling_interval": 0.1},
        worker_redirect_stdouts=False,
        # a killed pool process's task counts as lost after 1 s instead of 10
        worker_lost_wait=1.0,
    )
    OUTBOX.bind_engine(db_url)


# -- probes -----------------------------------------------------------------------------
def observe_transaction(conn: Connection) -> str:
    """What this transaction is: its isolation level, or on SQLite whether it holds the
    write lock already (a second connection cannot begin a write within half a second;
    the worker's own claims hold the lock only for moments)."""
    name = conn.dialect.name
    if name == "postgresql":
        return str(conn.execute(text("SHOW transaction_isolation")).scalar_one()).upper()
    if name in ("mysql", "mariadb"):
        value = conn.execute(text("SELECT @@tx_isolation")).scalar_one()
        return str(value).replace("-", " ").upper()
    other = sqlite3.connect(str(conn.engine.url.database), timeout=0.5, isolation_level=None)
    try:
        other.execute("BEGIN IMMEDIATE")
        other.execute("ROLLBACK")
        return "write lock free"
    except sqlite3.OperationalError:
        return "write lock held"
    finally:
        other.close()


def note(key: str, what: str) -> None:
    """Leave ``<key>.note`` holding ``what`` (a file: it outlives a rolled-back transaction,
    and writing it cannot fail on SQLite's write lock)."""
    _write(Path(os.environ[RUNS_ENV]) / f"{key}.note", {"what": what})


@app.task(base=InboxTask, transactional=True, bind=True, name="probe.observe")
def observe(self: InboxTask, key: str) -> None:
    """Note what the delivery's transaction is."""
    note(key, observe_transaction(self.connection))


@app.task(base=InboxTask, transactional=True, bind=True, name="probe.retry_once",
          max_retries=3)
def retry_once(self: InboxTask, key: str) -> None:
    """Celery's own ``self.retry()`` from a transactional task: the first run retries."""
    if self.request.retries == 0:
        raise self.retry(countdown=0)
    note(key, "retried")


def wait_for_release(key: str) -> None:
    """Return once ``<key>.release`` exists (the test's go-ahead)."""
    release = Path(os.environ[RUNS_ENV]) / f"{key}.release"
    deadline = time.monotonic() + HOLD_LIMIT
    while not release.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{key}: no release after {HOLD_LIMIT} s")
        time.sleep(0.02)


@app.task(base=InboxTask, transactional=True, bind=True, name="probe.hold")
def hold(self: InboxTask, key: str) -> None:
    """Keep the delivery's transaction (and its lock on the row) open until ``<key>.release``
    exists: a long transactional task."""
    note(key, "holding")
    wait_for_release(key)


@app.task(base=InboxTask, bind=True, name="probe.nap")
def nap(self: InboxTask, key: str, seconds: float) -> None:
    """A plain (not transactional) task that takes a while."""
    time.sleep(seconds)
    note(key, "napped")


# -- effects: one row per key, constraints to break -------------------------------------
probe_metadata = MetaData()
probe_parents = Table("probe_parents", probe_metadata,
                      Column("parent_key", String(64), primary_key=True))
probe_effects = Table(
    "probe_effects", probe_metadata,
    Column("effect_key", String(64), primary_key=True),  # unique: the same work twice
    Column("label", String(64), nullable=False),
    Column("amount", Integer, nullable=False),
    Column("parent_key", String(64), ForeignKey(probe_parents.c.parent_key)),
    CheckConstraint("amount >= 0", name="probe_amount_not_negative"),
)
#: the values that break each constraint (SQLite checks foreign keys only when asked to)
VIOLATIONS: dict[str, dict[str, Any]] = {
    "not_null": {"label": None},
    "check": {"amount": -1},
    "foreign_key": {"parent_key": "no-such-parent"},
}


def write_effect(conn: Connection, key: str, violation: str | None = None) -> None:
    conn.execute(probe_effects.insert().values(
        {"effect_key": key, "label": "done", "amount": 1, **VIOLATIONS.get(violation or "", {})}))


@app.task(base=InboxTask, transactional=True, bind=True, name="probe.effect")
def effect(self: InboxTask, key: str, violation: str | None = None) -> None:
    """Write the effect row of ``key`` (breaking ``violation``, if named)."""
    write_effect(self.connection, key, violation)


@app.task(base=InboxTask, transactional=True, bind=True, name="probe.effect_retried",
          autoretry_for=(DBAPIError,), max_retries=1, default_retry_delay=0)
def effect_retried(self: InboxTask, key: str, violation: str | None = None) -> None:
    """:func:`effect` with a retry policy: a database error retries it once."""
    write_effect(self.connection, key, violation)


def server_connection_id(conn: Connection) -> int:
    """The server's id of ``conn``'s session (to end it from another connection)."""
    query = "SELECT pg_backend_pid()" if conn.dialect.name == "postgresql" else \
        "SELECT CONNECTION_ID()"
    return int(conn.execute(text(query)).scalar_one())


@app.task(base=InboxTask, transactional=True, bind=True, name="probe.effect_held")
def effect_held(self: InboxTask, key: str) -> None:
    """Write the effect row of ``key``; the first delivery then notes its connection's
    server id and waits for ``<key>.release`` (meanwhile the test ends that connection)."""
    write_effect(self.connection, key)
    if self.request.retries == 0:
        note(key, str(server_connection_id(self.connection)))
        wait_for_release(key)


@app.task(base=InboxTask, bind=True, name="probe.retry_later")
def retry_later(self: InboxTask, key: str, seconds: float) -> None:
    """The first delivery retries in place after ``seconds``; the next notes it ran."""
    if int((delivered_row(self.request) or {})["attempt"]) == 1:
        raise self.retry_after(seconds)
    note(key, "ran again")


# -- markers ----------------------------------------------------------------------------
def _write(path: Path, record: dict[str, Any]) -> None:
    partial = path.with_name(path.name + ".part")
    partial.write_text(json.dumps(record))
    partial.rename(path)


@task_prerun.connect
def _mark_run(task_id: str, task: Any, args: Any = (), **_: Any) -> None:
    runs = os.environ.get(RUNS_ENV)
    if runs:
        _write(Path(runs) / f"{uuid.uuid4().hex}.prerun",
               {"task": task.name, "id": task_id, "args": list(args), "pid": os.getpid()})


@task_failure.connect
def _mark_failure(task_id: str, exception: BaseException, **_: Any) -> None:
    runs = os.environ.get(RUNS_ENV)
    if runs:
        _write(Path(runs) / f"{task_id}.failure",
               {"type": type(exception).__name__, "message": str(exception)})


configure(refunds_app.DATABASE_URL)
