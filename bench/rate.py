"""A queue's ``rate_limit`` across several workers: ``50/s`` over four ``celery worker``
processes (solo pool) draining a backlog of short tasks for about a minute.

Each task notes when it started (one host, one clock); printed per database: the most
tasks started in any 10 s and in any 1 s, and the average rate from the first start to
the end of the run (the backlog outlasts it). A limit kept per worker, as Celery's own
``rate_limit``, would run four times as many. Run alone: ``python bench/rate.py
[--seconds 60] [--databases postgresql,mysql,sqlite]``; the servers are
``BENCH_POSTGRES_URL`` and ``BENCH_MYSQL_URL``. Figures depend on the machine and
whatever else runs on it.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import uuid
from contextlib import ExitStack
from pathlib import Path

if __name__ == "__main__":  # run alone: the bench package, not its modules
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from bench.rate_app import QUEUE, make_app
from bench.report import grid
from bench.targets import SERVERS, drop_tables
from bench.workers import queue_tasks, stop_all, worker

LIMIT = 50
WORKERS = 4
#: seconds the workers may take to start before the first task
STARTUP = 60.0


def most_in_any(times: list[float], span: float) -> int:
    """The most starts in any ``span`` seconds."""
    most, first = 0, 0
    for last, at in enumerate(times):
        while at - times[first] >= span:
            first += 1
        most = max(most, last - first + 1)
    return most


def starts(log: Path) -> list[float]:
    return sorted(float(line) for line in log.read_text().split()) if log.exists() else []


def one_run(plain: str, seconds: float, scratch: Path) -> tuple[int, int, float, int]:
    """(most in 10 s, most in 1 s, average rate, tasks started) of one database."""
    prefix = f"rb{uuid.uuid4().hex[:6]}_"
    log = scratch / f"{prefix}starts.log"
    env = {"RATE_BENCH_URL": "sqlinbox+" + plain, "RATE_BENCH_PREFIX": prefix,
           "RATE_BENCH_LIMIT": f"{LIMIT}/s", "RATE_BENCH_LOG": str(log)}
    try:
        sender = make_app(env["RATE_BENCH_URL"], prefix, env["RATE_BENCH_LIMIT"])
        queue_tasks(sender, "ratebench.call", QUEUE, [()] * int(LIMIT * seconds * 1.2))
        sender.close()
        with ExitStack() as stack:
            workers = [stack.enter_context(worker(
                "bench.rate_app", ["-P", "solo"], QUEUE, env, scratch / f"{prefix}{n}.log",
                name=f"r{n}")) for n in range(WORKERS)]
            deadline = time.monotonic() + STARTUP
            while not starts(log):
                if time.monotonic() > deadline:
                    raise SystemExit(f"no task started in {STARTUP:.0f} s; see {scratch}")
                time.sleep(0.1)
            began = starts(log)[0]
            time.sleep(max(0.0, began + seconds - time.time()))
            stop_all(workers)
        found = [at for at in starts(log) if at < began + seconds]
    finally:
        drop_tables(plain, prefix)
    return most_in_any(found, 10.0), most_in_any(found, 1.0), len(found) / seconds, len(found)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--databases", default="postgresql,mysql,sqlite")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="ratebench-"))
    lines = []
    for database in args.databases.split(","):
        plain = SERVERS.get(database) or f"sqlite:///{scratch}/{database}.db"
        most_10, most_1, rate, started = one_run(plain, args.seconds, scratch)
        lines.append((database, f"{LIMIT}/s", WORKERS, f"{args.seconds:.0f}", started,
                      most_10, most_1, f"{rate:.1f}"))
        print(grid(("database", "limit", "workers", "seconds", "started", "most in 10 s",
                    "most in 1 s", "average /s"), lines[-1:]), flush=True)
    print()
    print(grid(("database", "limit", "workers", "seconds", "started", "most in 10 s",
                "most in 1 s", "average /s"), lines))


if __name__ == "__main__":
    main()
