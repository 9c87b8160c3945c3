"""Unique keys under load, per database:

    python bench/unique.py [--databases postgresql,mysql,sqlite] [--processes 8]
                           [--tasks 1000] [--keys 100] [--publishes 2000]

* race: ``--processes`` processes, started together, each publish ``--tasks`` tasks over
  ``--keys`` keys (task ``n`` takes key ``n % keys``); the table must then hold exactly one
  row per key, and every other publish must have been refused naming its holder;
* throughput, msg/s, one process, ``--publishes`` each: publishes without a key, with a
  key each (all land), with one held key (all refused), and with a timed key each.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import sys
import tempfile
import time
import uuid
from multiprocessing.synchronize import Barrier
from pathlib import Path

if __name__ == "__main__":  # run as a script: import the bench package, not its modules
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from kombu import Connection
from sqlalchemy import create_engine, text

from bench.targets import DATABASES, SERVERS, drop_tables
from kombu_sqlinbox.errors import DuplicateTask
from kombu_sqlinbox.tables import table_name_for_queue

QUEUE = "unique_bench"
WAIT = 120.0


def racer(url: str, prefix: str, number: int, tasks: int, keys: int, barrier: Barrier,
          results: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    """Publish ``tasks`` keyed tasks once every racer is ready; report (landed, refused,
    refusals naming no holder, seconds)."""
    with Connection("sqlinbox+" + url, transport_options={"table_prefix": prefix}) as conn:
        producer = conn.Producer()
        conn.default_channel.queue_declare(QUEUE)
        landed = refused = unnamed = 0
        barrier.wait(WAIT)
        started = time.monotonic()
        for n in range(tasks):
            task_id = f"p{number}-{n}"
            try:
                producer.publish({"n": n}, routing_key=QUEUE, headers={"id": task_id},
                                 unique_key=f"key-{(n + number) % keys}", retry=False)
                landed += 1
            except DuplicateTask as exc:
                refused += 1
                unnamed += exc.task_id is None
        results.put((landed, refused, unnamed, time.monotonic() - started))


def race(url: str, processes: int, tasks: int, keys: int) -> str:
    prefix = f"ub{uuid.uuid4().hex[:6]}_"
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(processes + 1), context.Queue()
    children = [context.Process(target=racer, args=(url, prefix, n, tasks, keys, barrier,
                                                    results)) for n in range(processes)]
    try:
        with Connection("sqlinbox+" + url, transport_options={"table_prefix": prefix}) as conn:
            conn.default_channel.queue_declare(QUEUE)  # the table exists before the race
            conn.Producer().publish({}, routing_key=QUEUE, unique_key="ready")
        for child in children:
            child.start()
        barrier.wait(WAIT)
        started = time.monotonic()
        reports = [results.get(timeout=WAIT) for _ in children]
        wall = time.monotonic() - started
        for child in children:
            child.join(WAIT)
        engine = create_engine(url)
        table = engine.dialect.identifier_preparer.quote(table_name_for_queue(QUEUE, prefix))
        with engine.connect() as db:
            rows, distinct = db.execute(text(
                f"SELECT COUNT(*), COUNT(DISTINCT sqlinbox_unique) FROM {table} "
                "WHERE sqlinbox_unique IS NOT NULL")).one()
        engine.dispose()
    finally:
        for child in children:
            if child.is_alive():
                child.kill()
        drop_tables(url, prefix)
    landed = sum(r[0] for r in reports)
    refused = sum(r[1] for r in reports)
    ok = rows == keys + 1 and distinct == keys + 1 and landed == keys and not any(
        r[2] for r in reports)
    return (f"race: {processes} processes x {tasks} tasks over {keys} keys: {landed} landed, "
            f"{refused} refused, {rows - 1} rows with {distinct - 1} distinct keys in "
            f"{wall:.2f}s ({processes * tasks / wall:,.0f} publishes/s): "
            + ("exactly one per key" if ok else "WRONG"))


def throughput(url: str, publishes: int) -> str:
    prefix = f"ub{uuid.uuid4().hex[:6]}_"
    figures = {}
    try:
        with Connection("sqlinbox+" + url, transport_options={"table_prefix": prefix}) as conn:
            producer = conn.Producer()
            conn.default_channel.queue_declare(QUEUE)
            producer.publish({}, routing_key=QUEUE, unique_key="held")  # the table ready
            kinds = {"no key": lambda n: {}, "a key each": lambda n: {"unique_key": f"k{n}"},
                     "held key (refused)": lambda n: {"unique_key": "held"},
                     "a timed key each": lambda n: {"unique_key": f"k{n}",
                                                    "unique_scope": 3600}}
            for kind, options in kinds.items():
                started = time.monotonic()
                for n in range(publishes):
                    with contextlib.suppress(DuplicateTask):  # refused: the last figure
                        producer.publish({"n": n}, routing_key=QUEUE, headers={"id": str(n)},
                                         retry=False, **options(n))
                figures[kind] = publishes / (time.monotonic() - started)
    finally:
        drop_tables(url, prefix)
    return "throughput, msg/s: " + ", ".join(f"{kind} {rate:,.0f}"
                                              for kind, rate in figures.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--databases", default=",".join(DATABASES))
    parser.add_argument("--processes", type=int, default=8)
    parser.add_argument("--tasks", type=int, default=1000)
    parser.add_argument("--keys", type=int, default=100)
    parser.add_argument("--publishes", type=int, default=2000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for database in args.databases.split(","):
            url = SERVERS.get(database) or f"sqlite:///{tmp}/unique.db"
            print(f"{database}: {race(url, args.processes, args.tasks, args.keys)}")
            print(f"{database}: {throughput(url, args.publishes)}", flush=True)


if __name__ == "__main__":
    main()
