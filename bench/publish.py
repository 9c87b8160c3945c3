"""Publish benchmark: one message per commit, a bound bulk publish, and Celery's apply_async,
beside the message servers at the durability of a committed row.

    python bench/publish.py [--quick] [--databases ...] [--publish-count N]
                            [--publish-rounds R] [--json PATH]

Also a section of ``bench/run.py``. Per database, alternating in rounds (each figure the
median of its rounds):

* single publish, msg/s: kombu ``Producer.publish`` on the sqlinbox transport, the raw
  driver loop of the same INSERT (``bench/raw.py``: one row per commit, same session
  setup), kombu sqla, kombu's ``memory://`` (kombu's own per-message cost), and the
  durable peers: RabbitMQ with persistent messages and publisher confirms
  (``confirm_publish``), and Redis with ``appendfsync always`` (a redis-server of its
  own, started and stopped here); Redis and RabbitMQ as configured, once;
* bulk, msg/s: 1,000 ``Producer.publish`` inside ``celery_ext.bind(conn)`` and the
  commit, against the raw driver sending one multi-row INSERT of 1,000 rows and its
  commit;
* Celery: ``apply_async`` of a task against ``Producer.publish`` of a body of the same
  size, through the app's producer pool, per broker, and what apply_async costs beyond
  that publish (µs per call: on ``memory://``, Celery's and kombu's own work alone).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # run as a script: import the bench package, not its modules
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from kombu import Producer
from kombu.serialization import dumps
from sqlalchemy import Engine

import celery_ext
from bench.celery_app import TASK, make_app
from bench.cli import run_alone
from bench.kombu_bench import body, declared_producer
from bench.raw import RawQueue
from bench.registry import Cell, Row, Section, alternate, goal, progress, ratio
from bench.report import table
from bench.targets import (
    AMQP_URL,
    REDIS_URL,
    Context,
    Target,
    connect,
    kombu_queue,
    redis_always,
)
from kombu_sqlinbox.database import engine_for
from kombu_sqlinbox.tables import table_name_for_queue

NAME = "publish"
BULK = 1000
FIGURES = {
    "publish": "publish msg/s",
    "bulk": f"bulk {BULK:,} msg/s",
    "apply_async": "apply_async/s",
    "producer": "Producer.publish/s (same app)",
    "celery_ratio": "apply_async ÷ publish",
    "celery_cost": "apply_async beyond publish µs",
}
MEMORY = Target("memory", None, "memory://")
#: RabbitMQ at a committed row's durability: persistent messages (kombu's and Celery's
#: default delivery mode, to durable queues), each publish waiting for the broker's confirm
CONFIRMS = Target("rabbitmq confirms", None, AMQP_URL, {"confirm_publish": True})
#: Redis at a committed row's durability: its own server, fsync on every write
ALWAYS = "redis always"
#: the port of that server (the latency section's is another: both may run at once)
ALWAYS_PORT = 6391
SERVERS = (Target("redis", None, REDIS_URL), Target("rabbitmq", None, AMQP_URL), MEMORY)
#: (what, (setup, figure) over (setup, figure), target)
RATIOS = (
    ("sqlinbox publish ÷ raw publish (1 row/commit)", ("sqlinbox", "publish"),
     ("raw", "publish"), 0.8),
    ("sqlinbox publish ÷ memory:// publish", ("sqlinbox", "publish"), ("memory", "publish"),
     None),
    (f"sqlinbox bulk ÷ raw multi-row INSERT ({BULK:,} rows)", ("sqlinbox", "bulk"),
     ("raw", "bulk"), 0.8),
    ("sqlinbox bulk ÷ memory:// publish (kombu's own per-message cost)",
     ("sqlinbox", "bulk"), ("memory", "publish"), None),
    ("sqlinbox apply_async ÷ Producer.publish", ("sqlinbox", "apply_async"),
     ("sqlinbox", "producer"), 0.8),
    ("sqlinbox publish ÷ RabbitMQ publish (persistent, confirms)", ("sqlinbox", "publish"),
     (CONFIRMS.broker, "publish"), 1.0),
    ("sqlinbox publish ÷ Redis publish (appendfsync always)", ("sqlinbox", "publish"),
     (ALWAYS, "publish"), 1.0),
)
#: the ratio each database is held to: SQLite's against kombu's own ceiling
TARGET_OF = {"sqlite": {"sqlinbox publish ÷ memory:// publish": 0.8,
                        "sqlinbox publish ÷ raw publish (1 row/commit)": None}}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("publish")
    group.add_argument("--publish-count", type=int, default=0,
                       help="messages per mode and round (default 1000, quick 200)")
    group.add_argument("--publish-rounds", type=int, default=0,
                       help="rounds (default 5, quick 3)")


def rate(count: int, seconds: float) -> float:
    return count / seconds


def producer_rate(producer: Producer, count: int) -> float:
    payload = body(0)
    started = time.perf_counter()
    for _ in range(count):
        producer.publish(payload, retry=False)
    return rate(count, time.perf_counter() - started)


def raw_rate(raw: RawQueue, count: int) -> float:
    return rate(count, raw.publish(count, 1))


def publisher(target: Target, ctx: Context, count: int,
              closers: list[Callable[[], Any]]) -> Callable[[], float]:
    """A measurement of ``target``'s publish rate; what it opened goes on ``closers``."""
    if target.broker == "raw":
        raw = RawQueue(target, table_name_for_queue(ctx.queue_name("raw"), ctx.prefix))
        closers.append(raw.close)
        return partial(raw_rate, raw, count)
    conn = connect(target)
    closers.append(conn.release)
    queue = kombu_queue(ctx.queue_name("pub"))
    channel = conn.channel()
    closers.append(partial(queue(channel).delete))
    producer = declared_producer(channel, queue)
    return partial(producer_rate, producer, ctx.count(target, count))


