"""The latency section: idle publish -> receive, where PostgreSQL's time goes, idle cost.

* p50/p99 of one message at a time to an idle consumer process (a random gap of up to
  ``GAP`` s before each publish samples the poll phase), for sqlinbox on each database
  (with and without ``synchronous_commit=False`` on PostgreSQL), kombu sqla, Redis, Redis
  with ``appendfsync always`` (a redis-server of its own, started and stopped here) and
  RabbitMQ; and the same after ``IDLE_GAP`` s of idleness (polling backed off);
* the PostgreSQL breakdown: ``perf_counter_ns`` (one monotonic clock for both processes)
  at each step, from hooks this script puts on the transport's classes in its own
  processes (not in the package);
* what an idle sqlinbox consumer costs: statements per second it sends while idle,
  counted by SQLAlchemy's cursor events in the consumer process.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # run alone: the bench package, not its modules
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from kombu import Queue

from bench.children import Children, Link
from bench.cli import choices, run_alone
from bench.kombu_bench import body, declared_producer, drain
from bench.registry import Cell, Row, Section, goal, progress, spread
from bench.report import grid, table
from bench.targets import (
    AMQP_URL,
    POLLING_INTERVAL,
    REDIS_URL,
    Context,
    Target,
    connect,
    redis_always,
    scratch_queue,
)

NAME = "latency"
#: the longest random pause before each publish
GAP = 0.1
#: the pause before each publish of the "after idle" figure: long enough for any backoff
IDLE_GAP = 2.0
IDLE_SAMPLES = 8
#: seconds an idle consumer is watched for its statements
IDLE_WATCH = 6.0
SETUPS = ("sqlinbox", "sqlinbox sync off", "kombu sqla", "redis",
          "redis appendfsync always", "rabbitmq")
STEPS = (
    ("publish call -> INSERT sent", "pub0", "ins0"),
    ("INSERT + pg_notify statement", "ins0", "ins1"),
    ("COMMIT (WAL flush)", "ins1", "commit"),
    ("commit -> listener awake", "commit", "wake"),
    ("awake -> claim sent", "wake", "claim0"),
    ("claim statement(s)", "claim0", "claim1"),
    ("claimed -> consumer callback", "claim1", "callback"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("latency")
    group.add_argument("--latency-setups", default=list(SETUPS), type=choices(SETUPS),
                       help=f"default all: {','.join(SETUPS)}")
    group.add_argument("--latency-samples", type=int, default=0,
                       help="messages per figure (default 80; 30 with --quick)")


# -- one consumer process ----------------------------------------------------------------
def _hook(owner: Any, name: str, before: Callable[[], None] | None = None,
          after: Callable[[], None] | None = None) -> None:
    """Wrap ``owner.name`` so ``before``/``after`` run around it (this process only)."""
    original = getattr(owner, name)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if before is not None:
            before()
        try:
            return original(*args, **kwargs)
        finally:
            if after is not None:
                after()

    setattr(owner, name, wrapped)


def _instrument_consumer(stamps: dict[str, int]) -> None:
    """Stamp the consumer's wake-ups and claims (the last of each before a delivery)."""
    from kombu_sqlinbox.broker import Broker
    from kombu_sqlinbox.wakeups import Wakeup

    def stamp(key: str) -> Callable[[], None]:
        return lambda: stamps.__setitem__(key, time.perf_counter_ns())

    _hook(Wakeup, "take", before=stamp("wake"))
    _hook(Broker, "claim", before=stamp("claim0"), after=stamp("claim1"))


def _consumer(link: Link, target: Target, queue: Queue, expected: int, cap: float,
              instrument: bool) -> None:
    """Report each message's publish -> receive seconds (and the consumer's stamps)."""
    stamps: dict[str, int] = {}
    if instrument:
        _instrument_consumer(stamps)

    def report(payload: dict[str, Any], message: Any, now: float) -> None:
        stamps["callback"] = time.perf_counter_ns()
        link.report("got", (now - payload["sent"], dict(stamps)))
        stamps.clear()
        message.ack()

    with connect(target) as conn:
        drain(conn, queue, 1, lambda d: len(d.ids) >= expected, time.monotonic() + cap,
              handle=report, ready=lambda: link.report("ready"))
    link.report("done")


