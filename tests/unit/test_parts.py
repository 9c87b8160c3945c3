"""The suite's parts (``tests/parts.py``): every test file belongs to a part the suite runs,
and a test that restarts a server cannot run beside other parts."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest

from tests.parts import EXCLUSIVE, ROOT, SHARED, SHARED_ENV, call, main, part_commands
from tests.servers import restart_server


def pytest_paths(name: str) -> tuple[set[Path], set[Path]]:
    """The paths a part's pytest commands collect, and the paths they ignore."""
    collected: set[Path] = set()
    ignored: set[Path] = set()
    for argv in part_commands(name):
        if argv[0] != "pytest":
            continue
        words = iter(argv[1:])
        for word in words:
            if word == "--ignore":
                ignored.add(ROOT / next(words))
            elif word.startswith("tests"):
                collected.add(ROOT / word)
    return collected, ignored


def test_every_test_file_runs_in_a_part_of_the_suite() -> None:
    parts = [pytest_paths(name) for name in (*SHARED, *EXCLUSIVE)]
    uncovered = [
        str(path.relative_to(ROOT)) for path in sorted((ROOT / "tests").rglob("test_*.py"))
        if not any(any(path.is_relative_to(root) for root in collected)
                   and not any(path.is_relative_to(skip) for skip in ignored)
                   for collected, ignored in parts)
    ]
    assert uncovered == []


def test_the_restart_tests_run_only_in_the_exclusive_part() -> None:
    restart = ROOT / "tests/acceptance/test_restart.py"
    holding = [name for name in SHARED
               if any(restart.is_relative_to(root) for root in pytest_paths(name)[0])
               and restart not in pytest_paths(name)[1]]
    assert holding == []
    assert EXCLUSIVE == ("restart",) and pytest_paths("restart")[0] == {restart}


def test_a_server_restart_is_refused_beside_other_parts(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SHARED_ENV, "1")
    with pytest.raises(AssertionError, match="would fail the parts running beside"):
        restart_server("postgresql", "postgresql://nobody@127.0.0.1:1/none")


def test_an_unknown_part_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["acceptence"])
    assert exited.value.code == 2
    assert "unknown part(s): acceptence" in capsys.readouterr().err


def test_a_commands_status_and_the_processor_time_of_its_waited_children_are_reported() -> None:
    """A part's processor seconds count the children its command waited for (a worker's
    pool), so a part that computes is told from one that waits."""
    child = "import time\nend = time.process_time() + 0.4\nwhile time.process_time() < end: pass"
    parent = ("import subprocess, sys, time; subprocess.run([sys.executable, '-c', sys.argv[1]]); "
              "time.sleep(0.3); sys.exit(3)")
    with tempfile.TemporaryFile(mode="w+") as log:
        status, cpu = call([sys.executable, "-c", parent, child], dict(os.environ), log)
    assert status == 3
    assert 0.4 <= cpu < 2.0
