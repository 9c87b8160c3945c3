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
