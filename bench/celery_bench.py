"""Celery end to end: N tasks waiting in the queue, then a real worker runs them all."""

from __future__ import annotations

import time
from functools import partial

from .celery_app import TASK, counter, make_app
from .registry import Cell, guarded, scenario
from .targets import Context, Target, celery_env, delete_queue
from .workers import queue_tasks, wait_done, worker

POOLS = {"celery_prefork": ("-P", "prefork", "-c", "2"), "celery_solo": ("-P", "solo")}


def run_worker(target: Target, ctx: Context, column: str) -> Cell:
    queue = ctx.queue_name(column.replace("_", ""))
    total = ctx.count(target, ctx.sizes.tasks)
    key = f"bench:{ctx.run_id}:{queue}"
    app = make_app(target.url, target.transport_options, queue, target.polling_interval)
    env = celery_env(target, queue)
    log = ctx.scratch / f"{queue}.log"
    try:
        queue_tasks(app, TASK, queue, [(key, total)] * total)
        started = time.time()
        with worker("bench.celery_app", POOLS[column], queue, env, log) as process:
            wait_done(process, lambda: int(counter().get(key) or 0), total, log,
                      cap=ctx.sizes.cap)
            finished = time.time()
        first, last = (float(counter().get(f"{key}:{n}") or 0) for n in (1, total))
        cell = Cell.rate(total, finished - started, steady=round((total - 1) / (last - first), 1),
                         startup=round(first - started, 3))
        cell.text += f" ({cell.details['steady']:,.0f})"
        return cell
    finally:
        app.close()
        counter().delete(key, f"{key}:1", f"{key}:{total}")
        delete_queue(target, queue)


@scenario("celery", {"celery_prefork": "celery prefork -c2 tasks/s",
                     "celery_solo": "celery solo tasks/s"},
          {"sqlinbox", "sqla", "redis", "rabbitmq"}, rank=50)
def celery(target: Target, ctx: Context) -> dict[str, Cell]:
    """Tasks/s from worker start until the last task ran (in brackets: first to last task)."""
    return {column: guarded(partial(run_worker, target, ctx, column)) for column in POOLS}
