"""How soon ``AsyncResult.get()`` returns after a task finishes: the sqlinbox result
backend on each database beside Celery's Redis backend.

    python bench/result_wait.py [--tasks 200] [--backends postgresql,mysql,sqlite,redis,...]

``db+postgresql`` is Celery's own database backend, which sleeps half a second between
reads. For each backend, one ``celery worker`` (solo pool) on a sqlinbox broker runs ``stamp``
tasks one at a time; each returns ``time.time()`` as its body ends, and the caller,
waiting in ``get()`` since it sent the task, takes the difference when ``get()``
returns: the result's write, its announcement and the waiter's wake-up and read (one
host, one clock). Prints p50/p99/max in milliseconds per backend. The broker is the
backend's database (PostgreSQL for Redis), under a table prefix of its own, dropped
after.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

if __name__ == "__main__":  # run alone: the bench package, not its modules
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from celery import Celery
from sqlalchemy import create_engine, inspect, text

import kombu_sqlinbox  # noqa: F401  (registers the sqlinbox+ broker URLs)
from kombu_sqlinbox.urls import sqlalchemy_url

BROKER_ENV, BACKEND_ENV = "RESULT_WAIT_BROKER", "RESULT_WAIT_BACKEND"
PREFIX_ENV = "RESULT_WAIT_PREFIX"
DATABASES = {
    "postgresql": os.environ.get("SQLINBOX_BENCH_POSTGRES",
                                 "postgresql://postgres@127.0.0.1:5432/test"),
    "mysql": os.environ.get("SQLINBOX_BENCH_MYSQL", "mysql+pymysql://root@127.0.0.1:3306/test"),
}
#: Celery's own backends, beside: Redis, and its database backend (db+) on PostgreSQL
OTHERS = {"redis": os.environ.get("SQLINBOX_BENCH_REDIS", "redis://127.0.0.1:6379/9"),
          "db+postgresql": "db+" + DATABASES["postgresql"].replace(
              "postgresql://", "postgresql+psycopg://")}


def make_app(broker: str, backend: str, prefix: str) -> Celery:
    made = Celery("result_wait", broker=broker, backend=backend, set_as_current=False)
    made.conf.update(broker_transport_options={"table_prefix": prefix, "polling_interval": 0.1},
                     task_ignore_result=False, worker_hijack_root_logger=False,
                     # Celery's db+ backend, under the prefix too
                     database_table_names={"task": prefix + "taskmeta",
                                           "group": prefix + "groupmeta"})
    return made


app = make_app(os.environ.get(BROKER_ENV, "memory://"),
               os.environ.get(BACKEND_ENV, "cache+memory://"), os.environ.get(PREFIX_ENV, "bench_"))


@app.task(name="result_wait.stamp")
def stamp() -> float:
    return time.time()


def measure(name: str, tasks: int, directory: Path) -> list[float]:
    """Latencies (ms) of ``tasks`` results on backend ``name``."""
    database = DATABASES.get(name, f"sqlite:///{directory}/{name}.db")
    broker_db = DATABASES["postgresql"] if name in OTHERS else database
    backend = OTHERS.get(name, "sqlinbox+" + database)
    prefix = f"rw{uuid.uuid4().hex[:6]}_"
    env = {**os.environ, BROKER_ENV: "sqlinbox+" + broker_db, BACKEND_ENV: backend,
           PREFIX_ENV: prefix, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    caller = make_app("sqlinbox+" + broker_db, backend, prefix)
    with (directory / f"{name}.log").open("wb") as log:
        worker = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "bench.result_wait", "worker", "-P", "solo",
             "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "warning"],
            env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        caller.send_task("result_wait.stamp").get(timeout=60)  # the worker is up
        found = []
        for _ in range(tasks):
            finished = caller.send_task("result_wait.stamp").get(timeout=60)
            found.append((time.time() - finished) * 1000)
        return found
    finally:
        worker.terminate()
        worker.wait(30)
        caller.close()
        engine = create_engine(sqlalchemy_url(broker_db))
        with engine.begin() as conn:
            quote = engine.dialect.identifier_preparer.quote
            for table in inspect(conn).get_table_names():
                if table.startswith(prefix):
                    conn.execute(text(f"DROP TABLE {quote(table)}"))
        engine.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=200)
    parser.add_argument("--backends", default="postgresql,mysql,sqlite,redis,db+postgresql")
    args = parser.parse_args()
    print(f"get() latency after the task finishes, {args.tasks} tasks one at a time (ms)")
    print(f"{'backend':<12} {'p50':>8} {'p99':>8} {'max':>8}")
    with tempfile.TemporaryDirectory(prefix="sqlinbox-result-wait-") as directory:
        for name in args.backends.split(","):
            found = sorted(measure(name, args.tasks, Path(directory)))
            p99 = statistics.quantiles(found, n=100, method="inclusive")[98]
            print(f"{name:<12} {statistics.median(found):>8.2f} {p99:>8.2f} {found[-1]:>8.2f}")


if __name__ == "__main__":
    main()
