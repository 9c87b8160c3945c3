"""The unique tasks guide's example (docs/unique.rst, examples/unique): three sends of one
contact's sync queue one task and return its id each time; a real worker runs it once, and
then the key is free for the next sync."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import inspect, text
from sqlalchemy.engine import Engine

from tests.databases import drop_tables
from tests.processes import Processes, wait_until

from .support import EXAMPLES

PREFIX = "unique_"


def send_three(env: dict[str, str], contact: int) -> list[str]:
    """Run the example's script: three sends of one contact's sync, the ids they return."""
    done = subprocess.run([sys.executable, "unique_app.py", str(contact)],
                          cwd=EXAMPLES / "unique", env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout.split()


def waiting(engine: Engine) -> int:
    """The rows of the example's queue (none before the first send made its table)."""
    with engine.connect() as conn:
        if not inspect(conn).has_table(f"{PREFIX}celery"):
            return 0
        return int(conn.execute(text(f"SELECT COUNT(*) FROM {PREFIX}celery")).scalar_one())


def runs(log: Path) -> list[list[str]]:
    return [line.split() for line in log.read_text().splitlines()] if log.exists() else []


@pytest.mark.slow
@pytest.mark.parametrize("database", ["sqlite"], indirect=True)
def test_a_contact_sync_sent_three_times_runs_once(db_url: str, engine: Engine,
                                                     processes: Processes,
                                                     tmp_path: Path) -> None:
    log = tmp_path / "syncs.log"
    env = {**os.environ, "UNIQUE_DATABASE_URL": db_url, "UNIQUE_LOG": str(log),
           "PYTHONPATH": str(EXAMPLES / "unique")}
    try:
        for name in ("w1", "w2"):
            sent = send_three(env, 7)
            assert len(sent) == 3 and len(set(sent)) == 1, sent
            worker = processes.workers("unique_app", [name], env, pool="solo")[0]
            wait_until(lambda sent=sent: [run[1] for run in runs(log)][-1:] == sent[:1], 30,
                       f"the sync {sent[0]} to run", alive=[worker])
            # acknowledged (late, after the run) before the worker is told to stop
            wait_until(lambda: waiting(engine) == 0, 30, "the sync's ack", alive=[worker])
            worker.terminate()
            assert worker.wait(30) == 0
        assert len(runs(log)) == 2, "each sync ran once"
        assert runs(log)[0][1] != runs(log)[1][1], "the key was free again once it had run"
    finally:
        drop_tables(engine, PREFIX)
