"""Run the results example: a worker stores results in the database the queues are in,
and the caller reads them.

    python examples/results/run.py

Uses a temporary SQLite file unless ``RESULTS_DATABASE_URL`` names a database. Starts
``celery -A results_app worker``, waits for a result, a failure and a saved group,
prints them, stops the worker and exits.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from celery import group
from celery.result import GroupResult

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]
from demo.run import start_worker, stop_worker  # noqa: E402

LIMIT = 60.0  # seconds each result may take, the worker's start-up included


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="sqlinbox-results-") as directory:
        os.environ.setdefault("RESULTS_DATABASE_URL", f"sqlite:///{directory}/results.db")
        from results_app import add, app, charge

        with Path(directory, "worker.log").open("w+b") as log:
            worker = start_worker("results_app", HERE, {}, log)
            try:
                result = add.delay(2, 3)
                print(f"add(2, 3) -> {result.get(timeout=LIMIT)} "
                      f"(task {result.name} on {result.worker.split('@')[0]}@...)")
                failed = charge.delay(7, 0)
                try:
                    failed.get(timeout=LIMIT)
                except ValueError as exc:
                    print(f"charge(7, 0) -> {failed.state}: {exc}")
                sent = group(charge.s(order, 10 * order) for order in (1, 2, 3)).apply_async()
                sent.save()
                restored = GroupResult.restore(sent.id, app=app)
                assert restored is not None
                charged = [found["charged"] for found in restored.get(timeout=LIMIT)]
                print(f"group restored by its id -> charged {charged}")
                result.forget()
                print(f"add(2, 3) forgotten -> {app.AsyncResult(result.id).state}")
            except Exception as exc:
                stop_worker(worker)
                log.seek(0)
                print(f"failed: {exc!r}\n{log.read().decode(errors='replace')}",
                      file=sys.stderr)
                return 1
            print(f"worker stopped (exit status {stop_worker(worker)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
