"""How long claims go on after a pause, and how soon they start again after a resume.

Two consumer processes (kombu, prefetch 10, acking each message as it comes) take a
steady stream of messages (``RATE`` per second) on each database; the publisher pauses
the queue, publishes on, and resumes it. Each consumer notes the wall-clock time of every
delivery (one host, one clock). Printed per database and wake-up mode:

* *pause -> last delivery*: from the pause's commit to the last message delivered while
  paused (a claim that was running at the commit, or that began before the consumer was
  told; 0 when the last came before the commit);
* *resume -> first delivery*: from the resume's commit to the next message delivered.

``wake-up``: NOTIFY (PostgreSQL) or the same-host signal (MariaDB, SQLite) tells the
consumers; ``none``: the transport's ``notify`` off, so only ``pause_check_interval`` (1 s
here, the default) does. Run alone: ``python bench/pause.py [--rounds N]``. Figures depend
on the machine and whatever else runs on it.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # run alone: the bench package, not its modules
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from kombu import Connection, Consumer, Queue
from sqlalchemy import create_engine, inspect, text

from bench.targets import SERVERS
from kombu_sqlinbox.operations import Operations
from kombu_sqlinbox.options import parse_options

QUEUE = "pausebench"
#: messages published per second, before, during and after the pause
RATE = 200
#: seconds of each phase: flowing, paused, resumed
PHASE = 2.0
CHECK_INTERVAL = 1.0


def consume(url: str, options: dict[str, Any], stop: Any, times: Any) -> None:
    """A consumer process: says it consumes (None on ``times``), then every delivery's
    time goes to ``times`` (once, at the end)."""
    seen: list[float] = []
    with Connection(url, transport_options=options) as conn:
        def keep(body: Any, message: Any) -> None:
            seen.append(time.time())
            message.ack()

        with Consumer(conn, [Queue(QUEUE, routing_key=QUEUE)], callbacks=[keep],
                      prefetch_count=10):
            times.put(None)
            while not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    conn.drain_events(timeout=0.2)
    times.put(seen)


def publish_for(producer: Any, seconds: float) -> None:
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        producer.publish({"at": time.time()}, routing_key=QUEUE)
        time.sleep(1.0 / RATE)


def one_round(url: str, options: dict[str, Any]) -> tuple[float, float]:
    """(pause -> last delivery, resume -> first delivery), in seconds."""
    spawn = multiprocessing.get_context("spawn")
    stop, times = spawn.Event(), spawn.Queue()
    with Connection(url, transport_options=options) as conn:
        conn.default_channel.queue_declare(QUEUE)
        consumers = [spawn.Process(target=consume, args=(url, options, stop, times))
                     for _ in range(2)]
        for process in consumers:
            process.start()
        for _ in consumers:
            times.get(timeout=120)  # started consuming
        ops = Operations(url, parse_options(options), [QUEUE])
        try:
            producer = conn.Producer()
            publish_for(producer, PHASE)
            ops.pause(QUEUE)
            paused = time.time()
            publish_for(producer, PHASE)
            ops.resume(QUEUE)
            resumed = time.time()
            publish_for(producer, PHASE)
            time.sleep(0.5)
        finally:
            ops.close()
        stop.set()
        seen = sorted(at for _ in consumers for at in times.get(timeout=60))
        for process in consumers:
            process.join(30)
    last = max((at for at in seen if at < resumed), default=paused)
    first = min(at for at in seen if at >= resumed)
    return max(0.0, last - paused), first - resumed


def drop(url: str, prefix: str) -> None:
    engine = create_engine(url.removeprefix("sqlinbox+"))
    with engine.begin() as conn:
        for name in inspect(conn).get_table_names():
            if name.startswith(prefix):
                conn.execute(text(f"DROP TABLE {engine.dialect.identifier_preparer.quote(name)}"))
    engine.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--databases", default="postgresql,mysql,sqlite")
    args = parser.parse_args()
    rows = []
    scratch = Path(tempfile.mkdtemp(prefix="pausebench-"))
    for database in args.databases.split(","):
        plain = SERVERS.get(database) or f"sqlite:///{scratch}/{database}.db"
        for mode, notify in (("wake-up", True), ("none", False)):
            prefix = f"pb{uuid.uuid4().hex[:6]}_"
            options = {"table_prefix": prefix, "notify": notify,
                       "pause_check_interval": CHECK_INTERVAL}
            url = "sqlinbox+" + plain
            try:
                found = [one_round(url, options) for _ in range(args.rounds)]
            finally:
                drop(url, prefix)
            stops, starts = ([1000 * f[n] for f in found] for n in (0, 1))
            rows.append((database, mode, f"{statistics.median(stops):.0f}",
                         f"{max(stops):.0f}", f"{statistics.median(starts):.0f}",
                         f"{max(starts):.0f}"))
    header = ("database", "wake-up", "pause -> last delivery ms (median, max)",
              "resume -> first delivery ms (median, max)")
    print("| " + " | ".join(header) + " |\n|---|---|---:|---:|")
    for database, mode, stop_median, stop_max, start_median, start_max in rows:
        print(f"| {database} | {mode} | {stop_median}, {stop_max} | {start_median}, "
              f"{start_max} |")


if __name__ == "__main__":
    main()
