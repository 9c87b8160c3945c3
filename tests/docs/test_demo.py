"""README command one: the demo runs a real worker on SQLite and exits 0 by itself."""

from __future__ import annotations

import subprocess
import sys

import pytest

from .support import EXAMPLES, ROOT


@pytest.mark.slow
def test_demo_runs_and_accounts_for_every_task() -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "demo" / "run.py")], cwd=ROOT, capture_output=True,
        text=True, timeout=90,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    for line in (
        "add(2, 2)                -> 4",
        "add(40, 2)               -> 42",
        "parse_order('1234')      -> 1234",
        "remind(countdown=3)      -> {'note': 'water the plants', 'ran_after': ",
        "parse_order('twelve')    -> FAILURE: reject requeue=False: not an order number",
        "dead-letter queue 'celery.parked':",
        "demo_app.parse_order('twelve',) from queue 'celery' after 1 attempt(s): "
        "rejected without requeue by the consumer",
        "worker stopped (exit status 0)",
    ):
        assert line in out, out
    ran_after = float(out.split("'ran_after': ")[1].split("}")[0])
    assert ran_after >= 3.0, out
