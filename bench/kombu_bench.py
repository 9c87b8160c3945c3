"""kombu-level measurements: publish, consume at a prefetch, latency, racing consumers.

Child processes are started with ``spawn`` so none inherits the parent's pooled
connections or its lease-keeper thread.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import queue as stdlib_queue
import random
import statistics
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from kombu import Connection, Consumer, Producer, Queue

from .registry import Cell, gist, guarded, scenario
from .targets import Context, Target, connect, delete_queue, kombu_queue

KOMBU_BROKERS = {"sqlinbox", "sqla", "redis", "rabbitmq"}
RACE_PREFETCH = 10
SPAWN = multiprocessing.get_context("spawn")


def body(i: int) -> dict[str, Any]:
    """A small message like a Celery task's arguments; ``i`` identifies it."""
    return {"i": i, "sent": time.time(), "args": [i, "bench"], "kwargs": {"note": "x" * 48}}


def publish_many(conn: Connection, queue: Queue, ids: range) -> float:
    """Publish one message per id; returns the seconds it took (declaration excluded)."""
    channel = conn.channel()
    try:
        queue(channel).declare()
        producer = Producer(channel, exchange=queue.exchange, routing_key=queue.routing_key,
                            serializer="json")
        started = time.perf_counter()
        for i in ids:
            producer.publish(body(i), retry=False)
        return time.perf_counter() - started
    finally:
        channel.close()


@dataclass
class Drained:
    """What one consumer received: message ids in order, first and last receive times."""

    ids: list[int] = field(default_factory=list)
    first: float = 0.0
    last: float = 0.0
    settled: float = 0.0


def drain(
    conn: Connection, queue: Queue, prefetch: int, stop: Callable[[Drained], bool],
    deadline: float, *, on_body: Callable[[dict[str, Any], float], None] | None = None,
    ready: Callable[[], None] | None = None,
) -> Drained:
    """Consume with ``basic_qos(prefetch)`` and an acking callback until ``stop`` or deadline.

    ``ready`` runs after the queue is declared and before consuming starts, so a parent
    can line several consumers up on one start signal.
    """
    got = Drained()

    def on_message(payload: dict[str, Any], message: Any) -> None:
        now = time.time()
        if not got.ids:
            got.first = now
        got.ids.append(payload["i"])
        got.last = now
        if on_body is not None:
            on_body(payload, now)
        message.ack()

    channel = conn.channel()
    consumer = Consumer(channel, [queue], callbacks=[on_message], accept=["json"])
    consumer.qos(prefetch_count=prefetch)
    if ready is not None:
        ready()
    consumer.consume()
    try:
        while not stop(got) and time.monotonic() < deadline:
            with contextlib.suppress(TimeoutError):
                conn.drain_events(timeout=min(0.5, max(0.01, deadline - time.monotonic())))
    finally:
        consumer.cancel()
        channel.close()
        got.settled = time.time()
    return got


def remaining(target: Target, queue: Queue) -> int:
    """Messages still ready in the queue (Redis forgets a queue once it is empty)."""
    with connect(target) as conn:
        try:
            return int(queue(conn.default_channel).queue_declare(passive=True).message_count)
        except conn.channel_errors:
            return 0


# -- publish and consume ------------------------------------------------------------------
@scenario("publish", {"publish": "publish msg/s"}, KOMBU_BROKERS, rank=10)
def publish(target: Target, ctx: Context) -> dict[str, Cell]:
    queue = kombu_queue(ctx.queue_name("pub"))
    count = ctx.sizes.publish
    try:
        with connect(target) as conn:
            seconds = publish_many(conn, queue, range(count))
    finally:
        delete_queue(target, queue.name)
    return {"publish": Cell.rate(count, seconds)}


def consume(target: Target, ctx: Context, prefetch: int) -> Cell:
    queue = kombu_queue(ctx.queue_name(f"con{prefetch}"))
    count = ctx.count(target, ctx.sizes.consume)
    try:
        with connect(target) as conn:
            publish_many(conn, queue, range(count))
            got = drain(conn, queue, prefetch, lambda d: len(d.ids) >= count, ctx.deadline())
    finally:
        delete_queue(target, queue.name)
    if len(got.ids) < 2:
        raise RuntimeError(f"received {len(got.ids)} of {count} messages")
    note = "" if len(got.ids) == count else f" ({len(got.ids)}/{count} in cap)"
    cell = Cell.rate(len(got.ids) - 1, got.last - got.first, expected=count,
                     until_settled=round(got.settled - got.first, 4))
    cell.text += note
    return cell


@scenario("consume", {"consume_10": "consume pf10", "consume_100": "consume pf100"},
          KOMBU_BROKERS, rank=20)
def consume_both(target: Target, ctx: Context) -> dict[str, Cell]:
    return {f"consume_{p}": guarded(partial(consume, target, ctx, p)) for p in (10, 100)}


