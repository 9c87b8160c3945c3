"""Ordering benchmark: FIFO groups, partition keys and wake-up latency (issue 3).

    python bench/ordering.py [--quick] [--databases postgresql,mysql,sqlite]
                             [--only fifo,partition,latency] [--json PATH]

* FIFO throughput: rows spread over 1, 10 and 1,000 FIFO groups, drained by two
  consumer processes of four threads each (acks from the threads, as Celery's
  threads pool does); beside it the same drain of a plain table.
* Partition-key throughput: rows of 10 keys, one consumer process of four threads:
  a key's next row waits in the process until the previous one is acked.
* Latency: publish -> delivery on an idle consumer process (kombu level, the
  timestamp travels in the message): PostgreSQL with NOTIFY, PostgreSQL polling
  only, Redis, RabbitMQ. The target is PostgreSQL NOTIFY p50 within 2x of Redis.

``run(args)`` returns one dict per figure, so ``bench/run.py`` can show them;
run alone, this prints a Markdown table. Not a test: the figures depend on the
machine and whatever else runs on it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import queue as stdlib_queue
import sys
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # run as a script: import the bench package, not its modules
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from kombu import Consumer, Producer, Queue

from bench.kombu_bench import body, latency
from bench.registry import Cell
from bench.targets import (
    DATABASES,
    POLLING_INTERVAL,
    SERVERS,
    Context,
    Sizes,
    Target,
    connect,
    delete_queue,
    kombu_queue,
)
from kombu_sqlinbox import TableBuilder, TableSpec

SPAWN = multiprocessing.get_context("spawn")
FIFO_GROUPS = (1, 10, 1000)
PARTITION_KEYS = 10
THREADS = 4
#: (name, what the row shows) of the measurements, in run order
MEASURES = {"fifo": "FIFO group throughput", "partition": "partition-key throughput",
            "latency": "publish -> delivery latency"}
#: the target issue 3 sets: PostgreSQL NOTIFY p50 at most this times Redis p50
LATENCY_TARGET = 2.0

Row = dict[str, Any]


def inbox_table(ctx: Context, tag: str, kind: str) -> TableSpec:
    """A queue table with a FIFO group (``fifo``) or a partition key (``keyed``) column."""
    builder = TableBuilder(f"{ctx.prefix}{tag}").id().payload().headers()
    if kind == "fifo":
        builder.group("grp", fifo=True)
    else:
        builder.partition_key("pkey")
    return builder.priority().available_at().locked_until().attempt().build()


def sqlinbox_target(ctx: Context, database: str, **options: Any) -> Target:
    url = SERVERS.get(database) or ctx.sqlite_url("ordering")
    return Target("sqlinbox", database, "sqlinbox+" + url,
                  {"table_prefix": ctx.prefix, "polling_interval": POLLING_INTERVAL, **options},
                  POLLING_INTERVAL)


# -- throughput: consumer processes with a thread pool each ---------------------------------
def _pool_consumer(target: Target, queue: Queue, threads: int, counter: Any, expected: int,
                   start: Any, reports: Any, cap: float) -> None:
    """A spawned consumer: each message goes to a thread, which acks it (no work)."""
    try:
        with connect(target) as conn, ThreadPoolExecutor(threads) as pool:
            def finish(message: Any) -> None:
                message.ack()
                with counter.get_lock():
                    counter.value += 1

            def on_message(_: Any, message: Any) -> None:
                pool.submit(finish, message)

            channel = conn.channel()
            consumer = Consumer(channel, [queue], callbacks=[on_message], accept=["json"])
            consumer.qos(prefetch_count=threads * 2)
            reports.put(("ready", None))
            start.wait(cap)
            consumer.consume()
            deadline = time.monotonic() + cap
            while counter.value < expected and time.monotonic() < deadline:
                with contextlib.suppress(TimeoutError):
                    conn.drain_events(timeout=0.2)
            consumer.cancel()
            channel.close()
        reports.put(("done", None))
    except Exception:
        reports.put(("error", traceback.format_exc(limit=4)))


def drain_rate(target: Target, queue: Queue, count: int, processes: int, cap: float) -> Cell:
    """Start ``processes`` pool consumers together; messages acked per second until all
    ``count`` were acked or ``cap`` seconds passed (then the rate of what was acked)."""
    reports: Any = SPAWN.Queue()
    start, counter = SPAWN.Event(), SPAWN.Value("i", 0)
    children = [SPAWN.Process(target=_pool_consumer, args=(
        target, queue, THREADS, counter, count, start, reports, cap)) for _ in range(processes)]
    for child in children:
        child.start()
    try:
        for _ in children:
            expect_report(reports, "ready", 60)
        began = time.monotonic()
        start.set()
        while counter.value < count and time.monotonic() - began < cap:
            if any(not child.is_alive() for child in children):
                expect_report(reports, "done", 1)
            time.sleep(0.005)
        seconds = time.monotonic() - began
        done = counter.value
    finally:
        start.set()
        for child in children:
            child.join(cap + 15)
            if child.is_alive():
                child.terminate()
                child.join(5)
    cell = Cell.rate(done, seconds, expected=count, processes=processes, threads=THREADS)
    if done < count:
        cell.text += f" ({done}/{count} in cap)"
    return cell


def expect_report(reports: Any, kind: str, timeout: float) -> None:
    try:
        got, value = reports.get(timeout=timeout)
    except stdlib_queue.Empty:
        raise TimeoutError(f"no {kind!r} report from a consumer in {timeout:.0f} s") from None
    if got == "error":
        raise RuntimeError(f"consumer failed: {value.strip().splitlines()[-1]}")
    if got != kind:
        raise RuntimeError(f"expected {kind!r} from a consumer, got {got!r}")


def keyed_drain(ctx: Context, database: str, tag: str, kind: str | None, keys: int,
                count: int, processes: int) -> Cell:
    """Publish ``count`` rows, row i with group or partition key ``i % keys`` (``kind``
    ``fifo`` or ``keyed``; None: a plain table), and drain them."""
    queue = kombu_queue(ctx.queue_name(tag))
    options: dict[str, Any] = {}
    if kind is not None:
        options["queues"] = {queue.name: {"table": inbox_table(ctx, queue.name, kind)}}
    target = sqlinbox_target(ctx, database, **options)
    header = {"fifo": "group_key", "keyed": "partition_key"}.get(kind or "")
    try:
        with connect(target) as conn:
            channel = conn.channel()
            queue(channel).declare()
            producer = Producer(channel, exchange=queue.exchange, routing_key=queue.routing_key,
                                serializer="json")
            for i in range(count):
                headers = {header: f"key{i % keys}"} if header else {}
                producer.publish(body(i), headers=headers, retry=False)
            channel.close()
        return drain_rate(target, queue, count, processes, ctx.sizes.cap)
    finally:
        delete_queue(target, queue.name)


def fifo_rows(ctx: Context, database: str) -> list[Row]:
    count = ctx.sizes.consume // 2
    found = [row("fifo", database, "plain table (no group)", "msg/s",
                 keyed_drain(ctx, database, "plain", None, 1, count, 2))]
    for groups in FIFO_GROUPS:
        cell = keyed_drain(ctx, database, f"fifo{groups}", "fifo", groups, count, 2)
        found.append(row("fifo", database, f"{groups} group{'s' * (groups > 1)}", "msg/s", cell))
    return found


def partition_rows(ctx: Context, database: str) -> list[Row]:
    count = ctx.sizes.consume // 2
    cell = keyed_drain(ctx, database, "keyed", "keyed", PARTITION_KEYS, count, 1)
    plain = keyed_drain(ctx, database, "keyedplain", None, 1, count, 1)
    return [row("partition", database, f"{PARTITION_KEYS} keys", "msg/s", cell),
            row("partition", database, "plain table (no key)", "msg/s", plain)]


# -- latency -------------------------------------------------------------------------------
def latency_rows(ctx: Context, databases: list[str]) -> list[Row]:
    """kombu_bench's latency scenario on an idle consumer process, per broker."""
    targets = []
    if "postgresql" in databases:
        targets += [("sqlinbox@postgresql NOTIFY", sqlinbox_target(ctx, "postgresql")),
                    ("sqlinbox@postgresql polling only",
                     sqlinbox_target(ctx, "postgresql", notify=False))]
    targets += [(target.broker, target) for target in ctx.server_targets({"redis", "rabbitmq"})]
    found = []
    for label, target in targets:
        try:
            cell = latency(target, ctx)["latency"]
        except Exception as exc:  # one broker failing must not end the run
            cell = Cell.failed(exc)
        found.append(row("latency", target.database, label, "ms p50 / p99", cell))
    by_label = {r["setup"]: r["value"] for r in found}
    notify, redis = by_label.get("sqlinbox@postgresql NOTIFY"), by_label.get("redis")
    if notify and redis:
        ratio = notify / redis
        found.append({"measure": MEASURES["latency"], "database": "postgresql",
                      "setup": "target: NOTIFY p50 / Redis p50", "unit": "ratio", "value": ratio,
                      "text": f"{ratio:.2f} (<= {LATENCY_TARGET:g}: "
                              f"{'met' if ratio <= LATENCY_TARGET else 'not met'})",
                      "details": {}})
    return found


