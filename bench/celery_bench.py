"""Celery end to end: N tasks waiting in the queue, then a real worker runs them all."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

from .celery_app import TASK, counter, make_app
from .registry import Cell, gist, guarded, scenario
from .targets import REDIS_URL, Context, Target, delete_queue

REPO = Path(__file__).resolve().parent.parent
WORKER_FLAGS = ("--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "WARNING")
POOLS = {"celery_prefork": ("-P", "prefork", "-c", "2"), "celery_solo": ("-P", "solo")}
STARTUP = 30.0
#: seconds without a task finishing (start-up included) after which the worker is stuck
STALL = 20.0


def run_worker(target: Target, ctx: Context, column: str) -> Cell:
    queue = ctx.queue_name(column.replace("_", ""))
    total = ctx.count(target, ctx.sizes.tasks)
    key = f"bench:{ctx.run_id}:{queue}"
    app = make_app(target.url, target.transport_options, queue, target.polling_interval)
    env = {
        **os.environ,
        "BENCH_BROKER_URL": target.url,
        "BENCH_TRANSPORT_OPTIONS": json.dumps(target.transport_options),
        "BENCH_POLLING_INTERVAL": str(target.polling_interval or ""),
        "BENCH_QUEUE": queue,
        "BENCH_REDIS_URL": REDIS_URL,
        "PYTHONPATH": str(REPO),
    }
    log = ctx.scratch / f"{queue}.log"
    worker = None
    try:
        with app.producer_or_acquire() as producer:
            for _ in range(total):
                app.send_task(TASK, args=(key, total), queue=queue, producer=producer)
        command = [sys.executable, "-m", "celery", "-A", "bench.celery_app", "worker",
                   *POOLS[column], "-Q", queue, "-n", f"{queue}@%h", *WORKER_FLAGS]
        with log.open("w") as output:
            started = time.time()
            worker = subprocess.Popen(command, env=env, cwd=REPO, stdout=output,
                                      stderr=subprocess.STDOUT)
        deadline = time.monotonic() + STARTUP + ctx.sizes.cap
        done, moved = 0, time.monotonic()
        while time.monotonic() < deadline and worker.poll() is None:
            now = int(counter().get(key) or 0)
            if now != done:
                done, moved = now, time.monotonic()
            if done >= total or time.monotonic() - moved > STALL:
                break
            time.sleep(0.01)
        finished = time.time()
        if done < total:
            lines = log.read_text().strip().splitlines()
            print(f"{target.label} {column} worker output (last lines):", *lines[-15:],
                  sep="\n  ", file=sys.stderr)
            why = "worker exited" if worker.poll() is not None else f"none for {STALL:.0f} s"
            raise RuntimeError(f"{done}/{total} tasks ran ({why}); worker log: "
                               + gist("\n".join(lines)))
        first, last = (float(counter().get(f"{key}:{n}") or 0) for n in (1, total))
        cell = Cell.rate(total, finished - started, steady=round((total - 1) / (last - first), 1),
                         startup=round(first - started, 3))
        cell.text += f" ({cell.details['steady']:,.0f})"
        return cell
    finally:
        stop(worker)
        app.close()
        counter().delete(key, f"{key}:1", f"{key}:{total}")
        delete_queue(target, queue)


def stop(worker: subprocess.Popen[bytes] | None) -> None:
    """Warm shutdown of the worker this scenario started; kill it if it does not go."""
    if worker is None or worker.poll() is not None:
        return
    worker.send_signal(signal.SIGTERM)
    try:
        worker.wait(20)
    except subprocess.TimeoutExpired:
        worker.kill()
        worker.wait(10)


@scenario("celery", {"celery_prefork": "celery prefork -c2 tasks/s",
                     "celery_solo": "celery solo tasks/s"},
          {"sqlinbox", "sqla", "redis", "rabbitmq"}, rank=50)
def celery(target: Target, ctx: Context) -> dict[str, Cell]:
    """Tasks/s from worker start until the last task ran (in brackets: first to last task)."""
    return {column: guarded(partial(run_worker, target, ctx, column)) for column in POOLS}
