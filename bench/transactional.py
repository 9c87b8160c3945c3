"""Transactional tasks against plain ones: tasks/s of a real prefork worker (-c 2) per database.

    python bench/transactional.py [--quick] [--tx-tasks N] [--tx-rounds R]
                                  [--databases postgresql,mysql,sqlite] [--json PATH]

Also a section of ``bench/run.py``. Both tasks do the same work, one INSERT into an
effects table:

* **plain** (``InboxTask``, late ack): the insert commits on a connection of the
  task's own; the transport deletes the queue row afterwards, batched by the lease keeper;
* **transactional** (``transactional=True``): one transaction takes the queue row
  over (``SELECT ... FOR UPDATE`` by id and attempt), inserts, deletes the row, commits.

N tasks wait in the queue, then ``celery worker -P prefork -c 2`` starts; the rate is
tasks/s from the first effect to the last (worker start-up left out). Rounds alternate
the modes; each figure is the median of its rounds. PostgreSQL runs on psycopg 3. This
module is also the worker's app (``celery -A bench.transactional``), configured from
``BENCH_TX_CONFIG``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
from functools import cache, partial
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # run as a script: import the bench package, not its modules
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from celery import Celery
from sqlalchemy import Column, Double, Integer, MetaData, String, Table, create_engine, func, select
from sqlalchemy.engine import Engine

import kombu_sqlinbox  # noqa: F401  (registers the sqlinbox+ alias)
from bench.cli import run_alone
from bench.registry import Cell, Row, Section, alternate, goal, progress, ratio
from bench.report import table
from bench.targets import POLLING_INTERVAL, Context
from bench.workers import queue_tasks, wait_done, worker
from celery_ext.tasks import InboxTask

NAME = "transactional"
MODES = ("plain", "transactional")
FIGURES = {"plain": "plain tasks/s", "transactional": "transactional tasks/s",
           "ratio": "transactional / plain"}
CONFIG_ENV = "BENCH_TX_CONFIG"

CONFIG: dict[str, Any] = json.loads(os.environ.get(CONFIG_ENV, "null")) or {
    "db_url": "sqlite://", "prefix": "btx_"}


def effects_table(prefix: str) -> Table:
    """Where both tasks write their one row (``at``: when, for the rate)."""
    return Table(
        f"{prefix}effects", MetaData(),
        Column("id", Integer, primary_key=True, autoincrement=True),
        Column("run", String(32), nullable=False),
        Column("n", Integer, nullable=False),
        Column("at", Double, nullable=False),
    )


def make_app(db_url: str, prefix: str) -> Celery:
    made = Celery("bench-transactional", broker=f"sqlinbox+{db_url}", set_as_current=False)
    made.conf.update(
        broker_transport_options={"table_prefix": prefix, "polling_interval": POLLING_INTERVAL},
        task_ignore_result=True,
        worker_hijack_root_logger=False,
        broker_connection_retry_on_startup=True,
    )
    return made


app = make_app(CONFIG["db_url"], CONFIG["prefix"])
effects = effects_table(CONFIG["prefix"])


@cache
def engine() -> Engine:
    """This process's engine for the plain task's own connection (made after the fork)."""
    return create_engine(CONFIG["db_url"])


def plain(run: str, n: int) -> None:
    with engine().begin() as conn:
        conn.execute(effects.insert().values(run=run, n=n, at=time.time()))


def transactional(self: InboxTask, run: str, n: int) -> None:
    self.connection.execute(effects.insert().values(run=run, n=n, at=time.time()))


app.task(base=InboxTask, name="bench.tx.plain")(plain)
app.task(base=InboxTask, transactional=True, bind=True, name="bench.tx.transactional")(
    transactional)


# -- measuring ----------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("transactional")
    group.add_argument("--tx-tasks", type=int, default=0,
                       help="tasks per worker run (default 1000, quick 200)")
    group.add_argument("--tx-rounds", type=int, default=0,
                       help="worker runs per mode (default 3, quick 1)")


def measure(ctx: Context, database: str, mode: str, tasks: int) -> float:
    """One worker run, ``tasks`` tasks of ``mode`` queued first: tasks/s from the first
    effect to the last."""
    db_url = ctx.url(database, "transactional")
    queue = ctx.queue_name(f"tx{mode}")
    sender = make_app(db_url, ctx.prefix)
    written = effects_table(ctx.prefix)
    run = uuid.uuid4().hex
    queue_tasks(sender, f"bench.tx.{mode}", queue, [(run, n) for n in range(tasks)])
    sender.close()
    store = create_engine(db_url)

    def where(*columns: Any) -> Any:
        return select(*columns).select_from(written).where(written.c.run == run)

    def done() -> int:
        with store.connect() as conn:
            return int(conn.execute(where(func.count())).scalar_one())

    log = ctx.scratch / f"{queue}.log"
    env = {CONFIG_ENV: json.dumps({"db_url": db_url, "prefix": ctx.prefix})}
    try:
        with worker("bench.transactional", ("-P", "prefork", "-c", "2"), queue, env,
                    log) as process:
            wait_done(process, done, tasks, log, every=0.05)
        with store.connect() as conn:
            first, last = conn.execute(where(func.min(written.c.at), func.max(written.c.at))).one()
    finally:
        store.dispose()
    return float((tasks - 1) / (last - first))


def create(url: str, written: Table) -> None:
    store = create_engine(url)
    try:
        written.create(store)
    finally:
        store.dispose()


def run(args: argparse.Namespace) -> list[Row]:
    """Per database: each mode's tasks/s (median of the rounds), then their ratio
    (``args``: ``quick``, ``databases``, ``tx_tasks``, ``tx_rounds``)."""
    tasks = args.tx_tasks or (200 if args.quick else 1000)
    rounds = args.tx_rounds or (1 if args.quick else 3)
    rows: list[Row] = []
    with Context(pg_driver="psycopg") as ctx:
        for database in args.databases:
            try:
                create(ctx.url(database, "transactional"), effects_table(ctx.prefix))
            except Exception as exc:  # a database that is down spoils only its own rows
                rows.append(Cell.failed(exc).row(NAME, database, "prefork -c 2", "plain"))
                continue
            cells = alternate({mode: partial(measure, ctx, database, mode, tasks)
                               for mode in MODES}, rounds, lambda v: f"{v:,.0f}")
            value = ratio(cells["transactional"], cells["plain"])
            cells["ratio"] = Cell(value, "n/a" if value is None else f"{value:.2f}")
            for figure, cell in cells.items():
                cell.details.update(tasks=tasks, rounds=rounds)
                rows.append(cell.row(NAME, database, "prefork -c 2", figure))
            progress(f"{NAME} {database}: "
                     + ", ".join(f"{k}={c.text}" for k, c in cells.items()))
    return rows


def markdown(rows: list[Row], args: argparse.Namespace) -> str:
    tasks = rows[0]["details"].get("tasks") if rows else 0
    rounds = rows[0]["details"].get("rounds") if rows else 0
    return (table(rows, FIGURES, "pool") + f"\n\n{tasks} tasks per worker run, median of "
            f"{rounds} round(s); tasks/s from the first effect to the last.")


def targets(rows: list[Row]) -> list[Row]:
    """No figure to reach: the ratio is reported beside the other targets."""
    return [goal(NAME, r["database"], "transactional ÷ plain tasks/s", r["value"], None)
            for r in rows if r["figure"] == "ratio" and r["value"] is not None]


SECTION = Section(NAME, "Transactional tasks vs plain tasks", add_arguments, run,
                  markdown, targets)

if __name__ == "__main__":
    run_alone(SECTION)
