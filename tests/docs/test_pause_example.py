"""The pausing guide's example (docs/pause.rst, examples/pause): a real worker runs the
e-mails until ``sqlinbox pause`` stops them, ``queues`` shows the pause, the e-mails sent
meanwhile wait, and the example's own API call resumes them."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy.engine import Engine

from tests.databases import drop_tables
from tests.processes import Processes, wait_until

from .support import DOCS, EXAMPLES

PREFIX = "pause_"
#: how long the test watches for a run that must not come (a wake-up's bound, and more)
WATCH = 2.0


@pytest.fixture
def example_tables(engine: Engine) -> Iterator[None]:
    drop_tables(engine, PREFIX)
    yield
    drop_tables(engine, PREFIX)


def sent(log: Path) -> list[int]:
    return [int(line) for line in log.read_text().split()] if log.exists() else []


@pytest.mark.slow
@pytest.mark.parametrize("database", ["sqlite"], indirect=True)
@pytest.mark.usefixtures("example_tables")
def test_a_paused_queue_waits_until_the_api_resumes_it(db_url: str, processes: Processes,
                                                        tmp_path: Path) -> None:
    log = tmp_path / "sent.log"
    env = {**os.environ, "PAUSE_DATABASE_URL": db_url, "PAUSE_LOG": str(log),
           "PYTHONPATH": str(EXAMPLES / "pause")}

    def run(*argv: str) -> str:
        done = subprocess.run([sys.executable, *argv], cwd=EXAMPLES / "pause", env=env,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    def send(numbers: range) -> None:
        run("-c", "import pause_app\n"
            f"for n in {numbers!r}: pause_app.send_email.delay(n)")

    worker = processes.worker("pause_app", "w1", env, pool="solo")
    send(range(3))
    wait_until(lambda: sorted(sent(log)) == [0, 1, 2], 30, "three e-mails", alive=[worker])
    said = run("-m", "celery", "-A", "pause_app", "sqlinbox", "pause", "emails",
               "--reason", "SMTP relay down")
    assert said.startswith("paused emails: since "), said
    send(range(3, 6))
    time.sleep(WATCH)
    assert sorted(sent(log)) == [0, 1, 2]
    queues = run("-m", "celery", "-A", "pause_app", "sqlinbox", "queues")
    assert queues.splitlines()[1].split()[:2] == ["emails", "3"], queues
    assert queues.splitlines()[1].split()[-1] == "PAUSED"
    assert "by " in queues and ": SMTP relay down" in queues
    run("-c", "import pause_app; pause_app.resume_when_the_mail_server_answers()")
    wait_until(lambda: sorted(sent(log)) == list(range(6)), 30, "the e-mails sent while "
               "paused", alive=[worker])
    assert "celery -A pause_app sqlinbox pause emails" in (DOCS / "pause.rst").read_text()
