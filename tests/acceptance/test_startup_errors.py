"""A worker that cannot start for a user's mistake says so in one line and exits 1: the
mistake named (with the closest option for a typo), no traceback of Celery's start-up.
An unreachable database is retried as Celery retries any broker, then given up in two
lines. ``-l debug`` keeps the traceback."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.processes import START_LIMIT

APP = '''from celery import Celery
app = Celery("app", broker={broker!r})
app.conf.broker_transport_options = {options!r}
app.conf.broker_connection_retry_on_startup = True
app.conf.broker_connection_max_retries = 1
'''
SECRET = "s3cret-never-shown"


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


def dead_port() -> int:
    """A port of this host nothing listens on (one just freed by the system)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def start_worker(tmp_path: Path, broker: str, options: dict[str, object], *args: str
                 ) -> subprocess.CompletedProcess[str]:
    """A real ``celery worker`` of an app on ``broker``, run until it exits by itself."""
    (tmp_path / "app.py").write_text(APP.format(broker=broker, options=options))
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", "app", "worker", "--pool", "solo",
         "--without-gossip", "--without-mingle", "--without-heartbeat", *args],
        cwd=tmp_path, capture_output=True, text=True, timeout=START_LIMIT,
        env={**os.environ, "PYTHONPATH": str(tmp_path)})


#: a broker URL nothing answers at, and what the driver says of it
UNREACHABLE: dict[str, tuple[Callable[[Path], str], str]] = {
    "postgresql": (lambda tmp: f"sqlinbox+postgresql://app:{SECRET}@127.0.0.1:{dead_port()}"
                               "/test", "Connection refused"),
    "mysql": (lambda tmp: f"sqlinbox+mysql+pymysql://app:{SECRET}@127.0.0.1:{dead_port()}"
                          "/test", "Connection refused"),
    "sqlite-no-directory": (lambda tmp: f"sqlinbox+sqlite:///{tmp}/missing/q.db",
                            "unable to open database file"),
    "sqlite-under-a-file": (lambda tmp: f"sqlinbox+sqlite:///{tmp}/app.py/q.db",
                            "unable to open database file"),
}


@pytest.mark.parametrize("kind", UNREACHABLE)
def test_a_worker_whose_database_is_unreachable_retries_then_says_it_in_two_lines(
        tmp_path: Path, kind: str) -> None:
    url, reason = UNREACHABLE[kind]
    broker = url(tmp_path)
    shown = broker.replace(SECRET, "**")
    done = start_worker(tmp_path, broker, {}, "-l", "info")
    out = done.stderr + done.stdout
    assert done.returncode == 1, out
    assert "Traceback" not in out and SECRET not in out, out
    # Celery's retries stay (broker_connection_max_retries = 1): the driver's reason, one line
    retried = [line for line in out.splitlines() if "consumer: Cannot connect to" in line]
    assert len(retried) == 1 and all(f"{shown}: " in line and reason in line
                                     for line in retried), out
    assert "Trying again in 2.00 seconds... (1/1)" in out, out
    # then two lines: what is wrong (the URL with its password masked), what to do
    last, advice = done.stderr.rstrip().splitlines()[-2:]  # the log; the banner: stdout
    assert (f"CRITICAL/MainProcess] cannot connect to the broker database {shown}: "
            in last and reason in last), out
    assert advice.startswith("Check that the database server is running" if "sqlite" not in kind
                             else "Check that the file's directory exists"), out
    assert advice.endswith("(-l debug shows the traceback)"), out


@pytest.mark.parametrize("kind", ["postgresql", "sqlite-no-directory"])
def test_a_worker_logging_at_debug_shows_the_traceback(tmp_path: Path, kind: str) -> None:
    url, reason = UNREACHABLE[kind]
    done = start_worker(tmp_path, url(tmp_path), {}, "-l", "debug")
    out = done.stderr + done.stdout
    assert done.returncode == 1, out
    assert "Unrecoverable error" in out and "Traceback (most recent call last)" in out, out
    assert "DatabaseUnreachable" in out and reason in out and SECRET not in out, out


#: a URL of each kind of database (none need answer: the engine is refused before)
ANY_DATABASE = {
    "postgresql": lambda tmp: f"sqlinbox+postgresql://app:{SECRET}@127.0.0.1:{dead_port()}/test",
    "mysql": lambda tmp: f"sqlinbox+mysql+pymysql://app:{SECRET}@127.0.0.1:{dead_port()}/test",
    "sqlite": lambda tmp: f"sqlinbox+sqlite:///{tmp}/q.db",
}


@pytest.mark.parametrize("kind", ANY_DATABASE)
def test_a_misspelled_engine_option_stops_the_worker_in_one_line(tmp_path: Path,
                                                                  kind: str) -> None:
    done = start_worker(tmp_path, ANY_DATABASE[kind](tmp_path),
                        {"engine_options": {"pool_pre_pingg": True}}, "-l", "info")
    out = done.stderr + done.stdout
    assert done.returncode == 1, out
    assert "Traceback" not in out and "TypeError" not in out, out
    said = [line for line in out.splitlines() if "engine_options" in line]
    assert len(said) == 1 and said[0].endswith(
        "CRITICAL/MainProcess] unknown transport option \"engine_options['pool_pre_pingg']\"; "
        "did you mean 'pool_pre_ping'? (-l debug shows the traceback)"), out
    assert done.stderr.rstrip().endswith(said[0]), out
