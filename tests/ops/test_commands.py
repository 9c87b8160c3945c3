"""The group's plumbing, run as a user runs it: the outbox commands under ``sqlinbox``
(the old ``celery outbox`` still works) in processes of their own, and the refusals of
bad input (in the test's process: :mod:`tests.ops.runner`)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from tests.docs.support import EXAMPLES
from tests.ops.conftest import CLI_LIMIT
from tests.ops.runner import invoke
from tests.processes import ROOT


def run(argv: list[str], env: dict[str, str], cwd: Path = ROOT
        ) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=CLI_LIMIT,
                          env={**os.environ, **env})


def test_outbox_commands_under_sqlinbox_with_progress(tmp_path: Path) -> None:
    database = f"sqlite:///{tmp_path}/shop.db"
    env = {"BROKER_URL": f"sqlinbox+{database}", "DATABASE_URL": database,
           "PYTHONPATH": os.pathsep.join((str(EXAMPLES / "outbox"), str(ROOT)))}
    celery = [sys.executable, "-m", "celery", "-A", "proj"]
    for order in (1, 2):
        sent = run([*celery, "call", "proj.send_receipt", "--args", f"[{order}]"], env)
        assert sent.returncode == 0, sent.stderr
    status = run([*celery, "sqlinbox", "outbox", "status"], env)
    assert status.stdout.startswith("unprocessed: 2\nprocessed: 0\n"), status.stderr
    # on a terminal (script(1) gives it one), with its progress bar
    again = run(["script", "-qec", shlex.join(
        [*celery, "sqlinbox", "outbox", "republish", "--older-than", "0"]), "/dev/null"], env)
    assert re.search(r"republish +\[#+\] +2/2", again.stdout), again.stdout
    assert "\nrepublished: 2\n" in again.stdout.replace("\r", ""), again.stdout
    alias = run([*celery, "outbox", "status"], env)
    assert alias.stdout.startswith("unprocessed: 2\n"), alias.stderr
    pruned = run([*celery, "sqlinbox", "outbox", "prune", "--older-than", "0"], env)
    assert pruned.stdout == "pruned: 0\n", pruned.stderr


def test_bad_input_is_refused_naming_it(tmp_path: Path) -> None:
    url = ["--url", f"sqlite:///{tmp_path}/inbox.db"]
    refusals = {
        "not JSON": [*url, "--transport-options", "{queues", "queues"],
        "unknown transport option 'max_attempt'": [
            *url, "--transport-options", '{"max_attempt": 3}', "queues"],
        "no sqlinbox database": ["queues"],
        "the outbox commands need the app": [*url, "outbox", "status"],
        "no dead letter 7": [
            *url, "--transport-options", '{"dead_letter_queue": "dead"}', "dead", "show", "7"],
        "no dead-letter queue is configured": [*url, "dead", "show", "7"],
        "Invalid value for '--batch': 0 is not in the range x>=1": [
            *url, "dead", "requeue", "--batch", "0"],
        "Invalid value for '--watch': -1.0 is not in the range x>0": [
            *url, "queues", "--watch", "-1"],
        "Invalid value for '--times': 0 is not in the range x>=1": [
            *url, "queues", "--watch", "1", "--times", "0"],
        "Invalid value for '--limit': 0 is not in the range x>=1": [
            *url, "dead", "list", "--limit", "0"],
        "Invalid value for '--older-than': -5.0 is not in the range x>=0": [
            *url, "dead", "purge", "--older-than", "-5"],
    }
    for message, argv in refusals.items():
        done = invoke(["sqlinbox", *argv])
        assert done.returncode in (1, 2) and message in done.stderr, (argv, done.stderr)
    # an app on another broker (tests.ops.apps without its broker URL: memory://)
    done = invoke(["celery", "-A", "tests.ops.apps", "sqlinbox", "queues"])
    assert done.returncode == 2 and "the app's broker is not sqlinbox ('memory://')" in (
        done.stderr), done.stderr


def test_a_database_that_is_down_is_one_line_with_its_password_masked() -> None:
    """Nothing listens on port 1: the operator reads what failed and where, in one line,
    exit status 1; ``--traceback`` shows the whole chain for a bug report."""
    for url in ("postgresql://root:s3cret@127.0.0.1:1/test",
                "mysql://root:s3cret@127.0.0.1:1/test"):
        down = invoke(["sqlinbox", "--url", url, "queues"])
        assert down.returncode == 1, down.stderr
        assert down.stdout == ""
        (line,) = down.stderr.splitlines()
        masked = url.replace("s3cret", "***")
        assert line.startswith(f"Error: the database {masked} failed: "), line
        assert "refused" in line and line.endswith("(--traceback for the details)"), line
        traced = invoke(["sqlinbox", "--url", url, "--traceback", "queues"])
        assert traced.returncode == 1
        assert "Traceback (most recent call last)" in traced.stderr
        assert "s3cret" not in down.stderr


def test_the_outbox_commands_on_a_database_that_is_down_are_one_line(tmp_path: Path) -> None:
    """As the other commands: the outbox's database down is one line naming it (password
    masked), exit status 1, ``--traceback`` for the chain; an app without an outbox is
    a usage error, not a traceback."""
    down = "postgresql://root:s3cret@127.0.0.1:1/test"
    env = {"BROKER_URL": f"sqlinbox+{down}", "DATABASE_URL": down,
           "PYTHONPATH": os.pathsep.join((str(EXAMPLES / "outbox"), str(ROOT)))}
    celery = [sys.executable, "-m", "celery", "-A", "proj"]
    for command in (["sqlinbox", "outbox", "status"], ["sqlinbox", "outbox", "republish"],
                    ["sqlinbox", "outbox", "prune"], ["outbox", "status"]):
        done = run([*celery, *command], env)
        assert done.returncode == 1 and done.stdout == "", (command, done.stderr)
        (line,) = done.stderr.splitlines()
        assert line.startswith("Error: the database postgresql+psycopg://root:***@127.0.0.1:1"
                               "/test failed: "), line
        assert "refused" in line and line.endswith("(--traceback for the details)"), line
    traced = run([*celery, "sqlinbox", "--traceback", "outbox", "status"], env)
    assert traced.returncode == 1 and "Traceback (most recent call last)" in traced.stderr
    no_outbox = {"BROKER_URL": f"sqlinbox+sqlite:///{tmp_path}/inbox.db",
                 "PYTHONPATH": str(ROOT)}
    for command in (["sqlinbox", "outbox", "status"], ["outbox", "status"]):
        done = run([sys.executable, "-m", "celery", "-A", "tests.ops.apps", *command],
                   no_outbox)
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
        assert done.stderr.splitlines()[-1].startswith("Error: no outbox is installed"), (
            done.stderr)


def test_a_password_holding_a_semicolon_is_masked_too() -> None:
    """A ``;`` separates failover URLs only where a URL follows it: one inside a password
    written without percent-encoding (which SQLAlchemy reads) is masked with the rest."""
    for url in ("postgresql://root:s3;cret@127.0.0.1:1/test",
                "mysql+pymysql://root:s3;cret@127.0.0.1:1/test"):
        down = invoke(["sqlinbox", "--url", url, "queues"])
        assert down.returncode == 1, down.stderr
        (line,) = down.stderr.splitlines()
        assert line.startswith(f"Error: the database {url.replace('s3;cret', '***')} failed"), (
            line)
