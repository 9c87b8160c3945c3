"""Scale of one server: 1, 2, 4, 8, 16 consumer processes on a backlog of a million rows.

    python bench/consumers.py [--quick] [--consumers 1,2,4,8,16] [--consumers-seconds S]
                              [--consumers-backlog ROWS] [--consumers-prefetch N]
                              [--databases postgresql,mysql,sqlite] [--json PATH]

Per database, one queue table is filled with ``--consumers-backlog`` waiting rows
(default 1,000,000; copies of one published message, one bulk ``INSERT ... SELECT``, as
``bench/scale.py`` fills), then for each count of consumers in turn that many spawned
processes each run the transport's kombu consumer at ``--consumers-prefetch``, acking
each message, all started on one signal and stopped ``--consumers-seconds`` later.
Per count:

* msg/s: messages acked by all of them over the run's seconds;
* claims, and their p50 / p99 ms: every claim statement of every process (each process
  wraps the dialect's claims and times them, as ``bench/mvcc.py`` does);
* lock waits: PostgreSQL samples ``pg_stat_activity`` every 0.1 s for the consumers'
  sessions (named by their ``application_name``) that are running a statement and shows
  how many of those were waiting on a lock (``wait_event_type = 'Lock'``); MariaDB the
  growth of ``Innodb_row_lock_waits`` and ``Innodb_row_lock_time`` over the run,
  server-wide (other work on the server counts too); SQLite has no such account: ``-``;
* RSS per process: mean and largest, 2 s in and at the end (from ``/proc``);
* the backlog when the count started (the runs before it took their share).

SQLite takes one writer at a time: it runs 1, 2 and 4 consumers unless told otherwise.
Runs alone or as the ``consumers`` section of ``bench/run.py``; a benchmark, not a test:
a machine of two cores bounds the absolute rate; the shape across counts is what it shows.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # run as a script: import the bench package, not its modules
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from kombu import Consumer
from sqlalchemy import create_engine, text
from sqlalchemy.engine import Engine

from bench.children import Children, Link, timed_claims
from bench.cli import run_alone
from bench.kombu_bench import publish_many
from bench.registry import Cell, Row, Section, goal, progress, spread
from bench.report import table
from bench.scale import fill, rss_mb
from bench.targets import Context, Sizes, Target, connect, kombu_queue, scratch_queue

NAME = "consumers"
COUNTS = (1, 2, 4, 8, 16)
#: SQLite: one writer at a time, so a few processes tell its curve
SQLITE_COUNTS = (1, 2, 4)
BACKLOG = 1_000_000
SECONDS = 30.0
#: seconds the children may take to start (16 processes importing on a loaded machine)
START_LIMIT = 180.0
#: seconds between the samples of PostgreSQL's sessions
SAMPLE = 0.1
#: seconds after the start at which the first RSS is read
RSS_FIRST = 2.0
FIGURES = {"msg/s": "msg/s", "claims": "claims", "claim": "claim p50 / p99 ms",
           "locks": "lock waits", "rss": "RSS MB per process, mean (max): 2 s → end",
           "backlog": "backlog at start"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("consumers")
    group.add_argument("--consumers", type=lambda v: [int(n) for n in v.split(",")],
                       help=f"consumer counts (default {','.join(map(str, COUNTS))}; "
                            f"SQLite {','.join(map(str, SQLITE_COUNTS))})")
    group.add_argument("--consumers-seconds", type=float, default=0,
                       help=f"seconds each count runs (default {SECONDS:g}, quick 10)")
    group.add_argument("--consumers-backlog", type=int, default=0,
                       help=f"waiting rows filled first (default {BACKLOG:,}, quick 100,000)")
    group.add_argument("--consumers-prefetch", type=int, default=8,
                       help="each consumer's prefetch (default 8: a Celery worker of "
                            "concurrency 2 at the default multiplier)")


# -- the child process ----------------------------------------------------------------------
def consume(link: Link, target: Target, name: str, prefetch: int, seconds: float) -> None:
    """Ack every message for ``seconds`` from the common start; then report the claims'
    milliseconds."""
    timings = timed_claims()

    def on_message(payload: dict[str, Any], message: Any) -> None:
        message.ack()
        link.add()

    with connect(target) as conn:
        channel = conn.channel()
        consumer = Consumer(channel, [kombu_queue(name)], callbacks=[on_message],
                            accept=["json"])
        consumer.qos(prefetch_count=prefetch)
        link.ready(START_LIMIT)
        timings.clear()
        consumer.consume()
        ends = time.monotonic() + seconds
        while (left := ends - time.monotonic()) > 0:
            with contextlib.suppress(TimeoutError):
                conn.drain_events(timeout=min(0.5, left))
        link.report("claims", [d * 1000 for _, d in timings])
        consumer.cancel()
        channel.close()


# -- lock waits ------------------------------------------------------------------------------
class LockWaits:
    """Lock waits over one run: PostgreSQL's sampled sessions of the consumers (their
    ``application_name`` is ``table``), MariaDB's server-wide row lock counters; SQLite
    none."""

    def __init__(self, engine: Engine, database: str, table: str) -> None:
        self.engine, self.database, self.table = engine, database, table
        self.samples = {"waiting": 0, "active": 0}
        self.status: dict[str, int] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.sample, daemon=True)

    def innodb(self) -> dict[str, int]:
        with self.engine.connect() as conn:
            found = conn.execute(text(
                "SHOW GLOBAL STATUS WHERE Variable_name LIKE 'Innodb_row_lock_%' "
                "OR Variable_name = 'Innodb_deadlocks'")).all()
        return {str(name): int(value) for name, value in found}

    def sample(self) -> None:
        with self.engine.connect() as conn:
            while not self.stop.wait(SAMPLE):
                waiting, active = conn.execute(text(
                    "SELECT count(*) FILTER (WHERE wait_event_type = 'Lock'), count(*) "
                    "FROM pg_stat_activity WHERE state = 'active' AND application_name = :a"),
                    {"a": self.table}).one()
                self.samples["waiting"] += waiting
                self.samples["active"] += active

    def __enter__(self) -> LockWaits:
        if self.database == "postgresql":
            self.thread.start()
        elif self.database == "mysql":
            self.status = self.innodb()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.database == "postgresql":
            self.stop.set()
            self.thread.join(10)
        elif self.database == "mysql":
            after = self.innodb()
            self.status = {k: after[k] - self.status.get(k, 0) for k in after}

    def cell(self) -> Cell:
        if self.database == "postgresql":
            waiting, active = self.samples["waiting"], self.samples["active"]
            share = 100 * waiting / active if active else 0.0
            return Cell(share, f"{waiting:,} of {active:,} samples ({share:.1f}%)",
                        dict(self.samples))
        if self.database == "mysql":
            waits = self.status.get("Innodb_row_lock_waits", 0)
            return Cell(waits, f"{self.status.get('Innodb_deadlocks', 0):,} deadlocks, {waits:,} "
                               f"waits, {self.status.get('Innodb_row_lock_time', 0):,} ms "
                               "(server-wide)", dict(self.status))
        return Cell(None, "-")


# -- one count, one database ------------------------------------------------------------------
def rss_cell(first: list[float], last: list[float]) -> Cell:
    def text_of(values: list[float]) -> str:
        return f"{statistics.mean(values):.1f} ({max(values):.1f})" if values else "-"

    return Cell(max(last, default=None), f"{text_of(first)} → {text_of(last)}",
                {"first": first, "last": last})


def waiting_rows(engine: Engine, table: str) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text(f"SELECT COUNT(*) FROM {table}")).scalar() or 0)


def one_count(target: Target, engine: Engine, table: tuple[str, str], name: str,
              count: int, seconds: float, prefetch: int) -> dict[str, Cell]:
    """``count`` consumers for ``seconds`` on the filled queue (``table``: its quoted
    reference and its name): figure -> cell."""
    backlog = waiting_rows(engine, table[0])
    first: list[float] = []
    last: list[float] = []
    claims: list[float] = []
    with Children(count, consume, target, name, prefetch, seconds) as children:
        children.wait_ready(time.monotonic() + START_LIMIT)
        pids = [p.pid for p in children.processes]
        with LockWaits(engine, target.database or "", table[1]) as locks:
            children.start.set()
            began = time.monotonic()
            time.sleep(RSS_FIRST)
            first = [rss_mb(pid) for pid in pids]
            time.sleep(max(0.0, began + seconds - 0.5 - time.monotonic()))
            last = [rss_mb(pid) for pid in pids]
            deadline = began + seconds + 60
            for _ in range(count):
                kind, _, value = children.next(deadline)
                if kind == "claims":
                    claims += value
        acked = children.counter.value
    rate = Cell.rate(acked, seconds, consumers=count)
    return {"msg/s": rate, "claims": Cell(len(claims), f"{len(claims):,}"),
            "claim": spread(claims) if claims else Cell(None, "-"),
            "locks": locks.cell(), "rss": rss_cell(first, last),
            "backlog": Cell(backlog, f"{backlog:,}")}


def database_rows(ctx: Context, database: str, counts: list[int], backlog: int,
                  seconds: float, prefetch: int) -> list[Row]:
    name = ctx.queue_name("consumers")
    target = ctx.sqlinbox(database, NAME)
    if database == "postgresql":  # the consumers' sessions, told apart by their name
        target = replace(target, url=f"{target.url}?application_name={ctx.prefix}{name}")
    rows: list[Row] = []
    with scratch_queue(target, name) as queue, connect(target) as conn:
        publish_many(conn, queue, range(1))
        began = time.monotonic()
        fill(target, conn, name, backlog, 0)
        progress(f"{NAME} {database}: {backlog:,} rows filled in "
                 f"{time.monotonic() - began:.0f} s")
        broker = conn.default_channel.broker
        spec = broker.table(name).spec
        table = (broker.dialect.table_ref(spec), f"{ctx.prefix}{name}")
        engine = create_engine(broker.engine.url, pool_size=2,
                               isolation_level="AUTOCOMMIT")
        try:
            for count in counts:
                setup = f"{count} consumer{'s' if count > 1 else ''}"
                try:
                    cells = one_count(target, engine, table, name, count,
                                      seconds, prefetch)
                except Exception as exc:  # one count failing spoils only its own row
                    cells = {"msg/s": Cell.failed(exc)}
                rows += [cell.row(NAME, database, setup, figure)
                         for figure, cell in cells.items()]
                progress(f"{NAME} {database} {setup}: "
                         + ", ".join(f"{k}={c.text}" for k, c in cells.items()))
        finally:
            engine.dispose()
    return rows


def run(args: argparse.Namespace) -> list[Row]:
    """Every figure of this module for ``args``."""
    seconds = args.consumers_seconds or (10.0 if args.quick else SECONDS)
    backlog = args.consumers_backlog or (100_000 if args.quick else BACKLOG)
    rows: list[Row] = []
    with Context(Sizes().quick() if args.quick else Sizes()) as ctx:
        for database in args.databases:
            counts = args.consumers or list(SQLITE_COUNTS if database == "sqlite" else COUNTS)
            try:
                rows += database_rows(ctx, database, counts, backlog, seconds,
                                      args.consumers_prefetch)
            except Exception as exc:  # a database that is down spoils only its own rows
                rows.append(Cell.failed(exc).row(NAME, database, "failed", "msg/s"))
    return rows


def markdown(rows: list[Row], args: argparse.Namespace) -> str:
    seconds = args.consumers_seconds or (10.0 if args.quick else SECONDS)
    return "\n".join([
        table(rows, FIGURES),
        "",
        f"Each count: that many spawned processes, each the transport's kombu consumer at "
        f"prefetch {args.consumers_prefetch} acking each message, for {seconds:g} s from one "
        "start signal, on one table filled with the backlog once (the counts run in turn). "
        "Lock waits: PostgreSQL, sampled sessions of the consumers (every "
        f"{SAMPLE:g} s) waiting on a lock, of those running a statement; MariaDB, the growth "
        "of Innodb_row_lock_waits / Innodb_row_lock_time over the run, server-wide.",
    ])


def targets(rows: list[Row]) -> list[Row]:
    """Reported beside the targets: the best rate over one consumer's, and the claim p50 of
    the most consumers over one's."""
    found = []
    for database in sorted({r["database"] for r in rows}):
        rates = [r for r in rows if r["database"] == database and r["figure"] == "msg/s"
                 and r["value"]]
        claims = [r for r in rows if r["database"] == database and r["figure"] == "claim"
                  and r["value"]]
        if len(rates) > 1:
            found.append(goal(NAME, database, "best msg/s ÷ 1 consumer's",
                              max(r["value"] for r in rates) / rates[0]["value"], None))
        if len(claims) > 1:
            found.append(goal(NAME, database, "claim p50, most consumers ÷ 1 consumer's",
                              claims[-1]["value"] / claims[0]["value"], None))
    return found


SECTION = Section(NAME, "Scale of one server: consumer processes on a million waiting rows",
                  add_arguments, run, markdown, targets)

if __name__ == "__main__":
    run_alone(SECTION)
