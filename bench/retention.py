"""Result retention: ``backend_cleanup`` (``result_expires``) deleting a million expired
results while another process keeps storing results.

    python bench/retention.py [--quick] [--retention-rows N] [--retention-batch B]
                              [--databases postgresql,mysql,sqlite] [--json PATH]

Also a section of ``bench/run.py`` (``--sections retention``). Per database:
the result table is filled with N expired results (a day old, one in a hundred a failure,
200-byte metas) and 10,000 fresh ones, in INSERT ... SELECT chunks; then the result
store's ``expire`` (what the backend's ``cleanup`` runs, ``cleanup_batch`` rows per
transaction) deletes the expired ones while a writer on an engine of its own stores one
result after another. Figures: rows deleted, total seconds, rows per second, the longest
batch (from one batch's DELETE to the next one's: statement, commit and checkout), and the
writer's p50 / p99 / max per result stored during the prune (a batch holding locks shows
there). Not a test: the figures depend on the machine and on whatever else runs on it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
import uuid
from functools import partial
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # run as a script: import the bench package, not its modules
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from sqlalchemy import Connection, event, text

from bench.cli import run_alone
from bench.registry import Cell, Row, Section, goal, progress
from bench.report import table
from bench.targets import Context
from kombu_sqlinbox.database import Database
from kombu_sqlinbox.results import ResultStore

NAME = "retention"
FIGURES = {"rows": "rows deleted", "seconds": "total s", "rate": "rows/s",
           "max_batch_ms": "longest batch ms", "writer_ms": "writer p50 / p99 ms",
           "writer_max_ms": "writer max ms"}
#: rows per INSERT ... SELECT while filling; fresh results kept by the prune
CHUNK, FRESH = 100_000, 10_000
#: the results' age at expiry (``result_expires``), and how old the expired ones are
EXPIRES, AGE = 3600.0, 86400
DIGITS = " UNION ALL ".join(f"SELECT {d} AS d" for d in range(10))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("retention")
    group.add_argument("--retention-rows", type=int, default=0,
                       help="expired results to delete (default 1,000,000; quick 100,000)")
    group.add_argument("--retention-batch", type=int, default=1000,
                       help="rows per transaction (the backend's cleanup_batch, default 1000)")


def fill_sql(database: str, table: str, first: int, count: int, age: str) -> str:
    """INSERT ... SELECT of ``count`` results numbered from ``first``, done ``age``
    seconds (an expression of ``n``) before now."""
    meta = "x" * 200
    if database == "mysql":
        n = f"{first} + " + " + ".join(f"d{k}.d * {10 ** k}" for k in range(5))
        numbers = ", ".join(f"({DIGITS}) AS d{k}" for k in range(5)) + f" LIMIT {count}"
        return (f"INSERT INTO {table} (task_id, task_name, date_done, meta, status) "
                f"SELECT CONCAT('r-', {n}), CONCAT('bench.task', ({n}) % 20), "
                f"UNIX_TIMESTAMP() - {age.replace('n', f'({n})')}, '{meta}', "
                f"IF(({n}) % 100 = 0, 'FAILURE', 'SUCCESS') FROM {numbers}")
    if database == "postgresql":
        numbers, now, blob = (f"generate_series({first}, {first + count - 1}) AS s(n)",
                              "EXTRACT(EPOCH FROM now())", f"'{meta}'::bytea")
    else:
        numbers = (f"(WITH RECURSIVE s(n) AS (SELECT {first} UNION ALL SELECT n + 1 FROM s "
                   f"WHERE n < {first + count - 1}) SELECT n FROM s)")
        now, blob = "CAST(strftime('%s', 'now') AS REAL)", f"CAST('{meta}' AS BLOB)"
    return (f"INSERT INTO {table} (task_id, task_name, date_done, meta, status) "
            f"SELECT 'r-' || n, 'bench.task' || (n % 20), {now} - {age}, {blob}, "
            f"CASE WHEN n % 100 = 0 THEN 'FAILURE' ELSE 'SUCCESS' END FROM {numbers}")


def fill(store: ResultStore, database: str, rows: int) -> None:
    """``rows`` expired results and :data:`FRESH` fresh ones, then fresh statistics."""
    table = store.dialect.quote(store.sql.names[0])
    chunks = [(first, min(CHUNK, rows - first), f"{AGE} + n % 3600")
              for first in range(0, rows, CHUNK)]
    for first, count, age in [*chunks, (rows, FRESH, "n % 600")]:
        statement = text(fill_sql(database, table, first, count, age))
        store.database.run(partial(Connection.execute, statement=statement))
    analyze = {"postgresql": f"VACUUM ANALYZE {table}", "mysql": f"ANALYZE TABLE {table}",
               "sqlite": "ANALYZE"}[database]
    with store.database.engine.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT").exec_driver_sql(analyze)


class Writer(threading.Thread):
    """Another process's results, stored one after another on an engine of its own until
    stopped; when each began and the seconds it took."""

    def __init__(self, url: str, prefix: str) -> None:
        super().__init__(daemon=True)
        self.store = ResultStore(Database.open(url), prefix)
        self.store.ensure()
        self.stop = threading.Event()
        self.took: list[tuple[float, float]] = []
        self.failed: BaseException | None = None

    def run(self) -> None:
        meta = b"y" * 200
        try:
            while not self.stop.is_set():
                began = time.perf_counter()
                self.store.store(uuid.uuid4().hex, "SUCCESS", meta, "bench.write", "w@h")
                self.took.append((began, time.perf_counter() - began))
        except BaseException as exc:  # reported in the figures
            self.failed = exc

    def close(self) -> list[tuple[float, float]]:
        self.stop.set()
        self.join(60)
        self.store.close()
        if self.failed is not None:
            raise self.failed
        return self.took


def batch_starts(store: ResultStore) -> list[float]:
    """When each of the store's DELETEs began (perf_counter), as they run."""
    starts: list[float] = []

    def before(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if statement.lstrip().upper().startswith("DELETE"):
            starts.append(time.perf_counter())

    event.listen(store.database.engine, "before_cursor_execute", before)
    return starts


def prune(ctx: Context, database: str, rows: int, batch: int) -> dict[str, Cell]:
    url = ctx.url(database, "retention")
    prefix = f"{ctx.prefix}{database[:2]}_"
    store = ResultStore(Database.open(url), prefix)
    store.ensure()
    began = time.perf_counter()
    fill(store, database, rows)
    progress(f"{NAME} {database}: {rows:,} expired results in {time.perf_counter() - began:.0f}s")
    writer = Writer(url, prefix)
    starts = batch_starts(store)
    writer.start()
    while not writer.took and writer.is_alive():  # the writer is under way
        time.sleep(0.01)
    began = time.perf_counter()
    deleted = store.expire(EXPIRES, batch)
    ended = time.perf_counter()
    took = [seconds * 1000 for at, seconds in writer.close() if began <= at <= ended]
    store.close()
    seconds = ended - began
    longest = max(b - a for a, b in zip(starts, [*starts[1:], ended], strict=True))
    p99 = statistics.quantiles(took, n=100, method="inclusive")[98]
    return {
        "rows": Cell(deleted, f"{deleted:,}", {"expected": rows, "batch": batch}),
        "seconds": Cell(seconds, f"{seconds:.1f}"),
        "rate": Cell.rate(deleted, seconds),
        "max_batch_ms": Cell(longest * 1000, f"{longest * 1000:.0f}",
                             {"batches": len(starts)}),
        "writer_ms": Cell(p99, f"{statistics.median(took):.1f} / {p99:.1f}",
                          {"p50": statistics.median(took), "p99": p99, "writes": len(took)}),
        "writer_max_ms": Cell(max(took), f"{max(took):.0f}"),
    }


def run(args: argparse.Namespace) -> list[Row]:
    rows = args.retention_rows or (100_000 if args.quick else 1_000_000)
    found: list[Row] = []
    with Context() as ctx:
        for database in args.databases:
            cells = prune(ctx, database, rows, args.retention_batch)
            found += [cell.row(NAME, database, f"batch {args.retention_batch}", figure)
                      for figure, cell in cells.items()]
            progress(f"{NAME} {database}: " + ", ".join(
                f"{FIGURES[figure]} {cell.text}" for figure, cell in cells.items()))
    return found


def markdown(rows: list[Row], args: argparse.Namespace) -> str:
    return (table(rows, FIGURES) + "\n\nExpired results deleted by the result store's "
            "expire (backend_cleanup), a batch per transaction, while a writer on its own "
            "engine stores results one after another; its p50 / p99 / max per result "
            "during the prune.")


def targets(rows: list[Row]) -> list[Row]:
    """Every expired row goes; no batch holds its locks for long, so no writer waits long."""
    found = []
    for database in dict.fromkeys(r["database"] for r in rows):
        figures = {r["figure"]: r for r in rows if r["database"] == database}
        if "rows" in figures:
            expected = figures["rows"]["details"]["expected"]
            found.append(goal(NAME, database, "expired rows left", expected -
                              figures["rows"]["value"], 0, at_most=True))
        if "max_batch_ms" in figures:
            found.append(goal(NAME, database, "longest batch (ms)",
                              figures["max_batch_ms"]["value"], 1000, at_most=True))
        if "writer_ms" in figures:
            found.append(goal(NAME, database, "a result's write during the prune, p99 (ms)",
                              figures["writer_ms"]["value"], 250, at_most=True))
    return found


SECTION = Section(NAME, "Result retention: deleting expired results under writes",
                  add_arguments, run, markdown, targets)

if __name__ == "__main__":
    run_alone(SECTION)
