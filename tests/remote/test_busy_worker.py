"""A worker whose only pool process runs a long task, with more tasks taken in behind it,
answers remote control at once: a ``celery worker`` and a worker built in Python by
Celery's own ``start_worker`` (what Celery's integration suite and pytest plugin run),
which sends no ``celeryd_init``.

Celery's blocking loop, which this transport's worker runs, would wait in the prefork
pool for a free process before taking the next message in, and answer nothing until the
running task ended; each test holds its first task until it has seen the worker answer
``inspect().reserved()`` with the tasks behind it, then ``inspect().active()``.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
from celery import Celery
from celery.contrib.testing.worker import start_worker

from tests.acceptance.apps import tasks
from tests.acceptance.conftest import Acceptance
from tests.acceptance.conftest import acceptance as acceptance  # the fixture, shared
from tests.processes import Proc, wait_until

HOST = socket.gethostname()
#: inspect's reply window: Celery's default is 1 s; a worker on a loaded two-core machine
#: can answer later (a worker that does not answer while busy never does: its task is held)
REPLY_LIMIT = 5.0
#: tasks sent: one runs, the others wait behind it in the worker (prefetch 4, one process)
SENT = 3
#: how long the held task may wait for the worker to take in the others
BACKLOG_LIMIT = 30.0


def answers_while_busy(app: Celery, node: str, acceptance: Acceptance,
                       alive: Sequence[Proc] = ()) -> None:
    """Send :data:`SENT` held tasks to ``node`` (one process), and check that it answers
    ``reserved`` and ``active`` within :data:`REPLY_LIMIT` each while the first runs."""
    keys = [f"busy{n}" for n in range(SENT)]
    ids = [app.send_task("acc.run", args=(key,), kwargs={"hold": True}).id for key in keys]
    try:
        wait_until(acceptance.runs.starts, 30, "the first task to start", alive=alive)
        (running,) = [record["task_id"] for record in acceptance.runs.records()]

        def reserved() -> set[str]:
            started = time.monotonic()
            replies = app.control.inspect([node], timeout=REPLY_LIMIT).reserved()
            assert replies is not None, (
                f"{node} did not answer inspect().reserved() within {REPLY_LIMIT}s "
                f"({time.monotonic() - started:.2f}s)")
            return {task["id"] for task in replies[node]}

        behind = set(ids) - {running}
        wait_until(lambda: reserved() == behind, BACKLOG_LIMIT,
                   "the worker to take in the tasks behind the running one", alive=alive)
        started = time.monotonic()
        active = app.control.inspect([node], timeout=REPLY_LIMIT).active()
        took = time.monotonic() - started
        assert active is not None, f"{node} did not answer inspect().active() in {took:.2f}s"
        assert [task["id"] for task in active[node]] == [running], active
        assert acceptance.runs.done() == {}, "the held task ended before the replies"
    finally:
        for key in keys:
            acceptance.runs.release(key)
    wait_until(lambda: sum(acceptance.runs.done().values()) == SENT, 60,
               "the released tasks to end", alive=alive)


def test_a_celery_worker_answers_inspect_while_its_pool_is_busy(
        acceptance: Acceptance) -> None:
    worker = acceptance.worker("prefork", 1, name="busy")
    answers_while_busy(acceptance.app, f"busy@{HOST}", acceptance, [worker])


def test_a_worker_from_start_worker_answers_inspect_while_its_pool_is_busy(
        acceptance: Acceptance, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Celery's ``start_worker``, a prefork pool as Celery's integration suite runs it;
    the pool process forks from this one, where the task writes its records."""
    monkeypatch.setenv(tasks.RUNS_ENV, str(acceptance.runs.path))
    app = tasks.make_app(acceptance.broker_url, dict(acceptance.options))
    app.task(bind=True, name="acc.run")(tasks.run)
    node = f"inpython@{HOST}"
    try:
        with start_worker(app, pool="prefork", concurrency=1, perform_ping_check=False,
                          hostname=node, shutdown_timeout=30.0):
            answers_while_busy(app, node, acceptance)
    finally:
        app.close()