def row(measure: str, database: str | None, setup: str, unit: str, cell: Cell) -> Row:
    return {"measure": MEASURES[measure], "database": database, "setup": setup, "unit": unit,
            "value": cell.value, "text": cell.text, "details": cell.details}


# -- entry points --------------------------------------------------------------------------
def run(args: argparse.Namespace) -> list[Row]:
    """Every figure of this module for ``args`` (``quick``, ``databases``, ``only``; missing
    attributes take their defaults, so ``bench/run.py``'s arguments serve)."""
    sizes = Sizes().quick() if getattr(args, "quick", False) else Sizes()
    databases = list(getattr(args, "databases", None) or DATABASES)
    only = [m for m in (getattr(args, "ordering", None) or MEASURES) if m in MEASURES]
    ctx = Context(sizes)
    rows: list[Row] = []
    began = time.monotonic()
    try:
        for measure in only:
            if measure == "latency":
                found = latency_rows(ctx, databases)
            else:
                measure_rows = fifo_rows if measure == "fifo" else partition_rows
                found = [r for database in databases for r in guarded_rows(
                    measure, database, measure_rows, ctx)]
            for r in found:
                print(f"[{time.monotonic() - began:6.1f}s] {r['measure']} "
                      f"{r['database'] or ''} {r['setup']}: {r['text']}", file=sys.stderr)
            rows += found
    finally:
        from kombu_sqlinbox.broker import close_all

        close_all()
        ctx.cleanup()
    return rows


def guarded_rows(measure: str, database: str,
                 measure_rows: Callable[[Context, str], list[Row]], ctx: Context) -> list[Row]:
    try:
        return measure_rows(ctx, database)
    except Exception as exc:  # a database that is down spoils only its own rows
        return [row(measure, database, "all", "", Cell.failed(exc))]


def markdown(rows: list[Row]) -> str:
    lines = ["| measure | database | setup | value |", "|---|---|---|---:|"]
    lines += [f"| {r['measure']} | {r['database'] or '-'} | {r['setup']} | {r['text']} "
              f"{r['unit'] if r['value'] is not None and r['unit'] != 'ratio' else ''} |"
              for r in rows]
    return "\n".join(lines)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="about a fifth of the messages")
    parser.add_argument("--databases", default=",".join(DATABASES),
                        type=lambda v: [d for d in v.split(",") if d])
    parser.add_argument("--only", dest="ordering", default=",".join(MEASURES),
                        type=lambda v: [m for m in v.split(",") if m],
                        help=f"measurements: {', '.join(MEASURES)}")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse(argv)
    rows = run(args)
    print(markdown(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
