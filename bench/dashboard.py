"""The dashboard at volume: every page's time with 1,000,000 waiting rows and 100,000 dead
letters.

    python bench/dashboard.py [--quick] [--dashboard-rows N] [--dashboard-dead D]
                              [--dashboard-gets G] [--databases postgresql,mysql]
                              [--json PATH]

Also a section of ``bench/run.py`` (``--sections dashboard``). Per database server (SQLite
is left out: a file the dashboard reads at this volume is not what it is for): under a
fresh table prefix, queue ``jobs`` gets one message published and one dead-lettered
through the transport, then N copies of the first (INSERT ... SELECT, 100,000 rows a
statement) and D of the dead letter; the app's outbox N records sent and 1,000 not yet;
then ANALYZE. Each page is then read G times through
the WSGI application in this process (Werkzeug's test client, signed in), and each read's
time and SQL statements (the time the driver took to run them) recorded; the queues and
outbox pages also with every table counted, as before the dashboard estimated them.
Figures per page: p50 / p95 ms, statements per read, SQL ms p50. Not a test: the figures
depend on the machine and on whatever else runs on it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # run as a script: import the bench package, not its modules
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from celery import Celery
from kombu import Connection
from sqlalchemy import Engine, event, text
from werkzeug.test import Client

from bench.cli import run_alone
from bench.registry import Cell, Row, Section, goal, progress
from bench.report import grid
from bench.targets import Context
from celery_ext.dashboard import Dashboard
from celery_ext.outbox import Outbox, install, outbox_of
from kombu_sqlinbox.browsing import EXACT_UPTO
from kombu_sqlinbox.operations import Operations
from kombu_sqlinbox.options import parse_options

NAME = "dashboard"
TOKEN = "bench-token"
#: rows per INSERT ... SELECT while filling
CHUNK = 100_000
DIGITS = " UNION ALL ".join(f"SELECT {d} AS d" for d in range(10))
#: every page's p95 must stay under it
LIMIT_MS = 300.0
#: pages read again with every table counted, whatever its size (as the queues command
#: and ``celery outbox status`` count): what the estimates save, measured beside them
COUNTED = {"queues, every table counted": "/", "outbox, every record counted": "/outbox"}
#: a bound no table reaches
EVERY_ROW = 10**12
#: outbox records not yet sent, beside as many sent as there are waiting rows
UNPROCESSED = 1000
#: the table's columns a copy takes (the id is generated)
COLUMNS = "payload, headers, priority, available_at, locked_until, attempt"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(NAME)
    group.add_argument("--dashboard-rows", type=int, default=0,
                       help="waiting rows (default 1,000,000; quick 100,000)")
    group.add_argument("--dashboard-dead", type=int, default=0,
                       help="dead letters (default 100,000; quick 10,000)")
    group.add_argument("--dashboard-gets", type=int, default=0,
                       help="reads of each page (default 40; quick 15)")


def options(prefix: str) -> dict[str, Any]:
    return {"table_prefix": prefix, "polling_interval": 0.05,
            "queues": {"jobs": {"dead_letter_queue": "jobs.dead", "max_attempts": 1}}}


def seed(url: str, prefix: str) -> None:
    """One message waiting in ``jobs`` and one dead letter in ``jobs.dead``, through the
    transport (a consumer rejects the first message published)."""
    with Connection("sqlinbox+" + url, transport_options=options(prefix)) as conn:
        queue = conn.SimpleQueue("jobs")
        for number in range(2):
            queue.put({"n": number}, headers={"task": "bench.job", "id": f"seed-{number}"})
        queue.get(timeout=10).reject()
        queue.close()


def numbers(database: str, count: int) -> str:
    """A FROM item of ``count`` rows with a column ``n``."""
    if database == "mysql":
        digits = ", ".join(f"({DIGITS}) AS d{k}" for k in range(6))
        return f"(SELECT d0.d AS n FROM {digits} LIMIT {count}) AS s"
    return f"generate_series(1, {count}) AS s(n)"


def fill(engine: Engine, database: str, table: str, insert: Callable[[int], str],
         count: int) -> None:
    """``count`` rows, :data:`CHUNK` a statement (``insert`` of how many), then fresh
    statistics."""
    for first in range(0, count, CHUNK):
        with engine.begin() as conn:
            conn.execute(text(insert(min(CHUNK, count - first))))
    analyze = {"postgresql": f"VACUUM ANALYZE {table}", "mysql": f"ANALYZE TABLE {table}"}
    with engine.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT").exec_driver_sql(analyze[database])


def copies(ops: Operations, database: str, queue: str, count: int) -> None:
    """The queue's first row copied until it has ``count``."""
    table = ops.dialect.quote(ops.broker.spec_for(queue).table)
    with ops.broker.engine.begin() as conn:
        source = conn.execute(text(f"SELECT MIN(id) FROM {table}")).scalar_one()
    fill(ops.broker.engine, database, table, lambda many: (
        f"INSERT INTO {table} ({COLUMNS}) SELECT {COLUMNS} FROM {table} "
        f"CROSS JOIN {numbers(database, many)} WHERE id = {source}"), count - 1)


