"""Chord counts: what counting one header task costs, at the start of a large chord and
at its end.

    python bench/chord_counts.py [--quick] [--chord-size N]
                                 [--databases postgresql,mysql,sqlite] [--json PATH]

Also a section of ``bench/run.py`` (``--sections chord_counts``). Per database and kind of
header (a list, whose ids the counter row keeps; a generator, whose tasks Celery publishes
as they come, so each records its own id as it is counted), the result backend saves a
chord of N header tasks (default 5,000; quick 1,000) with its size, stores their results,
then counts them one after another as a worker does for a task acknowledged early (the
backend's ``on_chord_part_return``: a transaction per count, the last publishing the body
into the broker's queue in the same database). Figures: ms per count over the first 100
counts and the last 100 (the last one's body publication left out), and their ratio: a
count that reads or rewrites what grows with the chord costs more the further it gets.
Not a test: the figures depend on the machine and on whatever else runs on it.
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # run as a script: import the bench package, not its modules
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from celery import Celery
from celery.app.task import Context as Request
from celery.utils.functional import _regen
from kombu.utils.encoding import ensure_bytes
from sqlalchemy import Connection

import kombu_sqlinbox  # noqa: F401  (registers the sqlinbox+ URLs)
from bench.cli import run_alone
from bench.registry import Cell, Row, Section, goal, progress
from bench.report import table
from bench.targets import Context

NAME = "chord_counts"
FIGURES = {"first_ms": "first 100, ms/count", "last_ms": "last 100, ms/count",
           "ratio": "last / first"}
#: the counts each figure averages
WINDOW = 100
KINDS = ("list", "generator")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("chord_counts")
    group.add_argument("--chord-size", type=int, default=0,
                       help="header tasks per chord (default 5,000; quick 1,000)")


def make_app(ctx: Context, database: str) -> Celery:
    """An app whose broker and result backend are this run's tables on ``database``."""
    url = ctx.url(database, NAME)
    made = Celery(NAME, broker="sqlinbox+" + url, backend="sqlinbox+" + url,
                  set_as_current=False)
    made.conf.update(broker_transport_options={"table_prefix": ctx.prefix},
                     result_backend_transport_options={"table_prefix": ctx.prefix})
    return made


def store_results(backend: Any, ids: list[str]) -> None:
    """Every header task's result, in one transaction (what the last count reads)."""
    meta = ensure_bytes(backend.encode({"status": "SUCCESS", "result": 1, "traceback": None,
                                        "children": [], "task_id": "-"}))

    def work(conn: Connection) -> None:
        for task_id in ids:
            backend.store.write(task_id, "SUCCESS", meta, "bench.part", "w@h", conn)

    backend.store.database.run(work)


def count(app: Celery, kind: str, size: int) -> list[float]:
    """Seconds per count of a chord of ``size`` header tasks, in counting order."""
    backend = app.backend
    group_id = str(uuid.uuid4())
    ids = [str(uuid.uuid4()) for _ in range(size)]
    body = app.signature("bench.chord_body").freeze()
    results = _regen(iter(())) if kind == "generator" else [app.AsyncResult(i) for i in ids]
    backend.apply_chord((group_id, results), app.signature("bench.chord_body", task_id=body.id))
    backend.set_chord_size(group_id, size)
    store_results(backend, ids)
    chord = app.signature("bench.chord_body", task_id=body.id)
    took = []
    for index, task_id in enumerate(ids):
        request = Request(id=task_id, group=group_id, group_index=index, chord=chord)
        began = time.perf_counter()
        backend.on_chord_part_return(request, "SUCCESS", 1)
        took.append(time.perf_counter() - began)
    left = backend.store.database.run(lambda conn: conn.execute(
        backend.store.sql.chord_numbers, {"group_id": group_id}).first(), read_only=True)
    if left is not None:
        raise RuntimeError(f"chord {group_id}: its counts did not complete it ({left})")
    return took


def measure(ctx: Context, database: str, kind: str, size: int) -> dict[str, Cell]:
    app = make_app(ctx, database)
    try:
        took = count(app, kind, size)
    finally:
        app.close()
    first = sum(took[:WINDOW]) / WINDOW * 1000
    last = sum(took[-WINDOW - 1:-1]) / WINDOW * 1000  # the body's publication left out
    details = {"size": size, "total_s": sum(took)}
    return {"first_ms": Cell(first, f"{first:.2f}", details),
            "last_ms": Cell(last, f"{last:.2f}", details),
            "ratio": Cell(last / first, f"{last / first:.2f}", details)}


def run(args: argparse.Namespace) -> list[Row]:
    size = args.chord_size or (1_000 if args.quick else 5_000)
    found: list[Row] = []
    with Context() as ctx:
        for database in args.databases:
            for kind in KINDS:
                cells = measure(ctx, database, kind, size)
                setup = f"{kind} of {size:,}"
                found += [cell.row(NAME, database, setup, figure)
                          for figure, cell in cells.items()]
                progress(f"{NAME} {database} {setup}: " + ", ".join(
                    f"{FIGURES[figure]} {cell.text}" for figure, cell in cells.items()))
    return found


def markdown(rows: list[Row], args: argparse.Namespace) -> str:
    return (table(rows, FIGURES) + "\n\nOne header task's count (the result backend's "
            "on_chord_part_return, a transaction each) over the chord's first 100 counts "
            "and its last 100: a count costs the same at the end of a chord as at its start.")


def targets(rows: list[Row]) -> list[Row]:
    """A count does not grow with the chord: the last 100 cost at most twice the first."""
    return [goal(NAME, r["database"], f"{r['setup']}: last / first count",
                 r["value"], 2.0, at_most=True)
            for r in rows if r["figure"] == "ratio"]


SECTION = Section(NAME, "Chord counts: one header task's count, early and late in a chord",
                  add_arguments, run, markdown, targets)

if __name__ == "__main__":
    run_alone(SECTION)
