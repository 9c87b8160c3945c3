"""kombu-level measurements: publish, consume at a prefetch, latency, racing consumers."""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from kombu import Connection, Consumer, Producer, Queue

from .children import Children, Link
from .registry import Cell, guarded, scenario, spread
from .targets import Context, Target, connect, scratch_queue

KOMBU_BROKERS = {"sqlinbox", "sqla", "redis", "rabbitmq"}
RACE_PREFETCH = 10
#: what a consumer does with a message it received: by default, ack it
Handler = Callable[[dict[str, Any], Any, float], None]


def body(i: int) -> dict[str, Any]:
    """A small message like a Celery task's arguments; ``i`` identifies it."""
    return {"i": i, "sent": time.time(), "args": [i, "bench"], "kwargs": {"note": "x" * 48}}


def declared_producer(channel: Any, queue: Queue) -> Producer:
    """A JSON producer routing to ``queue``, declared on ``channel``."""
    queue(channel).declare()
    return Producer(channel, exchange=queue.exchange, routing_key=queue.routing_key,
                    serializer="json")


def publish_many(conn: Connection, queue: Queue, ids: range,
                 headers: Callable[[int], dict[str, Any]] | None = None) -> float:
    """Publish one message per id (with ``headers(id)``); returns the seconds it took
    (declaration excluded)."""
    channel = conn.channel()
    try:
        producer = declared_producer(channel, queue)
        started = time.perf_counter()
        for i in ids:
            producer.publish(body(i), headers=headers(i) if headers else None, retry=False)
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


def ack(payload: dict[str, Any], message: Any, now: float) -> None:
    message.ack()


def drain(
    conn: Connection, queue: Queue, prefetch: int, stop: Callable[[Drained], bool],
    deadline: float, *, handle: Handler = ack, ready: Callable[[], None] | None = None,
) -> Drained:
    """Consume with ``basic_qos(prefetch)`` until ``stop`` or deadline; ``handle`` settles
    each message.

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
        handle(payload, message, now)

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
    count = ctx.sizes.publish
    with scratch_queue(target, ctx.queue_name("pub")) as queue, connect(target) as conn:
        seconds = publish_many(conn, queue, range(count))
    return {"publish": Cell.rate(count, seconds)}


def consume(target: Target, ctx: Context, prefetch: int) -> Cell:
    count = ctx.count(target, ctx.sizes.consume)
    with (scratch_queue(target, ctx.queue_name(f"con{prefetch}")) as queue,
          connect(target) as conn):
        publish_many(conn, queue, range(count))
        got = drain(conn, queue, prefetch, lambda d: len(d.ids) >= count, ctx.deadline())
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


# -- latency ----------------------------------------------------------------------------
def _latency_consumer(link: Link, target: Target, queue: Queue, expected: int,
                      cap: float) -> None:
    """A spawned consumer reporting each message's publish -> receive seconds."""
    def report(payload: dict[str, Any], message: Any, now: float) -> None:
        link.report("got", now - payload["sent"])
        message.ack()

    with connect(target) as conn:
        drain(conn, queue, 1, lambda d: len(d.ids) >= expected, time.monotonic() + cap,
              handle=report, ready=lambda: link.report("ready"))
    link.report("done")


@scenario("latency", {"latency": "latency p50/p99 ms"}, KOMBU_BROKERS, rank=30)
def latency(target: Target, ctx: Context) -> dict[str, Cell]:
    """One message at a time to an idle consumer process; random gaps sample the poll phase."""
    samples = ctx.sizes.latency
    gap = target.polling_interval or 0.01
    found: list[float] = []
    with scratch_queue(target, ctx.queue_name("lat")) as queue, connect(target) as conn:
        channel = conn.channel()
        producer = declared_producer(channel, queue)
        with Children(1, _latency_consumer, target, queue, samples,
                      ctx.sizes.cap + 30) as child:
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
    return {"latency": spread(found)}


# -- racing consumers ---------------------------------------------------------------------
def _racer(link: Link, target: Target, queue: Queue, expected: int, cap: float) -> None:
    """A spawned consumer draining the queue with the others until all ``expected`` came."""
    def counted(payload: dict[str, Any], message: Any, now: float) -> None:
        link.add()
        message.ack()

    deadline = time.monotonic() + cap
    with connect(target) as conn:
        got = drain(conn, queue, RACE_PREFETCH, lambda _: link.counter.value >= expected,
                    deadline, handle=counted, ready=lambda: link.ready(cap))
    link.report("done", (got.ids, got.first, got.last))


def race(target: Target, ctx: Context, racers: int) -> Cell:
    """``racers`` processes drain one queue; the parent checks every id arrived exactly once."""
    count = ctx.count(target, ctx.sizes.consume)
    with scratch_queue(target, ctx.queue_name(f"race{racers}")) as queue:
        with connect(target) as conn:
            publish_many(conn, queue, range(count))
        with Children(racers, _racer, target, queue, count, ctx.sizes.cap + 10) as children:
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
