"""Transient queue layout: one shared table against a table per queue.

    python bench/layout.py [--quick] [--layout-calls N] [--layout-rounds R] [--json PATH]

Also a section of ``bench/run.py``. What one ``celery inspect`` call costs the broker
for its reply queue: declare and bind it, publish the reply through the direct
exchange, take it, delete the queue. "shared table" is the layout the transport uses
for transient queues (a registry row, a binding row, one message row); "table per
queue" is the same queue declared durable, so it gets a table of its own (CREATE TABLE
and its index, DROP TABLE). Rounds alternate the two; each figure is the median.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

if __name__ == "__main__":  # run as a script: import the bench package, not its modules
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from kombu import Connection, Exchange, Queue

import kombu_sqlinbox  # noqa: F401  (registers the sqlinbox alias)
from bench.cli import run_alone
from bench.registry import Row, Section, alternate, goal, progress
from bench.report import table
from bench.targets import Context

NAME = "layout"
FIGURES = {"per_call_ms": "ms per reply queue (median)"}
SHARED, OWN = "shared table", "table per queue"
DATABASES = ("postgresql", "mysql", "sqlite")
REPLIES = Exchange("bench.reply", type="direct", durable=False)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("layout")
    group.add_argument("--layout-calls", type=int, default=0,
                       help="reply queues per mode and round (default 50, quick 10)")
    group.add_argument("--layout-rounds", type=int, default=0,
                       help="rounds (default 7, quick 3)")


def lifecycle(conn: Connection, calls: int, durable: bool) -> Callable[[], float]:
    """Milliseconds per reply queue: declare, bind, reply, take, delete."""
    counter = iter(range(10**9))

    def measure() -> float:
        channel = conn.default_channel
        producer = conn.Producer()
        began = time.perf_counter()
        for _ in range(calls):
            n = next(counter)
            queue = Queue(f"r{n}.{'own' if durable else 'shared'}", REPLIES,
                          routing_key=f"k{n}", durable=durable, auto_delete=not durable)
            queue(channel).declare()
            producer.publish({"pong": n}, exchange=REPLIES, routing_key=f"k{n}",
                             declare=[REPLIES])
            message = channel.basic_get(queue.name, no_ack=True)
            assert message is not None, "the reply did not arrive"
            channel.queue_delete(queue.name)
        return (time.perf_counter() - began) * 1000 / calls

    return measure


def run(args: argparse.Namespace) -> list[Row]:
    calls = args.layout_calls or (10 if args.quick else 50)
    rounds = args.layout_rounds or (3 if args.quick else 7)
    rows: list[Row] = []
    with Context() as ctx:
        for database in DATABASES:
            url = "sqlinbox+" + ctx.url(database, "layout")
            with Connection(url, transport_options={"table_prefix": ctx.prefix}) as conn:
                cells = alternate({SHARED: lifecycle(conn, calls, durable=False),
                                   OWN: lifecycle(conn, calls, durable=True)}, rounds,
                                  lambda ms: f"{ms:.2f}")
            for mode, cell in cells.items():
                cell.details.update(calls=calls, rounds=rounds)
                rows.append(cell.row(NAME, database, mode, "per_call_ms"))
                progress(f"{NAME} {database} {mode}: {cell.text} ms")
    return rows


def markdown(rows: list[Row], args: argparse.Namespace) -> str:
    details = rows[0]["details"] if rows else {}
    return (table(rows, FIGURES) + f"\n\n{details.get('calls')} reply queues per mode and "
            f"round, median of {details.get('rounds')} rounds (modes alternate).")


def targets(rows: list[Row]) -> list[Row]:
    """The shared table must cost less per reply queue than a table of its own."""
    found = []
    for database in DATABASES:
        figures = {r["setup"]: r["value"] for r in rows if r["database"] == database}
        if figures.get(SHARED) and figures.get(OWN):
            found.append(goal(NAME, database, "table per queue ÷ shared table, per reply queue",
                              figures[OWN] / figures[SHARED], 1.0))
    return found


SECTION = Section(NAME, "Transient queue layout: a reply queue's life", add_arguments, run,
                  markdown, targets)

if __name__ == "__main__":
    run_alone(SECTION)