def single(targets: dict[str, Target], ctx: Context, count: int, rounds: int) -> dict[str, Cell]:
    """Publish msg/s of each target, alternating; kombu sqla gets a tenth of the count."""
    modes: dict[str, Callable[[], float]] = {}
    closers: list[Callable[[], Any]] = []
    failed: dict[str, Cell] = {}
    try:
        for name, target in targets.items():
            try:
                modes[name] = publisher(target, ctx, count, closers)
                modes[name]()  # warm pools, caches and prepared statements
            except Exception as exc:  # one broker failing spoils only its own figure
                modes.pop(name, None)
                failed[name] = Cell.failed(exc)
        return {**alternate(modes, rounds, lambda v: f"{v:,.0f}"), **failed}
    finally:
        for close in reversed(closers):
            try:
                close()
            except Exception as exc:  # cleanup must not hide the figures
                progress(f"cleanup: {exc}")


def bound_bulk(target: Target, engine: Engine, producer: Producer) -> float:
    """``BULK`` publishes inside ``bind(conn)``, then the commit: msg/s."""
    payload = body(0)
    started = time.perf_counter()
    with engine.connect() as conn, conn.begin(), celery_ext.bind(conn):
        for _ in range(BULK):
            producer.publish(payload, retry=False)
    return rate(BULK, time.perf_counter() - started)


def bulk(database: str, ctx: Context, rounds: int) -> dict[str, Cell]:
    target = ctx.sqlinbox(database, "bulk")
    raw = RawQueue(ctx.targets(database, {"raw"})[0],
                   table_name_for_queue(ctx.queue_name("rawbulk"), ctx.prefix))
    engine, _ = engine_for(target.url[len("sqlinbox+"):])
    conn = connect(target)
    queue = kombu_queue(ctx.queue_name("bulk"))
    channel = conn.channel()
    try:
        producer = declared_producer(channel, queue)
        modes: dict[str, Callable[[], float]] = {
            "sqlinbox": partial(bound_bulk, target, engine, producer),
            "raw": lambda: rate(BULK, raw.publish_bulk(BULK))}
        for measure in modes.values():
            measure()
        return alternate(modes, rounds, lambda v: f"{v:,.0f}")
    finally:
        queue(channel).delete()
        conn.release()
        engine.dispose()
        raw.close()