def _instrument_publisher(stamps: dict[str, int]) -> None:
    """Stamp the publisher's INSERT and the end of its commit (the driver's)."""
    from sqlalchemy.dialects.postgresql.psycopg2 import PGDialect_psycopg2

    from kombu_sqlinbox.dialects.base import Dialect

    def stamp(key: str) -> Callable[[], None]:
        return lambda: stamps.__setitem__(key, time.perf_counter_ns())

    def committed() -> None:
        if "ins1" in stamps:  # the publish's, not the declaration's
            stamps.setdefault("commit", time.perf_counter_ns())

    _hook(Dialect, "publish", before=stamp("ins0"), after=stamp("ins1"))
    _hook(PGDialect_psycopg2, "do_commit", after=committed)


def samples(target: Target, ctx: Context, count: int, gap: float, *,
            fixed_gap: bool = False, stamps: dict[str, int] | None = None,
            ) -> tuple[list[float], list[dict[str, int]]]:
    """``count`` messages, one at a time, to an idle consumer process: milliseconds each,
    and (with ``stamps``, which the publisher's hooks fill) each one's stamps."""
    found: list[float] = []
    steps: list[dict[str, int]] = []
    with scratch_queue(target, ctx.queue_name("lat")) as queue, connect(target) as conn:
        channel = conn.channel()
        producer = declared_producer(channel, queue)
        with Children(1, _consumer, target, queue, count, ctx.sizes.cap * 4 + 30,
                      stamps is not None) as child:
            child.wait_ready(time.monotonic() + 30)
            time.sleep(0.5)  # the consumer is in its wait
            deadline = time.monotonic() + ctx.sizes.cap * 4
            for i in range(count):
                time.sleep(gap if fixed_gap else random.uniform(0, gap))
                if stamps is not None:
                    stamps.clear()
                    stamps["pub0"] = time.perf_counter_ns()
                producer.publish(body(i), retry=False)
                _, _, (seconds, theirs) = child.next(min(deadline, time.monotonic() + 30))
                found.append(seconds * 1000)
                if stamps is not None:
                    steps.append({**stamps, **theirs})
                if time.monotonic() > deadline:
                    break
            child.next(time.monotonic() + 10)
        channel.close()
    return found, steps


# -- idle cost ------------------------------------------------------------------------
def _idle_consumer(link: Link, target: Target, queue: Queue, watch: float) -> None:
    """Consume an empty queue; report the statements sent during ``watch`` seconds."""
    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    sent = [0]

    @event.listens_for(Engine, "before_cursor_execute")
    def count(*args: Any) -> None:
        sent[0] += 1

    def stop(_: Any) -> bool:
        return False

    with connect(target) as conn:
        link.report("ready")
        with contextlib.suppress(Exception):
            drain(conn, queue, 1, stop, time.monotonic() + 1.5)  # settle, back off
        before = sent[0]
        started = time.monotonic()
        drain(conn, queue, 1, stop, started + watch)
        link.report("idle", (sent[0] - before) / (time.monotonic() - started))


def idle_cost(target: Target, ctx: Context) -> Cell:
    with scratch_queue(target, ctx.queue_name("idle")) as queue:
        with connect(target) as conn:
            queue(conn.default_channel).declare()
        with Children(1, _idle_consumer, target, queue, IDLE_WATCH) as child:
            child.wait_ready(time.monotonic() + 30)
            _, _, rate = child.next(time.monotonic() + IDLE_WATCH + 30)
    return Cell(rate, f"{rate:.1f}")


# -- the section --------------------------------------------------------------------------
def targets_for(ctx: Context, database: str | None, setups: list[str]) -> list[Target]:
    """The chosen setups on ``database`` (None: the message servers). sqlinbox runs with
    its defaults (polling included); kombu sqla polls every ``POLLING_INTERVAL``."""
    made: list[Target] = []
    if database is None:
        if "redis" in setups:
            made.append(Target("redis", None, REDIS_URL))
        if "rabbitmq" in setups:
            made.append(Target("rabbitmq", None, AMQP_URL))
        return made
    if "sqlinbox" in setups:
        made.append(Target("sqlinbox", database, "sqlinbox+" + ctx.url(database, "lat"),
                           {"table_prefix": ctx.prefix}))
    if "sqlinbox sync off" in setups and database == "postgresql":
        made.append(Target("sqlinbox sync off", database,
                           "sqlinbox+" + ctx.url(database, "lat"),
                           {"table_prefix": ctx.prefix, "synchronous_commit": False}))
    if "kombu sqla" in setups:
        made.append(Target("kombu sqla", database, "sqla+" + ctx.url(database, "sqla"),
                           {"queue_tablename": ctx.prefix + "kombu_queue",
                            "message_tablename": ctx.prefix + "kombu_message"},
                           POLLING_INTERVAL))
    return made


