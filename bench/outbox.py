"""Outbox benchmark: what recording costs per ``apply_async``, and how fast republish sends.

    python bench/outbox.py [--quick] [--tasks N] [--rounds R]

``run(args)`` returns rows for ``bench/run.py`` (any object with an optional ``quick``
attribute will do). The outbox database is PostgreSQL and the broker RabbitMQ
(``SQLINBOX_TEST_POSTGRES``, ``SQLINBOX_BENCH_AMQP`` override the local defaults).

Rounds alternate outbox off / on / on inside a caller transaction, so load from other
processes on the machine spreads over all three; each figure is the median of the
rounds. Overhead is median(on) - median(off), per task, outside a caller transaction.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from celery import Celery
from sqlalchemy import Engine

import celery_ext
from celery_ext.outbox import Outbox, engine_from_url

POSTGRES = os.environ.get("SQLINBOX_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/test")
AMQP = os.environ.get("SQLINBOX_BENCH_AMQP", "amqp://guest:guest@127.0.0.1:5672//")
#: the figure issue 5 sets: recording may add at most this much per task (ms)
TARGET_MS = 1.0


def noop(*args: Any) -> None:
    """The benchmarked task; nothing consumes it."""


def _app(queue: str) -> Celery:
    app = Celery("outbox-bench", broker=AMQP, set_as_current=False)
    app.conf.update(task_default_queue=queue, task_ignore_result=True)
    app.task(name="bench.noop")(noop)
    return app


def _per_task_ms(send: Callable[[], Any], tasks: int) -> float:
    began = time.perf_counter()
    for _ in range(tasks):
        send()
    return (time.perf_counter() - began) * 1000.0 / tasks


def _purge(app: Celery, queue: str) -> None:
    with app.connection_for_write() as conn:
        conn.default_channel.queue_delete(queue)


def measure(tasks: int, rounds: int) -> list[dict[str, Any]]:
    queue = f"outbox_bench_{uuid.uuid4().hex[:8]}"
    table = f"outbox_bench_{uuid.uuid4().hex[:8]}"
    plain, tracked = _app(queue), _app(queue)
    engine: Engine = engine_from_url(POSTGRES)
    outbox: Outbox = celery_ext.install(tracked, engine, table=table)
    noop_plain, noop_tracked = plain.tasks["bench.noop"], tracked.tasks["bench.noop"]

    def in_transaction() -> None:
        with engine.begin() as conn, celery_ext.bind(conn):
            noop_tracked.apply_async((1,))

    modes: dict[str, Callable[[], Any]] = {
        "off": lambda: noop_plain.apply_async((1,)),
        "on": lambda: noop_tracked.apply_async((1,)),
        "on, in caller transaction": in_transaction,
    }
    try:
        outbox.create()
        for send in modes.values():  # warm connections, pools and prepared statements
            _per_task_ms(send, 50)
        times: dict[str, list[float]] = {mode: [] for mode in modes}
        for _ in range(rounds):
            for mode, send in modes.items():
                times[mode].append(_per_task_ms(send, tasks))
        rows: list[dict[str, Any]] = [
            {"scenario": "outbox apply_async", "database": "postgresql", "broker": "rabbitmq",
             "outbox": mode, "tasks": tasks * rounds,
             "per_task_ms": round(statistics.median(found), 3),
             "best_round_ms": round(min(found), 3)}
            for mode, found in times.items()]
        overhead = statistics.median(times["on"]) - statistics.median(times["off"])
        rows.append({"scenario": "outbox overhead", "database": "postgresql",
                     "broker": "rabbitmq", "overhead_ms": round(overhead, 3),
                     "target_ms": TARGET_MS, "met": overhead <= TARGET_MS})
        pending = outbox.status().unprocessed
        began = time.perf_counter()
        sent = outbox.republish(older_than=0)
        elapsed = time.perf_counter() - began
        rows.append({"scenario": "outbox republish", "database": "postgresql",
                     "broker": "rabbitmq", "records": sent, "unprocessed_before": pending,
                     "records_per_s": round(sent / elapsed) if elapsed else None})
        return rows
    finally:
        outbox.drop()
        outbox.uninstall()
        _purge(plain, queue)
        plain.close()
        tracked.close()
        engine.dispose()


def run(args: Any) -> list[dict[str, Any]]:
    """Rows for bench/run.py; ``args.quick`` (optional) runs about a fifth of the tasks."""
    quick = bool(getattr(args, "quick", False))
    tasks = int(getattr(args, "outbox_tasks", 0) or (100 if quick else 500))
    rounds = int(getattr(args, "outbox_rounds", 0) or (5 if quick else 9))
    return measure(tasks, rounds)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--tasks", dest="outbox_tasks", type=int, default=0,
                        help="tasks per mode and round")
    parser.add_argument("--rounds", dest="outbox_rounds", type=int, default=0)
    rows = run(parser.parse_args(argv))
    for row in rows:
        print("  ".join(f"{key}={value}" for key, value in row.items()))
    overhead = next(r for r in rows if r["scenario"] == "outbox overhead")
    return 0 if overhead["met"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
