"""Run the kombu-sqlinbox demo: a real Celery worker on a SQLite file, then an account.

    python examples/demo/run.py

Sends a few tasks (one delayed, one with bad input), starts ``celery worker``
as a subprocess, waits until every task has either a result or a place in the
dead-letter queue, prints what happened, stops the worker and exits. Needs no
server: the queues are tables in a temporary SQLite file.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

HERE = Path(__file__).resolve().parent
DEADLINE = 25.0  # seconds for the whole run, worker start-up included
COUNTDOWN = 3
DEAD_LETTER_QUEUE = "celery.parked"


def start_worker(
    app: str, cwd: Path, env: dict[str, str], log: IO[bytes], pool: Sequence[str] = (),
) -> subprocess.Popen[bytes]:
    """Start ``celery -A app worker`` in its own process group, output to ``log``."""
    command = [
        sys.executable, "-m", "celery", "-A", app, "worker", *pool,
        "--without-gossip", "--without-mingle", "--without-heartbeat", "--loglevel", "INFO",
    ]
    return subprocess.Popen(
        command, cwd=cwd, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def stop_worker(worker: subprocess.Popen[bytes], timeout: float = 15.0) -> int:
    """Warm shutdown (SIGTERM to the main process); its whole group is killed if it overstays."""
    if worker.poll() is None:
        worker.terminate()
        try:
            return worker.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, signal.SIGKILL)
    return worker.wait(timeout)


def wait_until(done: Any, deadline: float, worker: subprocess.Popen[bytes]) -> None:
    """Poll ``done()`` until it is true; fail at the deadline or if the worker exits."""
    while not done():
        if worker.poll() is not None:
            raise RuntimeError(f"the worker exited early with status {worker.returncode}")
        if time.monotonic() > deadline:
            raise TimeoutError("not every task was accounted for before the deadline")
        time.sleep(0.2)


def main() -> int:
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="sqlinbox-demo-") as directory:
        os.environ["DEMO_DIR"] = directory
        sys.path.insert(0, str(HERE))
        from demo_app import add, app, parse_order, remind

        print(f"kombu-sqlinbox demo: Celery with its queues in {directory}/demo.db")
        results = {
            "add(2, 2)": add.delay(2, 2),
            "add(40, 2)": add.delay(40, 2),
            "parse_order('1234')": parse_order.delay("1234"),
            f"remind(countdown={COUNTDOWN})": remind.apply_async(
                ("water the plants", time.time()), countdown=COUNTDOWN),
            "parse_order('twelve')": parse_order.delay("twelve"),
        }
        print(f"sent {len(results)} tasks; they wait as rows in table sqlinbox_celery")

        log_path = Path(directory, "worker.log")
        with log_path.open("wb") as log:
            worker = start_worker(
                "demo_app", HERE, {"DEMO_DIR": directory}, log,
                pool=("--pool", "prefork", "--concurrency", "2"),
            )
            print(f"started celery worker --pool prefork --concurrency 2 (pid {worker.pid})")
            try:
                with app.connection_for_read() as conn:
                    channel = conn.default_channel

                    def parked() -> int:
                        declared = channel.queue_declare(queue=DEAD_LETTER_QUEUE)
                        return int(declared.message_count)

                    wait_until(
                        lambda: all(r.ready() for r in results.values()) and parked() == 1,
                        started + DEADLINE, worker,
                    )
                    print_results(results)
                    print_dead_letters(conn)
            except (RuntimeError, TimeoutError) as exc:
                print(f"demo failed: {exc}; worker log follows", file=sys.stderr)
                stop_worker(worker)
                print(log_path.read_text(errors="replace"), file=sys.stderr)
                return 1
            status = stop_worker(worker)
        print(f"worker stopped (exit status {status}); "
              f"demo finished in {time.monotonic() - started:.1f} s")
        return 0 if status == 0 else 1


def print_results(results: dict[str, Any]) -> None:
    print("\nwhat ran:")
    for call, result in results.items():
        if result.successful():
            print(f"  {call:<24} -> {result.result!r}")
        else:
            print(f"  {call:<24} -> {result.state}: {result.result!r}")


def print_dead_letters(conn: Any) -> None:
    """Read the dead-letter queue like any other queue, here with kombu's SimpleQueue."""
    print(f"\ndead-letter queue {DEAD_LETTER_QUEUE!r}:")
    with conn.SimpleQueue(DEAD_LETTER_QUEUE) as queue:
        while queue.qsize():
            message = queue.get(timeout=5)
            death = message.headers["x-sqlinbox-death"]
            print(f"  {message.headers['task']}{message.headers['argsrepr']} "
                  f"from queue {death['queue']!r} after {death['attempts']} attempt(s): "
                  f"{death['reason']}")
            message.ack()


if __name__ == "__main__":
    sys.exit(main())
