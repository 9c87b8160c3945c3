"""Outbox benchmark: what recording costs per ``apply_async``, and how fast republish sends.

    python bench/outbox.py [--quick] [--outbox-tasks N] [--outbox-rounds R] [--json PATH]

Also a section of ``bench/run.py``. The outbox database is PostgreSQL (psycopg 3) and
the broker RabbitMQ (``BENCH_POSTGRES_URL``, ``BENCH_AMQP_URL`` override the local
defaults).

Rounds alternate outbox off / on / on inside a caller transaction, so load from other
processes on the machine spreads over all three; each figure is the median of the
rounds. Overhead is median(on) - median(off), per task, outside a caller transaction.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # run as a script: import the bench package, not its modules
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from celery import Celery

import celery_ext
from bench.cli import run_alone
from bench.registry import Cell, Row, Section, alternate, goal, progress
from bench.report import table
from bench.targets import AMQP_URL, Context
from celery_ext.outbox import engine_from_url

NAME = "outbox"
FIGURES = {"per_task_ms": "ms per task (median)", "records_per_s": "records/s"}
OVERHEAD = "overhead: on - off"
#: the overhead target: recording may add at most this much per task (ms)
TARGET_MS = 1.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("outbox")
    group.add_argument("--outbox-tasks", type=int, default=0,
                       help="tasks per mode and round (default 500, quick 100)")
    group.add_argument("--outbox-rounds", type=int, default=0,
                       help="rounds (default 9, quick 5)")


def noop(*args: Any) -> None:
    """The benchmarked task; nothing consumes it."""


def _app(queue: str) -> Celery:
    app = Celery("outbox-bench", broker=AMQP_URL, set_as_current=False)
    app.conf.update(task_default_queue=queue, task_ignore_result=True)
    app.task(name="bench.noop")(noop)
    return app


def per_task_ms(send: Callable[[], Any], tasks: int) -> float:
    began = time.perf_counter()
    for _ in range(tasks):
        send()
    return (time.perf_counter() - began) * 1000.0 / tasks


def measure(ctx: Context, tasks: int, rounds: int) -> list[Row]:
    queue = ctx.queue_name("outbox")
    plain, tracked = _app(queue), _app(queue)
    engine = engine_from_url(ctx.url("postgresql", "outbox"))
    outbox = celery_ext.install(tracked, engine, table=f"{ctx.prefix}outbox")
    noop_plain, noop_tracked = plain.tasks["bench.noop"], tracked.tasks["bench.noop"]

    def in_transaction() -> None:
        with engine.begin() as conn, celery_ext.bind(conn):
            noop_tracked.apply_async((1,))

    sends: dict[str, Callable[[], Any]] = {
        "RabbitMQ, outbox off": lambda: noop_plain.apply_async((1,)),
        "RabbitMQ, outbox on": lambda: noop_tracked.apply_async((1,)),
        "RabbitMQ, outbox on, in caller transaction": in_transaction,
    }
    try:
        outbox.create()
        for send in sends.values():  # warm connections, pools and prepared statements
            per_task_ms(send, 50)
        cells = alternate({mode: partial(per_task_ms, send, tasks)
                           for mode, send in sends.items()}, rounds, lambda v: f"{v:.3f}")
        for cell in cells.values():
            cell.details.update(tasks=tasks, rounds=rounds)
        off, on = (cells[f"RabbitMQ, outbox {m}"].value for m in ("off", "on"))
        if off is not None and on is not None:
            cells[OVERHEAD] = Cell(on - off, f"{on - off:.3f}")
        rows = [cell.row(NAME, "postgresql", mode, "per_task_ms") for mode, cell in cells.items()]
        pending = outbox.status().unprocessed
        began = time.perf_counter()
        sent = outbox.republish(older_than=0).sent
        republished = Cell.rate(sent, time.perf_counter() - began, unprocessed_before=pending)
        rows.append(republished.row(NAME, "postgresql", "republish (RabbitMQ)", "records_per_s"))
        return rows
    finally:
        outbox.drop()
        outbox.uninstall()
        with plain.connection_for_write() as conn:
            conn.default_channel.queue_delete(queue)
        plain.close()
        tracked.close()
        engine.dispose()


def run(args: argparse.Namespace) -> list[Row]:
    """Rows per outbox mode, the overhead, republish (``args``: ``quick``, ``outbox_tasks``,
    ``outbox_rounds``)."""
    tasks = args.outbox_tasks or (100 if args.quick else 500)
    rounds = args.outbox_rounds or (5 if args.quick else 9)
    with Context(pg_driver="psycopg") as ctx:
        rows = measure(ctx, tasks, rounds)
    for r in rows:
        progress(f"{NAME} {r['setup']}: {r['text']}")
    return rows


def markdown(rows: list[Row], args: argparse.Namespace) -> str:
    details = rows[0]["details"]
    return (table(rows, FIGURES) + f"\n\n`apply_async` of a no-op task, {details.get('tasks')} "
            f"per mode and round, median of {details.get('rounds')} rounds (modes alternate); "
            "republish: every record left unprocessed (nothing consumes the queue).")


def targets(rows: list[Row]) -> list[Row]:
    found = [r["value"] for r in rows if r["setup"] == OVERHEAD]
    if not found:
        return []
    return [goal(NAME, "postgresql", "outbox overhead, ms per task (outside a transaction)",
                 found[0], TARGET_MS, at_most=True)]


SECTION = Section(NAME, "Transactional outbox: apply_async overhead and republish",
                  add_arguments, run, markdown, targets)

if __name__ == "__main__":
    run_alone(SECTION)
