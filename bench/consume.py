"""Consume against RabbitMQ, alternating: the kombu consumer's rate at prefetch 10 and 100.

    python bench/consume.py [--quick] [--databases ...] [--consume-rounds R]
                            [--pg-driver psycopg2|psycopg] [--json PATH]

Also a section of ``bench/run.py``. The core section measures each broker once, one
after the other; on a machine whose speed drifts within minutes that puts the broker
measured in a fast minute ahead. Here, per database and prefetch, this transport and
RabbitMQ take turns for R rounds, and each figure is the median of its rounds, as is the
ratio of each round's pair. Each round publishes the consume count of the core section
(5,000, quick 1,000), then drains it with a kombu Consumer acking every message. With
``--consume-counting`` the transport takes turns with itself with its throughput
counting off (``count_throughput``) instead of with RabbitMQ: what counting costs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from functools import partial
from pathlib import Path

if __name__ == "__main__":  # run as a script: import the bench package, not its modules
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from bench.cli import run_alone
from bench.kombu_bench import consume
from bench.registry import Cell, Row, Section, alternate, goal
from bench.report import table
from bench.targets import Context, Sizes, Target

NAME = "consume"
PREFETCHES = (10, 100)
#: this transport's consume rate ÷ RabbitMQ's, at each prefetch
TARGETS = {10: 1.0, 100: 2.0}
FIGURES = {f"consume_{p}": f"consume pf{p} msg/s (median)" for p in PREFETCHES} | {
    f"ratio_{p}": f"pf{p} ÷ RabbitMQ, per round (median)" for p in PREFETCHES}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(NAME)
    group.add_argument("--consume-rounds", type=int, default=0,
                       help="rounds per database and prefetch (default 5, quick 3)")
    group.add_argument("--consume-counting", action="store_true",
                       help="alternate with this transport's throughput counting off "
                            "instead of RabbitMQ")


def run(args: argparse.Namespace) -> list[Row]:
    rounds = args.consume_rounds or (3 if args.quick else 5)
    rows: list[Row] = []
    driver = str(args.pg_driver)
    with Context(Sizes().quick() if args.quick else Sizes(), driver) as ctx:
        (rabbitmq,) = ctx.server_targets({"rabbitmq"})
        for database in args.databases:
            ours = ctx.sqlinbox(database)
            other, against = (("counting off", ctx.sqlinbox(database, count_throughput=False))
                              if args.consume_counting else ("rabbitmq", rabbitmq))
            for prefetch in PREFETCHES:
                cells = alternate({"sqlinbox": partial(rate, ours, ctx, prefetch),
                                   other: partial(rate, against, ctx, prefetch)},
                                  rounds, lambda v: f"{v:,.0f}")
                for setup, cell in cells.items():
                    rows.append(cell.row(NAME, database, setup, f"consume_{prefetch}"))
                pairs = zip(cells["sqlinbox"].details.get("rounds", []),
                            cells[other].details.get("rounds", []), strict=False)
                ratios = [ours_rate / theirs for ours_rate, theirs in pairs]
                if ratios:
                    median = statistics.median(ratios)
                    text = f"{median:.2f} ({', '.join(f'{r:.2f}' for r in ratios)})"
                    setup = "sqlinbox" if other == "rabbitmq" else f"sqlinbox ÷ {other}"
                    rows.append(Cell(median, text, {"rounds": ratios}).row(
                        NAME, database, setup, f"ratio_{prefetch}"))
    return rows


def rate(target: Target, ctx: Context, prefetch: int) -> float:
    """One consume measurement's msg/s (one that received too little raises)."""
    cell = consume(target, ctx, prefetch)
    if cell.value is None:
        raise RuntimeError(cell.text)
    return float(cell.value)


def markdown(rows: list[Row], args: argparse.Namespace) -> str:
    rounds = args.consume_rounds or (3 if args.quick else 5)
    sizes = Sizes().quick() if args.quick else Sizes()
    other = "itself with throughput counting off" if args.consume_counting else "RabbitMQ"
    return "\n".join([
        table(rows, {key: label.replace("RabbitMQ", "counting off")
                     for key, label in FIGURES.items()} if args.consume_counting else FIGURES,
              "broker"),
        "",
        f"{rounds} rounds per database and prefetch, this transport and {other} in turn; "
        f"each round publishes {sizes.consume:,} messages, then a kombu Consumer drains "
        "them, acking each (first to last message). PostgreSQL through "
        f"{args.pg_driver}. The ratio column: each round's pair, "
        "their median first.",
    ])


def targets(rows: list[Row]) -> list[Row]:
    return [goal(NAME, r["database"], f"sqlinbox consume pf{p} ÷ RabbitMQ, paired rounds",
                 r["value"], TARGETS[p])
            for r in rows for p in PREFETCHES
            if r["figure"] == f"ratio_{p}" and r["setup"] == "sqlinbox"]


SECTION = Section(NAME, "Consume against RabbitMQ, alternating", add_arguments, run,
                  markdown, targets)

if __name__ == "__main__":
    run_alone(SECTION)