def measure(target: Target, ctx: Context, count: int) -> list[Row]:
    rows = []
    cells: dict[str, Callable[[], Cell]] = {
        "latency": lambda: spread(samples(target, ctx, count, GAP)[0]),
        "after_idle": lambda: spread(samples(target, ctx, IDLE_SAMPLES, IDLE_GAP,
                                             fixed_gap=True)[0]),
    }
    if target.broker == "sqlinbox":
        cells["idle"] = lambda: idle_cost(target, ctx)
    for figure, run in cells.items():
        try:
            cell = run()
        except Exception as exc:  # one setup failing must not end the run
            cell = Cell.failed(exc)
        progress(f"{target.label} {figure}: {cell.text}")
        rows.append(cell.row(NAME, target.database, target.broker, figure))
    return rows


def breakdown(ctx: Context, count: int) -> list[Row]:
    """The PostgreSQL steps of one publish -> receive (medians, ms)."""
    target = targets_for(ctx, "postgresql", ["sqlinbox"])[0]
    stamps: dict[str, int] = {}
    _instrument_publisher(stamps)
    totals, steps = samples(target, ctx, count, GAP, stamps=stamps)
    rows = []
    for what, start, end in (*STEPS, ("total (publish call -> callback)", "pub0", "callback")):
        spans = [(s[end] - s[start]) / 1e6 for s in steps if start in s and end in s]
        text = f"{statistics.median(spans):.2f}" if spans else "n/a"
        rows.append({"section": NAME, "database": "postgresql", "setup": "breakdown",
                     "figure": what, "value": statistics.median(spans) if spans else None,
                     "text": f"{text} ({len(spans)}/{len(steps)})"})
    rows.append(spread(totals, digits=2).row(NAME, "postgresql", "breakdown",
                                             "publish -> receive (payload clock)"))
    return rows


def run(args: argparse.Namespace) -> list[Row]:
    count = args.latency_samples or (30 if args.quick else 80)
    setups = args.latency_setups
    rows: list[Row] = []
    with Context() as ctx:
        for database in [*args.databases, None]:
            for target in targets_for(ctx, database, setups):
                rows += measure(target, ctx, count)
        if "redis appendfsync always" in setups:
            try:
                with redis_always() as url:
                    rows += measure(Target("redis appendfsync always", None, url), ctx, count)
            except Exception as exc:
                rows.append(Cell.failed(exc).row(NAME, None, "redis appendfsync always",
                                                 "latency"))
        if "postgresql" in args.databases and "sqlinbox" in setups:
            rows += breakdown(ctx, count)
    return rows


FIGURES = {"latency": f"p50 / p99 ms (gap 0-{GAP * 1000:.0f} ms)",
           "after_idle": f"p50 / p99 ms after {IDLE_GAP:.0f} s idle",
           "idle": "idle statements/s"}


def markdown(rows: list[Row], args: argparse.Namespace) -> str:
    measured = [r for r in rows if r["setup"] != "breakdown"]
    split = [r for r in rows if r["setup"] == "breakdown"]
    parts = [table(measured, FIGURES, "setup"), "",
             f"One message at a time to an idle consumer process (kombu Consumer, prefetch 1, "
             f"acking): a random pause of 0-{GAP * 1000:.0f} ms before each publish, or "
             f"{IDLE_GAP:.0f} s for the 'after idle' figure ({IDLE_SAMPLES} messages). "
             f"sqlinbox runs with its default options; kombu sqla polls every "
             f"{POLLING_INTERVAL} s. Idle statements/s: what an idle sqlinbox consumer "
             f"sends, counted in its process over {IDLE_WATCH:.0f} s."]
    if split:
        parts += ["", "PostgreSQL, one publish -> receive, median ms per step (samples "
                  "with that step / all):", "",
                  grid(["step", "ms"], [(r["figure"], r["text"]) for r in split])]
    return "\n".join(parts)


def targets(rows: list[Row]) -> list[Row]:
    cells = {(r["database"], r["setup"], r["figure"]): r["value"] for r in rows}
    redis = cells.get((None, "redis", "latency"))
    found = []
    for database in dict.fromkeys(r["database"] for r in rows if r["database"]):
        ours = cells.get((database, "sqlinbox", "latency"))
        if database == "postgresql":
            found.append(goal(NAME, database, "sqlinbox latency p50 ÷ Redis p50",
                              ours / redis if ours and redis else None, 2.0, at_most=True))
        else:
            found.append(goal(NAME, database, "sqlinbox latency p50 (ms)", ours, 10.0,
                              at_most=True))
    return found


SECTION = Section(NAME, "Latency: idle publish -> receive", add_arguments, run, markdown,
                  targets)

if __name__ == "__main__":
    run_alone(SECTION)
