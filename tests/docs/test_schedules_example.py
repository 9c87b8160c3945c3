"""The schedules guide's example (docs/schedules.rst, examples/schedules): two real
workers each running the database scheduler (``worker -B``) on one database send every
tick of a 1-second schedule once, and the commands show and pause it."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path

import pytest
from sqlalchemy import create_engine, inspect, text
from sqlalchemy.engine import Engine

from tests.databases import drop_tables
from tests.processes import Processes, wait_until

from .support import EXAMPLES

PREFIX = "schedules_"
SCHEDULER = "celery_ext.beat:DatabaseScheduler"


@pytest.fixture
def example_tables(engine: Engine) -> Iterator[None]:
    drop_tables(engine, PREFIX)
    yield
    drop_tables(engine, PREFIX)


def sent_ticks(engine: Engine) -> list[tuple[float, str]]:
    """The heartbeat's ticks sent (none before a scheduler made the tables)."""
    with engine.connect() as conn:
        if not inspect(conn).has_table(f"{PREFIX}schedule_ticks"):
            return []
        return [(float(due), task_id) for due, task_id in conn.execute(text(
            f"SELECT due, task_id FROM {PREFIX}schedule_ticks WHERE name = 'heartbeat' "
            "ORDER BY due"))]


def logged(log: Path) -> list[str]:
    return log.read_text().split() if log.exists() else []


def sqlinbox(env: dict[str, str], *args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "celery", "-A", "schedules_app", "sqlinbox",
                           "schedules", *args], cwd=EXAMPLES / "schedules", env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.mark.slow
@pytest.mark.parametrize("database", ["postgresql"], indirect=True)
@pytest.mark.usefixtures("example_tables")
def test_two_workers_with_beat_send_each_tick_once(db_url: str, processes: Processes,
                                                    tmp_path: Path) -> None:
    log = tmp_path / "heartbeats.log"
    env = {**os.environ, "SCHEDULES_DATABASE_URL": db_url, "SCHEDULES_LOG": str(log),
           "PYTHONPATH": str(EXAMPLES / "schedules")}
    engine = create_engine(db_url)
    workers = processes.workers("schedules_app", ["w1", "w2"], env, pool="solo",
                                args=["-B", "--scheduler", SCHEDULER])
    wait_until(lambda: len(sent_ticks(engine)) >= 6, 30, "six heartbeat ticks",
               alive=workers)
    listed = sqlinbox(env, "list")
    assert "heartbeat" in listed and "every:1" in listed and "enabled" in listed
    assert "paused" not in listed
    assert sqlinbox(env, "pause", "heartbeat").strip() == "heartbeat: paused"
    ticks = sent_ticks(engine)
    ids = [task_id for _, task_id in ticks]
    wait_until(lambda: set(ids) <= set(logged(log)), 30,
               "every tick's task to run", alive=workers)
    for proc in workers:
        proc.terminate()
    for proc in workers:
        proc.wait(30)
    # each tick ran once, and nothing ran that no tick sent
    assert sorted(logged(log)) == sorted(task_id for _, task_id in sent_ticks(engine))
    assert len(set(logged(log))) == len(logged(log))
    dues = [due for due, _ in sent_ticks(engine)]
    assert all(b - a >= 1.0 - 1e-6 for a, b in pairwise(dues)), dues
    engine.dispose()


@pytest.mark.slow
@pytest.mark.parametrize("database", ["sqlite"], indirect=True)
@pytest.mark.usefixtures("example_tables")
def test_celery_beat_runs_the_scheduler_alone(db_url: str, engine: Engine,
                                               processes: Processes, tmp_path: Path) -> None:
    # unbuffered: beat prints its banner to stdout, a file here, where it would wait in
    # the buffer
    env = {"SCHEDULES_DATABASE_URL": db_url, "SCHEDULES_LOG": str(tmp_path / "log"),
           "PYTHONPATH": str(EXAMPLES / "schedules"), "PYTHONUNBUFFERED": "1"}
    beat = processes.spawn("beat", [sys.executable, "-m", "celery", "-A", "schedules_app",
                                    "beat", "-S", SCHEDULER, "-l", "info"], env)
    wait_until(lambda: len(sent_ticks(engine)) >= 2, 30, "two heartbeat ticks",
               alive=[beat])
    assert f". schedules -> table {PREFIX}schedules of the broker's database" in beat.output()
    assert "Scheduler: sent due task heartbeat" in beat.output()
