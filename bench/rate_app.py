"""The Celery app of the rate-limit benchmark (``bench/rate.py``): one queue limited by the
transport's ``rate_limit``; each task appends when it started to the file ``RATE_BENCH_LOG``
names (one short line, one ``write``: the workers' lines never mix).

``RATE_BENCH_URL``, ``RATE_BENCH_PREFIX`` and ``RATE_BENCH_LIMIT`` set the database, the
table prefix and the limit.
"""

from __future__ import annotations

import os
import time

from celery import Celery

import kombu_sqlinbox  # noqa: F401  (registers the sqlinbox+ alias)

QUEUE = "ratebench"


def make_app(url: str, prefix: str, limit: str) -> Celery:
    made = Celery("ratebench", broker=url, set_as_current=False)
    made.conf.update(
        broker_transport_options={"table_prefix": prefix,
                                  "queues": {QUEUE: {"rate_limit": limit}}},
        task_default_queue=QUEUE,
        task_ignore_result=True,
    )
    return made


app = make_app(os.environ.get("RATE_BENCH_URL", "sqlinbox+sqlite:///r.db"),
               os.environ.get("RATE_BENCH_PREFIX", "ratebench_"),
               os.environ.get("RATE_BENCH_LIMIT", "50/s"))


@app.task(name="ratebench.call")
def call() -> None:
    with open(os.environ["RATE_BENCH_LOG"], "a") as log:
        log.write(f"{time.time()}\n")
