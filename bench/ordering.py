"""Ordering benchmark: FIFO groups, partition keys and wake-up latency.

    python bench/ordering.py [--quick] [--databases postgresql,mysql,sqlite]
                             [--ordering fifo,partition,latency] [--json PATH]

* FIFO throughput: rows spread over 1, 10 and 1,000 FIFO groups, drained by two
  consumer processes of four threads each (acks from the threads, as Celery's
  threads pool does); beside it the same drain of a plain table.
* Partition-key throughput: rows of 10 keys, one consumer process of four threads:
  a key's next row waits in the process until the previous one is acked.
* Latency: publish -> delivery on an idle consumer process (kombu level, the
  timestamp travels in the message): PostgreSQL with NOTIFY, PostgreSQL polling
  only, Redis, RabbitMQ. The target is PostgreSQL NOTIFY p50 within 2x of Redis.

Also a section of ``bench/run.py``. Not a test: the figures depend on the machine and
whatever else runs on it.
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # run as a script: import the bench package, not its modules
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from kombu import Queue

from bench.children import Children, Link
from bench.cli import choices, run_alone
from bench.kombu_bench import drain, latency, publish_many
from bench.registry import Cell, Row, Section, goal, progress, ratio
from bench.report import table
from bench.targets import Context, Sizes, Target, connect, scratch_queue
from kombu_sqlinbox import TableBuilder, TableSpec

NAME = "ordering"
FIFO_GROUPS = (1, 10, 1000)
PARTITION_KEYS = 10
THREADS = 4
MEASURES = ("fifo", "partition", "latency")
FIGURES = {"msg/s": "msg/s", "latency": "p50 / p99 ms"}
NOTIFY, REDIS = "latency: sqlinbox NOTIFY", "latency: redis"
#: the wake-up target: PostgreSQL NOTIFY p50 at most this times Redis p50
LATENCY_TARGET = 2.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("ordering")
    group.add_argument("--ordering", default=list(MEASURES), type=choices(MEASURES),
                       help=f"default all: {','.join(MEASURES)}")


def inbox_table(name: str, kind: str) -> TableSpec:
    """A queue table ``name`` with a FIFO group (``fifo``) or a partition key (``keyed``)
    column; its messages fill it from their ``group_key`` / ``partition_key`` header."""
    builder = TableBuilder(name).id().payload().headers()
    if kind == "fifo":
        builder.group("grp", fifo=True)
    else:
        builder.partition_key("pkey")
    return builder.priority().available_at().locked_until().attempt().build()


# -- throughput: consumer processes with a thread pool each ---------------------------------
def _pool_consumer(link: Link, target: Target, queue: Queue, expected: int, cap: float) -> None:
    """A spawned consumer: each message goes to a thread, which acks it (no work)."""
    def finish(message: Any) -> None:
        message.ack()
        link.add()

    deadline = time.monotonic() + cap
    with connect(target) as conn, ThreadPoolExecutor(THREADS) as pool:
        def hand_over(payload: dict[str, Any], message: Any, now: float) -> None:
            pool.submit(finish, message)

        drain(conn, queue, THREADS * 2, lambda _: link.counter.value >= expected, deadline,
              handle=hand_over, ready=lambda: link.ready(cap))
    link.report("done")


def drain_rate(target: Target, queue: Queue, count: int, processes: int, cap: float) -> Cell:
    """Start ``processes`` pool consumers together; messages acked per second until all
    ``count`` were acked or ``cap`` seconds passed (then the rate of what was acked)."""
    with Children(processes, _pool_consumer, target, queue, count, cap) as children:
        children.wait_ready(time.monotonic() + 60)
        began = time.monotonic()
        children.start.set()
        while children.counter.value < count and time.monotonic() - began < cap:
            if children.any_exited():
                children.next(time.monotonic() + 1)  # raises if the child failed
            time.sleep(0.005)
        seconds = time.monotonic() - began
        done = children.counter.value
    cell = Cell.rate(done, seconds, expected=count, processes=processes, threads=THREADS)
    if done < count:
        cell.text += f" ({done}/{count} in cap)"
    return cell


def keyed_drain(ctx: Context, database: str, tag: str, kind: str | None, keys: int,
                count: int, processes: int) -> Cell:
    """Publish ``count`` rows, row i with group or partition key ``i % keys`` (``kind``
    ``fifo`` or ``keyed``; None: a plain table), and drain them."""
    name = ctx.queue_name(tag)
    options: dict[str, Any] = {}
    if kind is not None:
        options["queues"] = {name: {"table": inbox_table(f"{ctx.prefix}{name}", kind)}}
    target = ctx.sqlinbox(database, "ordering", **options)
    header = {"fifo": "group_key", "keyed": "partition_key"}.get(kind or "")
    with scratch_queue(target, name) as queue:
        with connect(target) as conn:
            publish_many(conn, queue, range(count),
                         (lambda i: {header: f"key{i % keys}"}) if header else None)
        return drain_rate(target, queue, count, processes, ctx.sizes.cap)


def fifo_rows(ctx: Context, database: str) -> list[Row]:
    count = ctx.sizes.consume // 2
    setups: list[tuple[str, str, str | None, int]] = [
        ("FIFO: plain table (no group)", "plain", None, 1)]
    setups += [(f"FIFO: {n} group{'s' * (n > 1)}", f"fifo{n}", "fifo", n) for n in FIFO_GROUPS]
    return [keyed_drain(ctx, database, tag, kind, keys, count, 2).row(
        NAME, database, setup, "msg/s") for setup, tag, kind, keys in setups]


def partition_rows(ctx: Context, database: str) -> list[Row]:
    count = ctx.sizes.consume // 2
    setups = [(f"partition: {PARTITION_KEYS} keys", "keyed", "keyed", PARTITION_KEYS),
              ("partition: plain table (no key)", "keyedplain", None, 1)]
    return [keyed_drain(ctx, database, tag, kind, keys, count, 1).row(
        NAME, database, setup, "msg/s") for setup, tag, kind, keys in setups]


# -- latency -------------------------------------------------------------------------------
def latency_rows(ctx: Context, databases: list[str]) -> list[Row]:
    """kombu_bench's latency scenario on an idle consumer process, per broker."""
    targets = []
    if "postgresql" in databases:
        targets += [(NOTIFY, ctx.sqlinbox("postgresql")),
                    ("latency: sqlinbox polling only", ctx.sqlinbox("postgresql", notify=False))]
    targets += [(f"latency: {t.broker}", t) for t in ctx.server_targets({"redis", "rabbitmq"})]
    found = []
    for setup, target in targets:
        try:
            cell = latency(target, ctx)["latency"]
        except Exception as exc:  # one broker failing must not end the run
            cell = Cell.failed(exc)
        found.append(cell.row(NAME, target.database, setup, "latency"))
        progress(f"{NAME} {setup}: {cell.text}")
    return found


