"""Concurrency limits: is the limit kept under load, and what does it cost?

    python bench/limits.py [--databases postgresql,mysql,sqlite] [--messages N]
                           [--work SECONDS] [--prefetch N]

8 worker processes of 4 threads each (one consumer per process, prefetch 8 unless
``--prefetch`` says otherwise, as Celery's ``worker_prefetch_multiplier`` does; the task run
and acked on a thread, as Celery's threads pool does; at most 4 database connections
per process, 32 in all) drain ``--messages`` rows spread over 1,000 keys (in runs of 5
consecutive rows of a key), each task a short sleep. Once with
``concurrency_limits={"*": 2}``, once with no limits (the same messages, keys and all).
Each task notes its key, start and finish (one host clock) outside the broker; printed
per database:

* *most of a key at once*: the most runs of one key in work at the same moment, from that
  ledger (must be at most 2 with limits);
* *msg/s*: messages over the time from the first start to the last finish;
* *vs no limits*: the limited throughput as a share of the unlimited (target >= 90%).

Run on demand; the figures depend on the machine and whatever else runs on it.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # run alone: the bench package, not its modules
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from kombu import Connection, Consumer, Message, Queue
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.exc import OperationalError

from bench.kombu_bench import publish_many
from bench.ledger import most_at_once
from bench.report import grid
from bench.targets import SERVERS, drop_tables

QUEUE = "limited"
PROCESSES, THREADS = 8, 4
KEYS, LIMIT = 1000, 2
#: consecutive messages of one key: a key's rows come in runs, as a tenant's batch does
RUN = 5
#: connections per worker process: its pool (claims, the keeper's settlements) and LISTEN
POOL = 3
#: the throughput target with limits, as a share of the same load without
TARGET = 0.9


def worker(url: str, options: dict[str, Any], work: float, prefetch: int, stop: Event,
           results: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    """One worker process: consume until ``stop``, run each task on a thread, then report
    its ledger."""
    runs: list[tuple[str, float, float]] = []
    with Connection(url, transport_options=options) as conn, \
            ThreadPoolExecutor(THREADS) as pool:
        def task(message: Message) -> None:
            start = time.monotonic()
            time.sleep(work)
            runs.append((message.headers["limit_key"], start, time.monotonic()))
            message.ack()

        with Consumer(conn, [Queue(QUEUE, routing_key=QUEUE)], prefetch_count=prefetch,
                      callbacks=[lambda _, message: pool.submit(task, message)]):
            while not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    conn.drain_events(timeout=0.2)
    results.put(runs)


def waiting(engine: Engine, prefix: str) -> int | None:
    """The rows left, or None when the server refused the look (its connections are
    shared: the look is tried again)."""
    table = engine.dialect.identifier_preparer.quote(f"{prefix}{QUEUE}")
    try:
        with engine.connect() as conn:
            return int(conn.execute(text(f"SELECT COUNT(*) FROM {table}")).scalar_one())
    except OperationalError:
        return None


def one_run(plain: str, limited: bool, messages: int, work: float,
            prefetch: int = 8) -> tuple[int, float]:
    """(most runs of a key at once, messages per second) of one drain."""
    prefix = f"bl{uuid.uuid4().hex[:6]}_"
    url = "sqlinbox+" + plain
    queues = {QUEUE: {"concurrency_limits": {"*": LIMIT}}} if limited else {}
    options = {"table_prefix": prefix, "queues": queues,
               "engine_options": {"pool_size": POOL, "max_overflow": 0}}
    spawn = multiprocessing.get_context("spawn")
    stop, results = spawn.Event(), spawn.Queue()
    try:
        with Connection(url, transport_options=options) as conn:
            publish_many(conn, Queue(QUEUE, routing_key=QUEUE), range(messages),
                         lambda i: {"limit_key": f"key-{i // RUN % KEYS}"})
        workers = [spawn.Process(target=worker, args=(url, options, work, prefetch, stop,
                                                            results))
                   for _ in range(PROCESSES)]
        for process in workers:
            process.start()
        engine = create_engine(plain, pool_size=1, max_overflow=0)
        try:
            deadline = time.monotonic() + 600
            while waiting(engine, prefix) != 0 and time.monotonic() < deadline:
                time.sleep(0.5)  # a progress look, not a synchronisation
        finally:
            engine.dispose()
            stop.set()
            runs = [run for _ in workers for run in results.get(timeout=120)]
            for process in workers:
                process.join(60)
    finally:
        drop_tables(plain, prefix)
    assert len(runs) >= messages, f"{len(runs)} of {messages} ran"
    seconds = max(end for *_, end in runs) - min(start for _, start, _ in runs)
    return max(most_at_once(runs).values()), len(runs) / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--databases", default="postgresql,mysql,sqlite")
    parser.add_argument("--messages", type=int, default=20000)
    parser.add_argument("--work", type=float, default=0.005, help="seconds per task")
    parser.add_argument("--prefetch", type=int, default=8, help="each consumer's prefetch")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="limitsbench-"))
    lines = []
    for database in args.databases.split(","):
        plain = SERVERS.get(database) or f"sqlite:///{scratch}/{database}.db"
        free_most, free_rate = one_run(plain, False, args.messages, args.work, args.prefetch)
        most, rate = one_run(plain, True, args.messages, args.work, args.prefetch)
        lines += [(database, "no limits", free_most, f"{free_rate:.0f}", "-"),
                  (database, f'{{"*": {LIMIT}}}', most, f"{rate:.0f}",
                   f"{rate / free_rate:.0%}" + ("" if rate >= TARGET * free_rate else " (!)"))]
        print(f"{database} done", file=sys.stderr)
    print(f"{args.messages} messages over {KEYS} keys, {PROCESSES} processes x {THREADS} "
          f"threads, prefetch {args.prefetch}, {args.work * 1000:.0f} ms tasks")
    print(grid(("database", "limits", "most of a key at once", "msg/s", "vs no limits"),
               lines))


if __name__ == "__main__":
    main()
