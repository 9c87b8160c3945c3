"""The tiny Celery app of the end-to-end benchmark.

The worker reads its broker from the environment (``BENCH_BROKER_URL``,
``BENCH_TRANSPORT_OPTIONS`` as JSON, ``BENCH_POLLING_INTERVAL``, ``BENCH_QUEUE``);
each task records its completion with a Redis ``INCR`` (``BENCH_REDIS_URL``), which
costs the same whatever broker is under test.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery

import kombu_sqlinbox  # noqa: F401  (registers the sqlinbox+ alias)

TASK = "bench.tick"
STAMP = "bench.stamp"
_redis: redis.Redis | None = None


def counter() -> redis.Redis:
    global _redis
    if _redis is None:
        _redis = redis.Redis.from_url(os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/0"))
    return _redis


def tick(key: str, total: int) -> None:
    """Count one completed task; the first and the last also note the time."""
    done = counter().incr(key)
    if done in (1, total):
        counter().set(f"{key}:{done}", time.time())


def stamp(key: str, sent: float) -> None:
    """Note how long the task waited from its sending to its start."""
    counter().rpush(key, time.time() - sent)


def make_app(broker_url: str, transport_options: dict[str, Any], queue: str,
             polling_interval: float | None = None) -> Celery:
    app = Celery("bench", broker=broker_url, set_as_current=False)
    options = dict(transport_options)
    if polling_interval is not None:
        if broker_url.startswith("sqla+"):
            # kombu sqla passes every option to create_engine, which refuses this one
            from kombu.transport.sqlalchemy import Transport

            Transport.polling_interval = polling_interval
        else:
            options["polling_interval"] = polling_interval
    app.conf.update(
        broker_transport_options=options,
        task_default_queue=queue,
        task_ignore_result=True,
        worker_hijack_root_logger=False,
        broker_connection_retry_on_startup=True,
    )
    app.task(name=TASK)(tick)
    app.task(name=STAMP)(stamp)
    return app


def _interval() -> float | None:
    value = os.environ.get("BENCH_POLLING_INTERVAL")
    return float(value) if value else None


app = make_app(
    os.environ.get("BENCH_BROKER_URL", "memory://"),
    json.loads(os.environ.get("BENCH_TRANSPORT_OPTIONS") or "{}"),
    os.environ.get("BENCH_QUEUE", "bench"),
    _interval(),
)
