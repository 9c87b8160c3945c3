"""A kombu consumer process for the ordering tests.

``python -m tests.ordering.apps.consumer CONFIG_JSON`` where the config names the
broker, the test's table prefix, the queue and its kind of table (see
:mod:`.common`), queue options (claim form, lease, ...) and a mode:

* ``work`` — run each message ``{"grp", "seq"}`` on one of ``concurrency``
  threads for a random time, then ack it, or at random requeue it or retry it
  in place; every delivery is written to the work log before it is settled.
* ``hold`` — log the delivery as started and never settle it (the test kills
  or stops the process).
* ``latency`` — for messages ``{"i", "sent"}``, append how long after ``sent``
  each arrived to ``OUT.lat``.

It leaves ``OUT.ready`` once it consumes, ends when ``OUT.stop`` exists, after
``expect`` messages, or after its lifetime; an error in a work thread ends it
with status 1 and the traceback in its output.
"""

from __future__ import annotations

import contextlib
import json
import random
import sys
import threading
import time
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kombu import Connection, Consumer, Message, Queue

import kombu_sqlinbox  # noqa: F401  (registers the sqlinbox alias)
from tests.ordering.apps.common import WorkLog, transport_options

#: a consumer the parent forgot still ends by itself
LIFETIME = 300.0


class Worker:
    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.out = Path(config["out"])
        self.mode = config.get("mode", "work")
        self.log = WorkLog(config["db_url"], config["prefix"])
        self.random = random.Random(config.get("seed"))
        self.received = 0
        self.failed = threading.Event()
        self.pool = ThreadPoolExecutor(config.get("concurrency", 1))

    def on_message(self, body: dict[str, Any], message: Message) -> None:
        self.received += 1
        if self.mode == "latency":
            with self.out.with_suffix(".lat").open("a") as lat:
                lat.write(json.dumps({"i": body["i"], "delay": time.time() - body["sent"]}) + "\n")
            message.ack()
        elif self.mode == "hold":
            self.log.record(body["grp"], body["seq"], "held", time.time())
            self.out.with_suffix(".held").touch()
        else:
            self.pool.submit(self.work, body, message).add_done_callback(self.check)

    def work(self, body: dict[str, Any], message: Message) -> None:
        low, high = self.config.get("work", (0.0, 0.0))
        started = time.time()
        time.sleep(self.random.uniform(low, high))
        roll = self.random.random()
        requeue = self.config.get("requeue_rate", 0.0)
        retry = self.config.get("retry_rate", 0.0)
        outcome = "requeue" if roll < requeue else "retry" if roll < requeue + retry else "done"
        self.log.record(body["grp"], body["seq"], outcome, started, time.time())
        if outcome == "requeue":
            message.requeue()
        elif outcome == "retry":
            message.channel.qos.retry_after(message.delivery_tag, 0)
        else:
            message.ack()

    def check(self, future: Future[None]) -> None:
        exc = future.exception()
        if exc is not None:
            traceback.print_exception(exc)
            self.failed.set()

    def finished(self) -> bool:
        expect = self.config.get("expect")
        return (self.out.with_suffix(".stop").exists() or self.failed.is_set()
                or (expect is not None and self.received >= expect))

    def run(self) -> int:
        options = transport_options(self.config["prefix"], self.config["queue"],
                                    self.config.get("kind", "plain"),
                                    **self.config.get("options", {}))
        wait = self.config.get("drain_timeout", 0.5)
        deadline = time.monotonic() + LIFETIME
        with Connection(self.config["broker"], transport_options=options) as conn:
            consumer = Consumer(conn.default_channel, [Queue(self.config["queue"])],
                                callbacks=[self.on_message], accept=["json"])
            consumer.qos(prefetch_count=self.config.get("prefetch", 1))
            with consumer:
                self.out.with_suffix(".ready").touch()
                while not self.finished() and time.monotonic() < deadline:
                    with contextlib.suppress(TimeoutError):
                        conn.drain_events(timeout=wait)
                self.pool.shutdown(wait=True)
        self.log.close()
        return 1 if self.failed.is_set() else 0


if __name__ == "__main__":
    sys.exit(Worker(json.loads(sys.argv[1])).run())