# -- child processes ------------------------------------------------------------------------
def _child(role: str, target: Target, queue: Queue, index: int, reports: Any,
           start: Any, counter: Any, expected: int, cap: float) -> None:
    """Entry point of a spawned consumer; talks to the parent only through ``reports``."""
    try:
        deadline = time.monotonic() + cap
        with connect(target) as conn:
            if role == "latency":
                def on_body(payload: dict[str, Any], now: float) -> None:
                    reports.put(("got", index, now - payload["sent"]))

                drain(conn, queue, 1, lambda d: len(d.ids) >= expected, deadline,
                      on_body=on_body, ready=lambda: reports.put(("ready", index, None)))
                reports.put(("done", index, None))
                return

            def counted(payload: dict[str, Any], now: float) -> None:
                with counter.get_lock():
                    counter.value += 1

            def ready() -> None:
                reports.put(("ready", index, None))
                start.wait(cap)

            got = drain(conn, queue, RACE_PREFETCH, lambda d: counter.value >= expected,
                        deadline, on_body=counted, ready=ready)
            reports.put(("done", index, (got.ids, got.first, got.last)))
    except Exception:
        reports.put(("error", index, traceback.format_exc(limit=3)))


class Children:
    """Spawned consumer processes and their report queue; always reaped on exit."""

    def __init__(self, count: int, role: str, target: Target, queue: Queue, expected: int,
                 cap: float) -> None:
        self.reports: Any = SPAWN.Queue()
        self.start = SPAWN.Event()
        self.counter = SPAWN.Value("i", 0)
        self.processes = [
            SPAWN.Process(target=_child, args=(
                role, target, queue, i, self.reports, self.start, self.counter, expected, cap))
            for i in range(count)
        ]

    def __enter__(self) -> Children:
        for process in self.processes:
            process.start()
        return self

    def __exit__(self, *exc: object) -> None:
        for process in self.processes:
            process.join(10)
            if process.is_alive():
                process.terminate()
                process.join(5)

    def next(self, deadline: float) -> tuple[str, int, Any]:
        """The next report; a child's error or the deadline raises."""
        try:
            kind, index, value = self.reports.get(timeout=max(0.01, deadline - time.monotonic()))
        except stdlib_queue.Empty:
            raise TimeoutError("consumer processes did not report in time") from None
        if kind == "error":
            raise RuntimeError(f"consumer {index} failed: {gist(value)}")
        return kind, index, value

    def wait_ready(self, deadline: float) -> None:
        for _ in self.processes:
            kind, _, _ = self.next(deadline)
            assert kind == "ready", kind


# -- latency ----------------------------------------------------------------------------
@scenario("latency", {"latency": "latency p50/p99 ms"}, KOMBU_BROKERS, rank=30)
def latency(target: Target, ctx: Context) -> dict[str, Cell]:
    """One message at a time to an idle consumer process; random gaps sample the poll phase."""
    queue = kombu_queue(ctx.queue_name("lat"))
    samples = ctx.sizes.latency
    gap = target.polling_interval or 0.01
    found: list[float] = []
    try:
        with connect(target) as conn:
            channel = conn.channel()
            queue(channel).declare()
            producer = Producer(channel, exchange=queue.exchange, routing_key=queue.routing_key,
                                serializer="json")
            with Children(1, "latency", target, queue, samples, ctx.sizes.cap + 30) as child:
                child.wait_ready(time.monotonic() + 30)
                deadline = ctx.deadline()
                for i in range(samples):
                    time.sleep(random.uniform(0, gap))
                    producer.publish(body(i), retry=False)
                    _, _, seconds = child.next(min(deadline, time.monotonic() + 10))
                    found.append(seconds * 1000)
                    if time.monotonic() > deadline:
                        break
                child.next(time.monotonic() + 10)
            channel.close()
    finally:
        delete_queue(target, queue.name)
    found.sort()
    p50 = statistics.median(found)
    p99 = found[min(len(found) - 1, round(0.99 * (len(found) - 1)))]
    return {"latency": Cell(p50, f"{p50:.1f} / {p99:.1f}", {"p99": p99, "samples": len(found)})}


# -- racing consumers ---------------------------------------------------------------------
def race(target: Target, ctx: Context, racers: int) -> Cell:
    """``racers`` processes drain one queue; the parent checks every id arrived exactly once."""
    queue = kombu_queue(ctx.queue_name(f"race{racers}"))
    count = ctx.count(target, ctx.sizes.consume)
    try:
        with connect(target) as conn:
            publish_many(conn, queue, range(count))
        with Children(racers, "race", target, queue, count, ctx.sizes.cap + 10) as children:
            children.wait_ready(time.monotonic() + 60)
            started = time.time()
            children.start.set()
            results: list[tuple[list[int], float, float]] = []
            deadline = ctx.deadline() + 15
            while len(results) < racers:
                kind, _, value = children.next(deadline)
                if kind == "done":
                    results.append(value)
        left = remaining(target, queue)
    finally:
        delete_queue(target, queue.name)
    received = [i for ids, _, _ in results for i in ids]
    unique = set(received)
    last = max(last for ids, _, last in results if ids) if received else started
    duplicates = len(received) - len(unique)
    lost = count - len(unique) - left
    cell = Cell.rate(len(unique), last - started, duplicates=duplicates, lost=lost,
                     left_in_queue=left, expected=count,
                     per_consumer=[len(ids) for ids, _, _ in results])
    cell.text += f" (dup {duplicates}, lost {lost}" + (f", {left} left)" if left else ")")
    return cell


@scenario("race", {f"race_{n}": f"{n} racers pf{RACE_PREFETCH}" for n in (2, 4)},
          KOMBU_BROKERS, rank=40)
def race_both(target: Target, ctx: Context) -> dict[str, Cell]:
    return {f"race_{n}": guarded(partial(race, target, ctx, n)) for n in (2, 4)}
