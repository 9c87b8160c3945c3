"""Transactional tasks against plain ones: tasks/s of a real prefork worker (-c 2) per database.

    python bench/transactional.py [--quick] [--tasks N] [--rounds R]
                                  [--databases postgresql,mysql,sqlite]

``run(args)`` returns rows for ``bench/run.py`` (any object with optional ``quick``,
``tx_tasks``, ``tx_rounds`` and ``databases`` attributes will do). Both tasks do the same work, one
INSERT into an effects table:

* **plain** (``InboxTask``, late ack): the insert commits on a connection of the
  task's own; the transport deletes the queue row afterwards, batched by the lease keeper;
* **transactional** (``transactional=True``): one transaction takes the queue row
  over (``SELECT ... FOR UPDATE`` by id and attempt), inserts, deletes the row, commits.

N tasks wait in the queue, then ``celery worker -P prefork -c 2`` starts; the rate is
tasks/s from the first effect to the last (worker start-up left out). Rounds alternate
the modes; each figure is the median of its rounds. This module is also the worker's app
(``celery -A bench.transactional``), configured from ``BENCH_TX_*`` variables.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
import uuid
from functools import cache
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from celery import Celery
from sqlalchemy import Column, Double, Integer, MetaData, String, Table, create_engine, func, select
from sqlalchemy.engine import Engine, make_url

import kombu_sqlinbox  # noqa: F401  (registers the sqlinbox+ alias)
from bench.targets import DATABASES, POLLING_INTERVAL, SERVERS, drop_tables
from celery_ext.tasks import InboxTask

REPO = Path(__file__).resolve().parent.parent
MODES = ("plain", "transactional")
CONFIG_ENV = "BENCH_TX_CONFIG"
STARTUP = 30.0
#: seconds without an effect (start-up included) after which the worker counts as stuck
STALL = 20.0

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


@app.task(base=InboxTask, name="bench.tx.plain")
def plain(run: str, n: int) -> None:
    with engine().begin() as conn:
        conn.execute(effects.insert().values(run=run, n=n, at=time.time()))


@app.task(base=InboxTask, transactional=True, bind=True, name="bench.tx.transactional")
def transactional(self: InboxTask, run: str, n: int) -> None:
    self.connection.execute(effects.insert().values(run=run, n=n, at=time.time()))


# -- measuring ----------------------------------------------------------------------------
def database_url(database: str, scratch: Path) -> str:
    if database == "sqlite":
        return f"sqlite:///{scratch}/transactional.db"
    url = make_url(SERVERS[database])
    if database == "postgresql":
        url = url.set(drivername="postgresql+psycopg")
    return url.render_as_string(hide_password=False)


def measure(database: str, db_url: str, mode: str, tasks: int, prefix: str,
            scratch: Path) -> float:
    """One worker run, ``tasks`` tasks of ``mode`` queued first: tasks/s from the first
    effect to the last."""
    queue = f"tx_{mode}"
    env = {**os.environ, CONFIG_ENV: json.dumps({"db_url": db_url, "prefix": prefix}),
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    sender = make_app(db_url, prefix)
    table = effects_table(prefix)
    name, run = f"bench.tx.{mode}", uuid.uuid4().hex
    with sender.producer_or_acquire() as producer:
        for n in range(tasks):
            sender.send_task(name, args=(run, n), queue=queue, producer=producer)
    sender.close()
    store = create_engine(db_url)
    log = scratch / f"{database}-{mode}.log"
    command = [sys.executable, "-m", "celery", "-A", "bench.transactional", "worker",
               "-P", "prefork", "-c", "2", "-Q", queue, "-n", f"{queue}@%h",
               "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "WARNING"]

    def done() -> int:
        with store.connect() as conn:
            return int(conn.execute(select(func.count()).select_from(table)
                                    .where(table.c.run == run)).scalar_one())

    with log.open("w") as output:
        worker = subprocess.Popen(command, env=env, cwd=REPO, stdout=output,
                                  stderr=subprocess.STDOUT, start_new_session=True)
    try:
        count, moved = 0, time.monotonic()
        while worker.poll() is None:
            now = done()
            if now != count:
                count, moved = now, time.monotonic()
            if count >= tasks or time.monotonic() - moved > STALL + (STARTUP if not count else 0):
                break
            time.sleep(0.05)
        if count < tasks:
            tail = log.read_text(errors="replace").strip().splitlines()[-5:]
            raise RuntimeError(f"{database} {mode}: {count}/{tasks} tasks ran; "
                               + " | ".join(tail))
        with store.connect() as conn:
            first, last = conn.execute(select(func.min(table.c.at), func.max(table.c.at))
                                       .where(table.c.run == run)).one()
    finally:
        stop(worker)
        store.dispose()
    return (tasks - 1) / (last - first)


def stop(worker: subprocess.Popen[bytes]) -> None:
    """Warm shutdown of a worker this module started; its group is killed if it stays."""
    if worker.poll() is None:
        worker.send_signal(signal.SIGTERM)
        try:
            worker.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait(10)


def run(args: Any) -> list[dict[str, Any]]:
    """Rows for bench/run.py: per database and mode the median of the rounds (modes
    alternate, so load from elsewhere on the machine spreads over both), then the ratio."""
    quick = bool(getattr(args, "quick", False))
    tasks = int(getattr(args, "tx_tasks", 0) or (200 if quick else 1000))
    rounds = int(getattr(args, "tx_rounds", 0) or (1 if quick else 3))
    databases = getattr(args, "databases", None) or list(DATABASES)
    prefix = f"btx{uuid.uuid4().hex[:6]}_"
    scratch = Path(f"/tmp/sqlinbox-bench-tx-{prefix[3:-1]}")
    scratch.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    for database in databases:
        db_url = database_url(database, scratch)
        store = create_engine(db_url)
        rates: dict[str, list[float]] = {mode: [] for mode in MODES}
        errors: dict[str, str] = {}
        try:
            effects_table(prefix).create(store)
            for _ in range(rounds):
                for mode in MODES:
                    try:
                        rates[mode].append(measure(database, db_url, mode, tasks, prefix,
                                                   scratch))
                    except Exception as exc:  # one database failing must not end the run
                        errors[mode] = f"{type(exc).__name__}: {exc}"[:200]
        finally:
            if database != "sqlite":
                drop_tables(db_url, prefix)
            store.dispose()
        for mode in MODES:
            row: dict[str, Any] = {"scenario": "transactional vs plain tasks",
                                   "database": database, "mode": mode,
                                   "pool": "prefork -c 2", "tasks": tasks, "rounds": rounds}
            if rates[mode]:
                row.update(tasks_per_s=round(statistics.median(rates[mode]), 1),
                           best=round(max(rates[mode]), 1))
            if mode in errors:
                row["error"] = errors[mode]
            rows.append(row)
            print("  ".join(f"{k}={v}" for k, v in row.items()), file=sys.stderr)
        if all(rates.values()):
            rows.append({"scenario": "transactional / plain", "database": database,
                         "ratio": round(statistics.median(rates["transactional"])
                                        / statistics.median(rates["plain"]), 2)})
    shutil.rmtree(scratch, ignore_errors=True)
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| database | plain tasks/s | transactional tasks/s | transactional / plain |",
             "|---|---:|---:|---:|"]
    for database in dict.fromkeys(row["database"] for row in rows):
        cells = {row.get("mode", "ratio"): row for row in rows if row["database"] == database}

        def show(mode: str, cells: dict[str, dict[str, Any]] = cells) -> str:
            row = cells.get(mode, {})
            return str(row.get("tasks_per_s") or row.get("ratio") or row.get("error", "n/a"))

        lines.append(f"| {database} | {show('plain')} | {show('transactional')} | "
                     f"{show('ratio')} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="200 tasks per mode, not 1000")
    parser.add_argument("--tasks", dest="tx_tasks", type=int, default=0,
                        help="tasks per worker run (default 1000, quick 200)")
    parser.add_argument("--rounds", dest="tx_rounds", type=int, default=0,
                        help="worker runs per mode (default 3, quick 1)")
    parser.add_argument("--databases", type=lambda v: [d for d in v.split(",") if d],
                        default=list(DATABASES))
    rows = run(parser.parse_args(argv))
    print(markdown(rows))
    return 0 if all("error" not in row for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
