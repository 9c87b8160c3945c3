"""The Celery app of the rate-limit benchmark (``bench/rate.py``): one queue limited by the
transport's ``rate_limit``, or two tasks in one queue, one limited by ``task_rate_limits``;
each task appends when it started and its name to the file ``RATE_BENCH_LOG`` names (one
short line, one ``write``: the workers' lines never mix).

``RATE_BENCH_URL``, ``RATE_BENCH_PREFIX`` and ``RATE_BENCH_LIMIT`` set the database, the
table prefix and the limit; ``RATE_BENCH_PER_TASK=1`` puts the limit on ``ratebench.call``
alone.
"""

from __future__ import annotations

import os
import time

from celery import Celery

import kombu_sqlinbox  # noqa: F401  (registers the sqlinbox+ alias)

QUEUE = "ratebench"
LIMITED, FREE = "ratebench.call", "ratebench.free"


def make_app(url: str, prefix: str, limit: str, per_task: bool = False) -> Celery:
    made = Celery("ratebench", broker=url, set_as_current=False)
    queue = {"task_rate_limits": {LIMITED: limit}} if per_task else {"rate_limit": limit}
    made.conf.update(
        broker_transport_options={"table_prefix": prefix, "queues": {QUEUE: queue}},
        task_default_queue=QUEUE,
        task_ignore_result=True,
    )
    return made


app = make_app(os.environ.get("RATE_BENCH_URL", "sqlinbox+sqlite:///r.db"),
               os.environ.get("RATE_BENCH_PREFIX", "ratebench_"),
               os.environ.get("RATE_BENCH_LIMIT", "50/s"),
               os.environ.get("RATE_BENCH_PER_TASK") == "1")


def note(name: str) -> None:
    with open(os.environ["RATE_BENCH_LOG"], "a") as log:
        log.write(f"{time.time()} {name}\n")


@app.task(name=LIMITED)
def call() -> None:
    note(LIMITED)


@app.task(name=FREE)
def free() -> None:
    note(FREE)
