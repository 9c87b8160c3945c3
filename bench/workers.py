"""Real ``celery worker`` subprocesses: tasks queued first, then a worker runs them all."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from celery import Celery

from .registry import gist

REPO = Path(__file__).resolve().parent.parent
WORKER_FLAGS = ("--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "WARNING")
#: a worker that sends task events and heartbeats (gossip and mingle stay off everywhere)
MONITORED_FLAGS = ("--without-gossip", "--without-mingle", "-E", "-l", "WARNING")
#: seconds a worker may take to start before its first task
STARTUP = 30.0
#: seconds without a task finishing after which the worker counts as stuck
STALL = 20.0


def queue_tasks(app: Celery, name: str, queue: str, arguments: Sequence[tuple[Any, ...]]) -> None:
    """Send one task ``name`` per argument tuple, through one producer."""
    with app.producer_or_acquire() as producer:
        for args in arguments:
            app.send_task(name, args=args, queue=queue, producer=producer)


@contextmanager
def worker(app: str, pool: Sequence[str], queue: str, env: dict[str, str], log: Path,
           *, name: str | None = None, flags: Sequence[str] = WORKER_FLAGS,
           ) -> Iterator[subprocess.Popen[bytes]]:
    """``celery -A app worker`` on ``queue`` (node ``name@%h``, by default the queue's) with
    the bench's environment added, output in ``log``; stopped (warm, then killed with its
    pool) when the block ends."""
    command = [sys.executable, "-m", "celery", "-A", app, "worker", *pool, "-Q", queue,
               "-n", f"{name or queue}@%h", *flags]
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    with log.open("w") as output:
        process = subprocess.Popen(command, env={**os.environ, **env, "PYTHONPATH": path},
                                   cwd=REPO, stdout=output, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    try:
        yield process
    finally:
        stop(process)


def stop(process: subprocess.Popen[bytes]) -> None:
    """Warm shutdown of a worker this module started; its process group is killed if it stays."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(20)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)


def stop_all(processes: Sequence[subprocess.Popen[bytes]]) -> None:
    """Warm shutdown of several workers at once (each :func:`stop` then only waits)."""
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    for process in processes:
        stop(process)


def wait_done(process: subprocess.Popen[bytes], done: Callable[[], int], total: int, log: Path,
              *, cap: float | None = None, every: float = 0.01) -> None:
    """Poll ``done()`` until it reaches ``total``; raise, quoting the worker's log, if the
    worker exits, nothing finishes for :data:`STALL` s (plus :data:`STARTUP` before the
    first task), or ``cap`` s after start-up pass."""
    deadline = time.monotonic() + STARTUP + cap if cap is not None else None
    count, moved = 0, time.monotonic()
    while process.poll() is None and (deadline is None or time.monotonic() < deadline):
        now = done()
        if now != count:
            count, moved = now, time.monotonic()
        if count >= total or time.monotonic() - moved > STALL + (STARTUP if not count else 0):
            break
        time.sleep(every)
    if count < total:
        lines = log.read_text(errors="replace").strip().splitlines()
        print(f"{log.name}: worker output (last lines):", *lines[-15:], sep="\n  ",
              file=sys.stderr)
        why = "worker exited" if process.poll() is not None else "stalled or capped"
        raise RuntimeError(f"{count}/{total} tasks ran ({why}); worker log: "
                           + gist("\n".join(lines)))
