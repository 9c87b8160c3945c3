"""A worker that cannot start for a user's mistake says so in one line and exits 1: the
mistake named (with the closest option for a typo), no traceback of Celery's start-up."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.processes import START_LIMIT

APP = '''from celery import Celery
app = Celery("app", broker={broker!r})
app.conf.broker_transport_options = {options!r}
'''


@pytest.mark.parametrize(("broker", "options", "said"), [
    ("sqlinbox+sqlite:///{tmp}/q.db", {"visiblity_timeout": 5},
     "Error: unknown transport option 'visiblity_timeout'; did you mean "
     "'visibility_timeout'?"),
    ("sqlinbox+sqlite:///{tmp}/q.db", {"queues": {"celery": {"max_atempts": 3}}},
     "Error: unknown transport option \"queues['celery'].max_atempts\"; did you mean "
     "'max_attempts'?"),
    ("sqlinbox+sqlite:///{tmp}/q.db", {"polling_interval": 0},
     "Error: transport option polling_interval=0:"),
])
def test_a_worker_with_a_configuration_mistake_says_it_in_one_line(
        tmp_path: Path, broker: str, options: dict[str, object], said: str) -> None:
    (tmp_path / "app.py").write_text(APP.format(broker=broker.format(tmp=tmp_path),
                                                options=options))
    done = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "app", "worker", "--pool", "solo"],
        cwd=tmp_path, capture_output=True, text=True, timeout=START_LIMIT,
        env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and errors[0].startswith(said), done.stderr