def records(outbox: Outbox, database: str, count: int, unprocessed: int) -> None:
    """``count`` outbox records sent (processed), then ``unprocessed`` not yet."""
    engine = outbox.store.engine
    table = outbox.store.prepared(engine).dialect.quote(outbox.spec.table)
    blob = "''" if database == "mysql" else "''::bytea"

    def insert(processed: str) -> Callable[[int], str]:
        return lambda many: (
            f"INSERT INTO {table} (task_id, task_name, exchange, routing_key, headers, "
            f"properties, body, created_at, processed_at) SELECT 'bench', 'bench.job', '', "
            f"'jobs', '{{}}', '{{}}', {blob}, {outbox.store.prepared(engine).dialect.now}, "
            f"{processed} FROM {numbers(database, many)}")

    fill(engine, database, table, insert(outbox.store.prepared(engine).dialect.now), count)
    fill(engine, database, table, insert("NULL"), unprocessed)


class Statements:
    """The statements each read runs, and the time the driver took for them."""

    def __init__(self, *engines: Engine) -> None:
        self.count, self.seconds, self.began = 0, 0.0, 0.0
        for engine in engines:
            event.listen(engine, "before_cursor_execute", self.before)
            event.listen(engine, "after_cursor_execute", self.after)

    def before(self, *args: Any) -> None:
        self.began = time.perf_counter()

    def after(self, *args: Any) -> None:
        self.count += 1
        self.seconds += time.perf_counter() - self.began