def celery(target: Target, ctx: Context, count: int, rounds: int) -> dict[str, Cell]:
    """apply_async/s against Producer.publish/s of the task body's size, one app."""
    queue = ctx.queue_name("celery")
    app = make_app(target.url, target.transport_options, queue, target.polling_interval)
    task = app.tasks[TASK]
    key = f"bench:{ctx.run_id}:{queue}"
    args = (key, count)

    def apply_async() -> float:
        started = time.perf_counter()
        for _ in range(count):
            task.apply_async(args)
        return rate(count, time.perf_counter() - started)

    def publish() -> float:
        with app.producer_or_acquire() as producer:
            task_body = app.amqp.as_task_v2("0" * 36, TASK, args=args).body
            payload = "x" * len(dumps(task_body, serializer="json")[2])
            exchange, routing_key = app.amqp.queues[queue].exchange, queue
            started = time.perf_counter()
            for _ in range(count):
                producer.publish(payload, exchange=exchange, routing_key=routing_key,
                                 serializer="json", retry=False)
            return rate(count, time.perf_counter() - started)

    try:
        apply_async()  # declares the queue, fills the pools
        cells = alternate({"apply_async": apply_async, "producer": publish}, rounds,
                          lambda v: f"{v:,.0f}")
        applied, published = cells["apply_async"].value, cells["producer"].value
        if applied and published:
            cells["celery_ratio"] = Cell(applied / published, f"{applied / published:.2f}")
            cost = 1e6 / applied - 1e6 / published
            cells["celery_cost"] = Cell(cost, f"{cost:,.0f}")
        return cells
    finally:
        with app.connection_for_write() as conn:
            conn.default_channel.queue_delete(queue)
        app.close()


def failing_alone(measure: Callable[[], dict[str, Cell]],
                  keys: tuple[str, ...]) -> dict[str, Cell]:
    """``measure``'s figures; when it fails, each of ``keys`` reports the failure and the
    section goes on."""
    try:
        return measure()
    except Exception as exc:
        return dict.fromkeys(keys, Cell.failed(exc))


def run(args: argparse.Namespace) -> list[Row]:
    count = args.publish_count or (200 if args.quick else 1000)
    rounds = args.publish_rounds or (3 if args.quick else 5)
    rows: list[Row] = []

    def add(database: str | None, setup: str, cells: dict[str, Cell], figure: str) -> None:
        cell = cells[setup]
        rows.append(cell.row(NAME, database, setup, figure))
        progress(f"{NAME} {database or '-'} {setup} {figure}: {cell.text}")

    with Context(pg_driver=args.pg_driver) as ctx, contextlib.ExitStack() as stack:
        # the durable peers, measured beside every database (and with the servers)
        peers = {CONFIRMS.broker: CONFIRMS}
        unavailable: dict[str, Cell] = {}
        try:
            peers[ALWAYS] = Target(ALWAYS, None, stack.enter_context(redis_always(ALWAYS_PORT)))
        except Exception as exc:  # no redis-server here, or its port taken
            unavailable[ALWAYS] = Cell.failed(exc)
        servers = {**{t.broker: t for t in SERVERS}, **peers}
        for name, cell in {**single(servers, ctx, count, rounds), **unavailable}.items():
            add(None, name, {name: cell}, "publish")
        for target in servers.values():
            for figure, cell in failing_alone(partial(celery, target, ctx, count, rounds),
                                              ("apply_async", "producer")).items():
                add(None, target.broker, {target.broker: cell}, figure)
        for database in args.databases:
            targets = {t.broker: t for t in ctx.targets(database, {"sqlinbox", "raw", "sqla"})}
            targets.update({MEMORY.broker: MEMORY, **peers})
            for name, cell in {**single(targets, ctx, count, rounds), **unavailable}.items():
                add(database, name, {name: cell}, "publish")
            for name, cell in failing_alone(partial(bulk, database, ctx, rounds),
                                            ("sqlinbox", "raw")).items():
                add(database, name, {name: cell}, "bulk")
            sqlinbox = ctx.sqlinbox(database, "celery")
            for figure, cell in failing_alone(partial(celery, sqlinbox, ctx, count, rounds),
                                              ("apply_async", "producer")).items():
                add(database, "sqlinbox", {"sqlinbox": cell}, figure)
    return rows


