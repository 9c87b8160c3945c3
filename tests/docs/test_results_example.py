"""The results guide's example (docs/results.rst, examples/results) runs as the guide
says on every database: a worker stores results in the database its queues are in."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
from sqlalchemy.engine import Engine

from tests.databases import drop_tables

from .support import EXAMPLES, ROOT

#: the example's table prefix (its queues and its results)
PREFIX = "results_"


@pytest.fixture
def example_tables(engine: Engine) -> Iterator[None]:
    drop_tables(engine, PREFIX)
    yield
    drop_tables(engine, PREFIX)


@pytest.mark.slow
@pytest.mark.usefixtures("example_tables")
def test_the_results_example_prints_what_the_guide_shows(db_url: str) -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "results" / "run.py")], cwd=ROOT, capture_output=True,
        text=True, timeout=120, env={**os.environ, "RESULTS_DATABASE_URL": db_url})
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines() == [
        "add(2, 3) -> 5 (task results_app.add on celery@...)",
        "charge(7, 0) -> FAILURE: order 7: nothing to charge",
        "group restored by its id -> charged [10, 20, 30]",
        "add(2, 3) forgotten -> PENDING",
        "worker stopped (exit status 0)",
    ], done.stdout + done.stderr