def pages(ops: Operations) -> dict[str, str]:
    """Each page the dashboard serves (the GETs), as its address at this volume."""
    jobs, dead = (ops.broker.spec_for(name).table for name in ("jobs", "jobs.dead"))

    def middle(table: str) -> int:
        quoted = ops.dialect.quote(table)
        with ops.broker.engine.connect() as conn:
            low, high = conn.execute(text(f"SELECT MIN(id), MAX(id) FROM {quoted}")).one()
        return int((low + high) // 2)

    half, dead_half = middle(jobs), middle(dead)
    return {
        "queues": "/",
        "queue jobs": "/queues/jobs",
        "queue jobs, a page mid-table": f"/queues/jobs?after={half}",
        "queue jobs.dead": "/queues/jobs.dead",
        "dead letters": "/dead?dlq=jobs.dead",
        "dead letters, a page mid-table": f"/dead?dlq=jobs.dead&after={dead_half}",
        "dead letters, a filter nothing takes": "/dead?dlq=jobs.dead&task=none.such",
        "one dead letter": f"/dead/jobs.dead/{dead_half}",
        "outbox": "/outbox",
        "failures": "/failures",
        "schedules": "/schedules",
        "pauses": "/pauses",
        "limits (none configured)": "/limits",
    }


def time_pages(ops: Operations, app: Celery, gets: int) -> dict[str, dict[str, Cell]]:
    """Every page read ``gets`` times, pages alternating (load from elsewhere spreads over
    all of them). The workers page is left out: its time is the broadcast's wait for
    the workers' replies, whatever the tables hold."""
    dashboards = [Dashboard(ops, token=TOKEN, app=app, exact_upto=upto)
                  for upto in (EXACT_UPTO, EVERY_ROW)]
    try:
        return read_pages(ops, app, gets, *(Client(each) for each in dashboards))
    finally:
        for each in dashboards:
            each.close()


def read_pages(ops: Operations, app: Celery, gets: int, client: Client, counted: Client
               ) -> dict[str, dict[str, Cell]]:
    """Every page read ``gets`` times by ``client``, and the :data:`COUNTED` ones by
    ``counted``."""
    for each in (client, counted):
        each.get(f"/?token={TOKEN}")
    statements = Statements(ops.broker.engine, outbox_of(app).store.engine)
    addresses = {name: (client, address) for name, address in pages(ops).items()}
    addresses.update({name: (counted, address) for name, address in COUNTED.items()})
    took: dict[str, list[tuple[float, int, float]]] = {name: [] for name in addresses}
    for _ in range(gets):
        for name, (reader, address) in addresses.items():
            statements.count, statements.seconds = 0, 0.0
            began = time.perf_counter()
            response = reader.get(address)
            seconds = time.perf_counter() - began
            if response.status_code != 200:
                raise RuntimeError(f"{address}: {response.status_code} {response.text[:300]}")
            took[name].append((seconds * 1000, statements.count, statements.seconds * 1000))
    found = {}
    for name, samples in took.items():
        ms = sorted(sample[0] for sample in samples)
        p95 = ms[min(len(ms) - 1, round(0.95 * (len(ms) - 1)))]
        found[name] = {
            "ms": Cell(p95, f"{statistics.median(ms):.1f} / {p95:.1f}",
                       {"p50": statistics.median(ms), "p95": p95, "gets": len(ms)}),
            "statements": Cell(statistics.median(s[1] for s in samples),
                               f"{statistics.median(s[1] for s in samples):.0f}"),
            "sql_ms": Cell(statistics.median(s[2] for s in samples),
                           f"{statistics.median(s[2] for s in samples):.1f}"),
        }
    return found


def measure(ctx: Context, database: str, rows: int, dead: int, gets: int
            ) -> dict[str, dict[str, Cell]]:
    url = ctx.url(database, NAME)
    prefix = f"{ctx.prefix}{database[:2]}_"
    seed(url, prefix)
    ops = Operations(url, parse_options(options(prefix)), ["jobs"])
    app = Celery("bench", broker="sqlinbox+" + url, set_as_current=False)
    app.conf.broker_transport_options = options(prefix)
    outbox = install(app, url, table=f"{prefix}outbox")
    try:
        began = time.perf_counter()
        copies(ops, database, "jobs", rows)
        copies(ops, database, "jobs.dead", dead)
        records(outbox, database, rows, UNPROCESSED)
        progress(f"{NAME} {database}: {rows:,} waiting rows, {dead:,} dead letters and "
                 f"{rows:,} outbox records in {time.perf_counter() - began:.0f}s")
        return time_pages(ops, app, gets)
    finally:
        outbox.store.engine.dispose()
        ops.close()


def run(args: argparse.Namespace) -> list[Row]:
    rows = args.dashboard_rows or (100_000 if args.quick else 1_000_000)
    dead = args.dashboard_dead or (10_000 if args.quick else 100_000)
    gets = args.dashboard_gets or (15 if args.quick else 40)
    found: list[Row] = []
    with Context() as ctx:
        for database in args.databases:
            if database == "sqlite":
                continue
            for page, cells in measure(ctx, database, rows, dead, gets).items():
                found += [cell.row(NAME, database, page, figure)
                          for figure, cell in cells.items()]
                progress(f"{NAME} {database} {page}: {cells['ms'].text} ms")
    return found


def markdown(rows: list[Row], args: argparse.Namespace) -> str:
    texts = {(r["database"], r["setup"], r["figure"]): r["text"] for r in rows}
    databases = list(dict.fromkeys(r["database"] for r in rows))
    lines = [[page, *(texts.get((database, page, figure), "-")
                      for database in databases for figure in ("ms", "statements", "sql_ms"))]
             for page in dict.fromkeys(r["setup"] for r in rows)]
    headings = ["page", *(f"{database} {what}" for database in databases
                          for what in ("p50 / p95 ms", "statements", "SQL ms p50"))]
    sizes = (f"{args.dashboard_rows or (100_000 if args.quick else 1_000_000):,} waiting rows, "
             f"{args.dashboard_dead or (10_000 if args.quick else 100_000):,} dead letters")
    return (grid(headings, lines) + f"\n\nEach page read through the WSGI application in "
            f"process, signed in, pages alternating; {sizes}; statements and SQL time per "
            "read as the driver ran them.")


def targets(rows: list[Row]) -> list[Row]:
    """Every page's p95 under :data:`LIMIT_MS` (the counted ones reported beside)."""
    return [goal(NAME, r["database"], f"{r['setup']} p95 (ms)", r["details"]["p95"],
                 None if r["setup"] in COUNTED else LIMIT_MS, at_most=True)
            for r in rows if r["figure"] == "ms" and "p95" in r["details"]]


SECTION = Section(NAME, "The dashboard's pages at volume", add_arguments, run, markdown,
                  targets)

if __name__ == "__main__":
    run_alone(SECTION)