# -- section -------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> list[Row]:
    """Every figure of this module for ``args`` (``quick``, ``databases``, ``ordering``)."""
    rows: list[Row] = []
    with Context(Sizes().quick() if args.quick else Sizes()) as ctx:
        for measure in args.ordering:
            if measure == "latency":
                rows += latency_rows(ctx, args.databases)
                continue
            measure_rows = fifo_rows if measure == "fifo" else partition_rows
            for database in args.databases:
                try:
                    found = measure_rows(ctx, database)
                except Exception as exc:  # a database that is down spoils only its own rows
                    found = [Cell.failed(exc).row(NAME, database, f"{measure}: all", "msg/s")]
                for r in found:
                    progress(f"{NAME} {database} {r['setup']}: {r['text']}")
                rows += found
    return rows


def markdown(rows: list[Row], args: argparse.Namespace) -> str:
    sizes = Sizes().quick() if args.quick else Sizes()
    return "\n".join([
        table(rows, FIGURES),
        "",
        f"FIFO: {sizes.consume // 2} rows, 2 consumer processes x {THREADS} threads (acks from "
        f"the threads); partition: {sizes.consume // 2} rows, 1 process x {THREADS} threads; "
        f"each drain capped at {sizes.cap:.0f} s. Latency: publish -> delivery on an idle "
        f"consumer process, {sizes.latency} samples.",
    ])


def targets(rows: list[Row]) -> list[Row]:
    cells = {r["setup"]: Cell(r["value"], r["text"]) for r in rows if r["figure"] == "latency"}
    value = ratio(cells.get(NOTIFY), cells.get(REDIS))
    if value is None:
        return []
    return [goal(NAME, "postgresql", "NOTIFY latency p50 ÷ Redis p50", value, LATENCY_TARGET,
                 at_most=True)]


SECTION = Section(NAME, "Ordering: FIFO groups, partition keys, wake-up latency",
                  add_arguments, run, markdown, targets)

if __name__ == "__main__":
    run_alone(SECTION)
