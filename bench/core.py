"""The core section: the sqlinbox transport beside kombu sqla, raw drivers, Redis, RabbitMQ.

Every registered scenario (publish, consume, latency, race, celery, raw) runs for every
broker it applies to, on every database; Redis and RabbitMQ are measured once.
"""

from __future__ import annotations

import argparse

from . import celery_bench, kombu_bench, raw  # noqa: F401  (scenarios register)
from .cli import choices
from .registry import SCENARIOS, Cell, Row, Section, columns, goal, progress, ratio
from .report import table
from .targets import BROKERS, SERVER_BROKERS, Context, Sizes, Target

NAME = "core"
RAW_DRIVERS = {"postgresql": "psycopg2", "mysql": "pymysql", "sqlite": "sqlite3"}
#: (what, (broker, column) over (broker, column), target): the ratios the section checks
RATIOS = (
    ("sqlinbox consume pf10 ÷ kombu sqla consume pf10", ("sqlinbox", "consume_10"),
     ("sqla", "consume_10"), 20.0),
    ("sqlinbox consume pf100 ÷ kombu sqla consume pf100", ("sqlinbox", "consume_100"),
     ("sqla", "consume_100"), 20.0),
    ("sqlinbox consume pf100 ÷ RabbitMQ consume pf100", ("sqlinbox", "consume_100"),
     ("rabbitmq", "consume_100"), 1.0),
    ("sqlinbox publish ÷ raw publish (1 row/commit)", ("sqlinbox", "publish"),
     ("raw", "publish"), 0.8),
    ("Celery prefork: sqlinbox ÷ Redis", ("sqlinbox", "celery_prefork"),
     ("redis", "celery_prefork"), 1.0),
    ("Celery prefork: sqlinbox ÷ RabbitMQ (the aim)", ("sqlinbox", "celery_prefork"),
     ("rabbitmq", "celery_prefork"), 1.0),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("core")
    group.add_argument("--brokers", default=list(BROKERS), type=choices(BROKERS),
                       help=f"default all: {','.join(BROKERS)}")
    group.add_argument("--only", default=list(SCENARIOS), type=choices(list(SCENARIOS)),
                       help=f"core scenarios (default all: {','.join(SCENARIOS)})")


def measure(target: Target, ctx: Context, only: list[str]) -> dict[str, Cell]:
    """Every chosen scenario that applies to ``target``: column -> figure."""
    cells: dict[str, Cell] = {}
    for scenario in sorted((SCENARIOS[name] for name in only), key=lambda s: s.rank):
        if target.broker not in scenario.brokers:
            continue
        try:
            found = scenario.run(target, ctx)
        except Exception as exc:  # one broker failing must not end the run
            found = dict.fromkeys(scenario.columns, Cell.failed(exc))
        cells.update(found)
        progress(f"{target.label} {scenario.name}: "
                 + ", ".join(f"{k}={c.text}" for k, c in found.items()))
    return cells


def run(args: argparse.Namespace) -> list[Row]:
    """A row per broker, database and column (``args``: ``quick``, ``databases``,
    ``brokers``, ``only``, ``pg_driver``)."""
    rows: list[Row] = []
    brokers = set(args.brokers)
    with Context(Sizes().quick() if args.quick else Sizes(), args.pg_driver) as ctx:
        targets = ctx.server_targets(brokers)
        for database in args.databases:
            targets += ctx.targets(database, brokers)
        for target in targets:
            for column, cell in measure(target, ctx, args.only).items():
                rows.append(cell.row(NAME, target.database, target.broker, column))
    return rows


def broker_label(broker: str, database: str | None) -> str:
    if broker == "raw":
        return f"raw {RAW_DRIVERS.get(database or '', 'driver')} ‡"
    if broker == "sqla":
        return "kombu sqla †"
    return broker + (" *" if broker in SERVER_BROKERS else "")


def markdown(rows: list[Row], args: argparse.Namespace) -> str:
    """Grouped by database, the message servers last (they do not depend on one)."""
    order = [*args.databases, None]
    shown = sorted(rows, key=lambda r: order.index(r["database"]))
    shown = [{**r, "setup": broker_label(r["setup"], r["database"])} for r in shown]
    sizes = Sizes().quick() if args.quick else Sizes()
    return "\n".join([
        table(shown, columns(), "broker"),
        "",
        f"Messages: publish {sizes.publish}, consume/race {sizes.consume}, Celery tasks "
        f"{sizes.tasks}, latency samples {sizes.latency}; each measurement capped at "
        f"{sizes.cap:.0f} s (a capped one shows received/expected).",
        "Consume: kombu Consumer, basic_qos(prefetch), acking callback, drain_events; first "
        "to last message. Racers: processes draining one queue (dup = delivered twice, lost = "
        "neither received nor left in the queue). Celery: from worker start until the last "
        "task ran (in brackets: first to last task).",
        "* message servers, measured once (database -). † kombu sqla gets a tenth of the "
        "consume/race/Celery message counts (it manages a few hundred msg/s at best). "
        "‡ raw driver loop of the transport's own SQL: publish and 'pf10' = one row per "
        "commit, 'pf100' = claim 100 + delete 100 + commit.",
    ])


def targets(rows: list[Row]) -> list[Row]:
    cells = {(r["database"], r["setup"], r["figure"]): Cell(r["value"], r["text"])
             for r in rows}
    databases = dict.fromkeys(r["database"] for r in rows if r["database"] is not None)

    def cell(database: str, broker: str, column: str) -> Cell | None:
        return cells.get((None if broker in SERVER_BROKERS else database, broker, column))

    found = []
    for database in databases:
        for what, (top_broker, top), (bottom_broker, bottom), limit in RATIOS:
            value = ratio(cell(database, top_broker, top), cell(database, bottom_broker, bottom))
            if value is not None:
                found.append(goal(NAME, database, what, value, limit))
    return found


SECTION = Section(NAME, "Transport: kombu level and Celery end to end",
                  add_arguments, run, markdown, targets)
