"""The rate limits guide's example (docs/rate-limits.rst, examples/rate_limits): two real
workers call the partner no more than 20 times in any second together, and the guide
shows the setting the example uses."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy.engine import Engine

from tests.databases import drop_tables
from tests.integration.test_rate_limits import most_in_any
from tests.processes import Processes, wait_until

from .support import DOCS, EXAMPLES

PREFIX = "rate_"
CALLS = 60


@pytest.fixture
def example_tables(engine: Engine) -> Iterator[None]:
    drop_tables(engine, PREFIX)
    yield
    drop_tables(engine, PREFIX)


def calls(log: Path) -> list[float]:
    return [float(line.split()[0]) for line in log.read_text().splitlines()] \
        if log.exists() else []


@pytest.mark.slow
@pytest.mark.parametrize("database", ["sqlite"], indirect=True)
@pytest.mark.usefixtures("example_tables")
def test_two_workers_call_the_partner_at_most_20_times_a_second(
        db_url: str, processes: Processes, tmp_path: Path) -> None:
    log = tmp_path / "calls.log"
    env = {**os.environ, "RATE_DATABASE_URL": db_url, "RATE_LOG": str(log),
           "PYTHONPATH": str(EXAMPLES / "rate_limits")}
    done = subprocess.run(
        [sys.executable, "-c", "import rate_app\n"
         f"for n in range({CALLS}): rate_app.call_partner.delay(n)"],
        cwd=EXAMPLES / "rate_limits", env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    workers = processes.workers("rate_app", ["w1", "w2"], env, args=["-Q", "partner"])
    wait_until(lambda: len(calls(log)) >= CALLS, 60, "every call", alive=workers)
    times = calls(log)
    assert len(times) == CALLS
    assert most_in_any(times, 1.0) <= 20 + 2 * 4  # a window's 4 tokens either side
    assert max(times) - min(times) >= (CALLS - 20) / 20
    guide = (DOCS / "rate-limits.rst").read_text()
    assert '"queues": {"partner": {"rate_limit": "20/s"}}' in (
        EXAMPLES / "rate_limits" / "rate_app.py").read_text()
    assert "examples/rate_limits/rate_app.py" in guide


@pytest.mark.slow
@pytest.mark.parametrize("database", ["sqlite"], indirect=True)
@pytest.mark.usefixtures("example_tables")
def test_two_workers_keep_a_tasks_own_rate_limit_and_leave_the_other_task_alone(
        db_url: str, processes: Processes, tmp_path: Path) -> None:
    """``global_rate_limits(app)``: ``call_api``'s own ``rate_limit="10/s"`` holds for
    both workers together; thumbnails in the same queue run as they come."""
    log = tmp_path / "calls.log"
    env = {**os.environ, "RATE_DATABASE_URL": db_url, "RATE_LOG": str(log),
           "PYTHONPATH": str(EXAMPLES / "rate_limits")}
    done = subprocess.run(
        [sys.executable, "-c", "import task_rate_app as t\n"
         f"for n in range({CALLS}): t.call_api.delay(n); t.make_thumbnail.delay(n)"],
        cwd=EXAMPLES / "rate_limits", env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    workers = processes.workers("task_rate_app", ["w1", "w2"], env)

    def runs(task: str) -> list[float]:
        lines = log.read_text().splitlines() if log.exists() else []
        return sorted(float(line.split()[1]) for line in lines if line.split()[0] == task)

    wait_until(lambda: len(runs("call_api")) >= CALLS, 60, "every call", alive=workers)
    calls, thumbnails = runs("call_api"), runs("make_thumbnail")
    assert len(calls) == len(thumbnails) == CALLS
    assert most_in_any(calls, 1.0) <= 10 + 2 * 2  # a window's 2 tokens either side
    assert calls[-1] - calls[0] >= (CALLS - 10) / 10
    assert thumbnails[-1] - thumbnails[0] < (calls[-1] - calls[0]) / 2
    example = (EXAMPLES / "rate_limits" / "task_rate_app.py").read_text()
    assert "global_rate_limits(app)" in example and '@app.task(rate_limit="10/s")' in example
    assert "examples/rate_limits/task_rate_app.py" in (DOCS / "rate-limits.rst").read_text()
