"""The package as people install it: the work tree copied as a fresh clone has it, and the
getting-started guide's own install commands run there once per session (a fresh
virtualenv, ``python -m build``, the wheel installed from ``dist/``), for every test here."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.package.guide import code_blocks, commands
from tests.processes import ROOT, Proc

GUIDE = ROOT / "docs" / "getting-started.rst"
#: building the sdist and wheel and installing the wheel with its dependencies
INSTALL_LIMIT = 600.0
#: what a reader's shell does not have: this test run's virtualenv and import path
_NOT_A_READERS = ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")


@dataclass(frozen=True)
class Installed:
    """A clone with ``dist/`` built and the wheel installed in its ``.venv``."""

    clone: Path
    #: the repository's files, as ``git ls-files`` names them (the clone has these only)
    files: frozenset[str]
    #: seconds the guide's install commands took
    seconds: float

    @property
    def venv(self) -> Path:
        return self.clone / ".venv"

    def dist(self, suffix: str) -> Path:
        """The one file in ``dist/`` whose name ends with ``suffix``."""
        (found,) = self.clone.glob(f"dist/*{suffix}")
        return found

    def argv(self, command: str) -> list[str]:
        """``command`` as a reader runs it: in bash, with the virtualenv activated."""
        return ["bash", "-c", f". {self.venv}/bin/activate && {command}"]

    def run(self, command: str, cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.argv(command), cwd=cwd, env=readers_env(), text=True,
                              capture_output=True, timeout=timeout, stdin=subprocess.DEVNULL)

    def start(self, name: str, command: str, cwd: Path, log: Path) -> Proc:
        """``command`` left running (a worker), its output in ``log``."""
        return Proc(name, self.argv(command), readers_env(), log, cwd=cwd)


def readers_env() -> dict[str, str]:
    return {name: value for name, value in os.environ.items() if name not in _NOT_A_READERS}


def repository_files() -> list[str]:
    """What a fresh clone of the work tree holds: tracked files as they are now, and new
    ones not ignored."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
        capture_output=True, check=True).stdout.decode().split("\0")
    return sorted(name for name in listed if name and os.path.lexists(ROOT / name))


@pytest.fixture(scope="session")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    """The guide's install block, run as one shell session in a copy of the work tree."""
    clone = tmp_path_factory.mktemp("clone")
    files = repository_files()
    for name in files:
        (clone / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, clone / name, follow_symlinks=False)
    (block,) = code_blocks(GUIDE, "Install", "console")
    script = " && ".join(command.line for command in commands(block))
    started = time.monotonic()
    done = subprocess.run(["bash", "-c", script], cwd=clone, env=readers_env(), text=True,
                          capture_output=True, timeout=INSTALL_LIMIT, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, f"{script}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return Installed(clone, frozenset(files), time.monotonic() - started)
