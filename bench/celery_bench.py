"""Celery end to end: N tasks waiting in the queue, then a real worker runs them all; then,
the worker idle, single tasks sent one at a time: how long each waits to start.

The sqlinbox transport is measured with Celery's blocking loop (its default) and with
Celery's event loop (transport option ``event_loop``); Redis and RabbitMQ always run
Celery's event loop.
"""

from __future__ import annotations

import statistics
import subprocess
import time
from dataclasses import replace
from functools import partial
from pathlib import Path

from celery import Celery

from .celery_app import STAMP, TASK, counter, make_app
from .registry import Cell, guarded, scenario
from .targets import Context, Target, celery_env, delete_queue
from .workers import queue_tasks, wait_done, worker

POOLS = {"prefork": ("-P", "prefork", "-c", "2"), "solo": ("-P", "solo"),
         "threads": ("-P", "threads", "-c", "2")}
#: pools whose idle latency is measured too
LATENCY_POOLS = ("prefork", "threads")
#: seconds the worker is left idle before each latency sample
IDLE = 0.5


def run_worker(target: Target, ctx: Context, pool: str, tag: str,
               idle: bool = True) -> tuple[Cell, Cell | None]:
    """Tasks/s of one worker on ``pool`` and, for :data:`LATENCY_POOLS` (unless not
    ``idle``), its idle latency."""
    queue = ctx.queue_name(tag)
    total = ctx.count(target, ctx.sizes.tasks)
    key = f"bench:{ctx.run_id}:{queue}"
    app = make_app(target.url, target.transport_options, queue, target.polling_interval)
    env = celery_env(target, queue)
    log = ctx.scratch / f"{queue}.log"
    try:
        queue_tasks(app, TASK, queue, [(key, total)] * total)
        started = time.time()
        with worker("bench.celery_app", POOLS[pool], queue, env, log) as process:
            wait_done(process, lambda: int(counter().get(key) or 0), total, log,
                      cap=ctx.sizes.cap)
            finished = time.time()
            latency = guarded(partial(idle_latency, app, process, queue, key, ctx, log)) \
                if idle and pool in LATENCY_POOLS else None
        first, last = (float(counter().get(f"{key}:{n}") or 0) for n in (1, total))
        cell = Cell.rate(total, finished - started, steady=round((total - 1) / (last - first), 1),
                         startup=round(first - started, 3))
        cell.text += f" ({cell.details['steady']:,.0f})"
        return cell, latency
    finally:
        app.close()
        counter().delete(key, f"{key}:1", f"{key}:{total}", f"{key}:latency")
        delete_queue(target, queue)


def idle_latency(app: Celery, process: subprocess.Popen[bytes], queue: str, key: str,
                 ctx: Context, log: Path) -> Cell:
    """Median ms from send to start of a task sent to the idle worker, one at a time."""
    samples = max(5, ctx.sizes.latency // 4)
    for sent in range(1, samples + 1):
        time.sleep(IDLE)  # the worker must be idle: that is what is measured
        queue_tasks(app, STAMP, queue, [(f"{key}:latency", time.time())])
        wait_done(process, lambda: int(counter().llen(f"{key}:latency")), sent, log,
                  cap=ctx.sizes.cap)
    found = [float(value) * 1000 for value in counter().lrange(f"{key}:latency", 0, -1)]
    median = statistics.median(found)
    return Cell(median, f"{median:.1f}", {"samples": found})


def pools(target: Target, ctx: Context, prefix: str, chosen: tuple[str, ...]) -> dict[str, Cell]:
    cells: dict[str, Cell] = {}
    for pool in chosen:
        try:
            rate, latency = run_worker(target, ctx, pool, f"{prefix}{pool}")
        except Exception as exc:
            rate, latency = Cell.failed(exc), Cell.failed(exc)
        cells[f"{prefix}{pool}"] = rate
        if pool in LATENCY_POOLS:
            cells[f"{prefix}latency_{pool}"] = latency or Cell(None, "n/a")
    return cells


@scenario("celery", {"celery_prefork": "celery prefork -c2 tasks/s",
                     "celery_solo": "celery solo tasks/s",
                     "celery_threads": "celery threads -c2 tasks/s",
                     "celery_latency_prefork": "idle latency prefork ms",
                     "celery_latency_threads": "idle latency threads ms"},
          {"sqlinbox", "sqla", "redis", "rabbitmq"}, rank=50)
def celery(target: Target, ctx: Context) -> dict[str, Cell]:
    """Tasks/s from worker start until the last task ran (in brackets: first to last task),
    and the median idle latency; the transport's default loop."""
    return pools(target, ctx, "celery_", tuple(POOLS))


@scenario("celery_event_loop", {"ev_prefork": "event loop: prefork -c2 tasks/s",
                                "ev_threads": "event loop: threads -c2 tasks/s",
                                "ev_latency_prefork": "event loop: idle latency prefork ms",
                                "ev_latency_threads": "event loop: idle latency threads ms"},
          {"sqlinbox"}, rank=51)
def celery_event_loop(target: Target, ctx: Context) -> dict[str, Cell]:
    """The same with Celery's event loop (transport option ``event_loop``)."""
    looping = replace(target, transport_options={**target.transport_options, "event_loop": True})
    return pools(looping, ctx, "ev_", LATENCY_POOLS)


@scenario("drain", {"drain_prefork": "worker drain prefork -c2 tasks/s"},
          {"sqlinbox", "sqla", "redis", "rabbitmq"}, rank=49)
def drain(target: Target, ctx: Context) -> dict[str, Cell]:
    """The prefork -c2 worker's drain of the pre-filled backlog alone (the ``celery``
    scenario's first column, without the other pools and the idle latency)."""
    return {"drain_prefork": guarded(lambda: run_worker(target, ctx, "prefork", "drain",
                                                        idle=False)[0])}
