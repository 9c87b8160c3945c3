"""A queue's ``rate_limit`` across several workers: ``50/s`` over four ``celery worker``
processes (solo pool) draining a backlog of short tasks for about a minute; and a task's
(``task_rate_limits``): ``50/s`` on one of two tasks sharing the queue, the other's
backlog beside it.

Each task notes when it started (one host, one clock); printed per database: the most
limited tasks started in any 10 s and in any 1 s, and their average rate from the first
start to the end of the run (the backlog outlasts it); for the per-task run, also how
fast the other task's backlog went. A limit kept per worker, as Celery's own
``rate_limit``, would run four times as many. Run alone: ``python bench/rate.py
[--seconds 60] [--databases postgresql,mysql,sqlite] [--sections queue,task]``; the
servers are ``BENCH_POSTGRES_URL`` and ``BENCH_MYSQL_URL``. Figures depend on the machine
and whatever else runs on it.
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

from bench.rate_app import FREE, LIMITED, QUEUE, make_app
from bench.report import grid
from bench.targets import SERVERS, drop_tables
from bench.workers import queue_tasks, stop_all, worker

LIMIT = 50
WORKERS = 4
#: seconds the workers may take to start before the first task
STARTUP = 60.0
#: the other task's backlog in the per-task run, sent among the first limited ones
FREE_BACKLOG = 2000
HEADERS = ("database", "limit", "workers", "seconds", "started", "most in 10 s",
           "most in 1 s", "average /s")


def most_in_any(times: list[float], span: float) -> int:
    """The most starts in any ``span`` seconds."""
    most, first = 0, 0
    for last, at in enumerate(times):
        while at - times[first] >= span:
            first += 1
        most = max(most, last - first + 1)
    return most


def starts(log: Path, task: str = LIMITED) -> list[float]:
    """When each run of ``task`` started, in order."""
    lines = log.read_text().splitlines() if log.exists() else []
    return sorted(float(at) for at, name in (line.split() for line in lines) if name == task)


def one_run(plain: str, seconds: float, scratch: Path, per_task: bool
            ) -> tuple[int, int, float, int, float | None]:
    """(most in 10 s, most in 1 s, average rate, limited tasks started, the other task's
    rate or None) of one database."""
    prefix = f"rb{uuid.uuid4().hex[:6]}_"
    log = scratch / f"{prefix}starts.log"
    env = {"RATE_BENCH_URL": "sqlinbox+" + plain, "RATE_BENCH_PREFIX": prefix,
           "RATE_BENCH_LIMIT": f"{LIMIT}/s", "RATE_BENCH_LOG": str(log),
           "RATE_BENCH_PER_TASK": "1" if per_task else "0"}
    backlog = int(LIMIT * seconds * 1.2)
    try:
        sender = make_app(env["RATE_BENCH_URL"], prefix, env["RATE_BENCH_LIMIT"], per_task)
        for number in range(0, backlog, 100):  # the other task's rows among the limited
            queue_tasks(sender, LIMITED, QUEUE, [()] * min(100, backlog - number))
            if per_task and number < FREE_BACKLOG:
                queue_tasks(sender, FREE, QUEUE, [()] * 100)
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
        other = starts(log, FREE)
    finally:
        drop_tables(plain, prefix)
    free = len(other) / (other[-1] - other[0]) if len(other) > 1 else None
    return (most_in_any(found, 10.0), most_in_any(found, 1.0), len(found) / seconds,
            len(found), free)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--databases", default="postgresql,mysql,sqlite")
    parser.add_argument("--sections", default="queue,task")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="ratebench-"))
    for section in args.sections.split(","):
        per_task = section == "task"
        headers = (*HEADERS, "other task /s") if per_task else HEADERS
        lines = []
        for database in args.databases.split(","):
            plain = SERVERS.get(database) or f"sqlite:///{scratch}/{database}-{section}.db"
            most_10, most_1, rate, started, free = one_run(plain, args.seconds, scratch,
                                                           per_task)
            line = (database, f"{LIMIT}/s", WORKERS, f"{args.seconds:.0f}", started,
                    most_10, most_1, f"{rate:.1f}")
            lines.append((*line, "-" if free is None else f"{free:.0f}") if per_task else line)
            print(grid(headers, lines[-1:]), flush=True)
        print(f"\n{'task_rate_limits' if per_task else 'rate_limit'}")
        print(grid(headers, lines))


if __name__ == "__main__":
    main()