def label(setup: str, database: str | None) -> str:
    return {"raw": "raw driver ‡", "sqla": "kombu sqla †", "memory": "memory:// *",
            CONFIRMS.broker: "rabbitmq persistent + confirms §",
            ALWAYS: "redis appendfsync always §"}.get(
        setup, setup + (" *" if database is None else ""))


def markdown(rows: list[Row], args: argparse.Namespace) -> str:
    order = [None, *args.databases]
    shown = sorted(rows, key=lambda r: order.index(r["database"]))
    shown = [{**r, "setup": label(r["setup"], r["database"])} for r in shown]
    count = args.publish_count or (200 if args.quick else 1000)
    rounds = args.publish_rounds or (3 if args.quick else 5)
    return "\n".join([
        table(shown, FIGURES, "broker"),
        "",
        f"{count} messages per mode and round, median of {rounds} rounds (modes alternate "
        "within a database). * kombu's in-process transport and the message servers "
        "(database -); memory:// is measured again beside each database. † a tenth of the "
        f"messages. ‡ the transport's INSERT through the bare driver: one row per commit; "
        f"bulk: one INSERT of {BULK:,} rows and its commit. sqlinbox bulk: {BULK:,} "
        "Producer.publish inside celery_ext.bind(conn), and the commit. § the durable "
        "peers, measured again beside each database: RabbitMQ with persistent messages "
        "and publisher confirms (confirm_publish), Redis with appendfsync always (a "
        "redis-server of the benchmark's own). apply_async: a task of two arguments; "
        "Producer.publish: a JSON body of the task body's size; apply_async beyond publish: "
        "what apply_async costs beyond that publish, µs per call (on memory://, Celery's "
        "and kombu's own work). "
        f"PostgreSQL: sqlinbox and kombu sqla through {args.pg_driver}, the raw loop "
        "through psycopg2.",
    ])


def targets(rows: list[Row]) -> list[Row]:
    cells = {(r["database"], r["setup"], r["figure"]): Cell(r["value"], r["text"])
             for r in rows}
    found = []
    for database in dict.fromkeys(r["database"] for r in rows):
        if database is None:
            continue
        for what, (top, top_figure), (bottom, bottom_figure), limit in RATIOS:
            limit = TARGET_OF.get(database, {}).get(what, limit)
            value = ratio(cells.get((database, top, top_figure)),
                          cells.get((database, bottom, bottom_figure)))
            if value is not None:
                found.append(goal(NAME, database, what, value, limit))
    for server in ("redis", "rabbitmq", CONFIRMS.broker, ALWAYS, MEMORY.broker):
        value = ratio(cells.get((None, server, "apply_async")),
                      cells.get((None, server, "producer")))
        if value is not None:
            found.append(goal(NAME, None, f"{server} apply_async ÷ Producer.publish", value,
                              None))
    return found


SECTION = Section(NAME, "Publish: single, bulk, and Celery's apply_async",
                  add_arguments, run, markdown, targets)

if __name__ == "__main__":
    run_alone(SECTION)
