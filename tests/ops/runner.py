"""The operations commands run in the test's process, as a shell would run them: an
``argv`` of ``celery ...`` (Celery's own click group, its plugins found through the
``celery.commands`` entry points) or of ``sqlinbox ...`` (the console script's group),
with its environment, its standard input, and its exit status, standard output and
standard error returned as :func:`subprocess.run` returns them.

A command costs milliseconds here where a subprocess spends one or two seconds importing
Celery, and the operations tests run hundreds. What a process's end would clean away is
undone after each command: the environment (Celery's group writes ``CELERY_*`` into it),
``sys.path``, the app modules (imported afresh each time, as they read the environment
when imported), Celery's current app, and the brokers and result stores the command
opened. A traceback a command lets escape is written to standard error, as the
interpreter would. tests/ops/test_entry_point.py runs the real console scripts.
"""

from __future__ import annotations

import os
import subprocess
import sys
import traceback
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import click
from celery import Celery, _state
from celery.bin.celery import celery
from click.testing import CliRunner

from celery_ext.ops_cli import main
from kombu_sqlinbox import brokers, results

#: the programs an ``argv`` may start with: their click group and how its script calls it
PROGRAMS: dict[str, tuple[click.Command, dict[str, Any]]] = {
    "celery": (celery, {"auto_envvar_prefix": "CELERY"}),
    "sqlinbox": (main, {}),
}
#: the modules a command imports afresh (they read the environment when imported)
FRESH = ("tests.ops.apps",)


def invoke(argv: Sequence[str], env: Mapping[str, str] | None = None, stdin: str = "",
           path: Sequence[str | Path] = (), fresh: Sequence[str] = FRESH
           ) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` (``celery ...`` or ``sqlinbox ...``) with ``env`` added to the
    environment and ``path`` put first on ``sys.path``; the modules ``fresh`` are
    imported afresh by the command and forgotten after it."""
    program, *args = argv
    command, extra = PROGRAMS[program]
    with isolated(env or {}, path, fresh):
        done = CliRunner().invoke(command, args, input=stdin, prog_name=program, **extra)
    stderr = done.stderr
    if done.exception is not None and not isinstance(done.exception, SystemExit):
        # what the interpreter prints of an exception nothing caught
        stderr += "".join(traceback.format_exception(done.exception))
    return subprocess.CompletedProcess(list(argv), done.exit_code, done.stdout, stderr)


@contextmanager
def isolated(env: Mapping[str, str], path: Sequence[str | Path], fresh: Sequence[str]
             ) -> Iterator[None]:
    """Undo, on the way out, what a process's end would have."""
    environ, sys_path = dict(os.environ), list(sys.path)
    modules = {name: forget(name) for name in fresh}
    current, default = _state._tls.current_app, _state.default_app
    opened = {id(b) for b in brokers._BROKERS.values()}
    stores = {id(s) for s in results._STORES.values()}
    os.environ.update(env)
    sys.path[:0] = [str(entry) for entry in path]
    try:
        yield
    finally:
        for name, module in modules.items():
            app = getattr(forget(name), "app", None)
            if isinstance(app, Celery):
                app.close()
            if module is not None:
                sys.modules[name] = module
                parent, _, attribute = name.rpartition(".")
                if parent:
                    setattr(sys.modules[parent], attribute, module)
        _state._tls.current_app, _state.default_app = current, default
        _close_new(brokers._BROKERS, opened, brokers._BROKERS_LOCK)
        _close_new(results._STORES, stores, results._STORES_LOCK)
        sys.path[:] = sys_path
        os.environ.clear()
        os.environ.update(environ)


def forget(name: str) -> ModuleType | None:
    """Take module ``name`` out of ``sys.modules`` and off its package (where Celery's
    ``-A package.module`` looks first), so that the next import runs it again."""
    module = sys.modules.pop(name, None)
    parent, _, attribute = name.rpartition(".")
    if parent in sys.modules and hasattr(sys.modules[parent], attribute):
        delattr(sys.modules[parent], attribute)
    return module


def _close_new(registry: dict[Any, Any], before: set[int], lock: Any) -> None:
    """Close and forget the entries of a process's registry opened since ``before``."""
    with lock:
        new = {key: value for key, value in registry.items() if id(value) not in before}
        for key in new:
            del registry[key]
    for value in new.values():
        value.close()
