"""Real processes for tests and the soak (``bench/soak.py``): started in a session of their
own, so a whole worker (main process and pool) can be killed as one group, with their
output in a log file; the group of them one test starts (:class:`Processes`); and the
bounded wait every caller polls with."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
#: how long a worker may take to say "ready." / to finish a warm shutdown
START_LIMIT = 60.0
STOP_LIMIT = 30.0


def wait_until(
    predicate: Callable[[], Any], timeout: float, what: str,
    alive: Sequence[Proc] = (), interval: float = 0.1,
) -> Any:
    """Poll ``predicate`` until it is truthy and return its value; raise naming ``what`` on
    timeout, or as soon as one of the ``alive`` processes has exited."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        for proc in alive:
            if proc.popen.poll() is not None:
                raise AssertionError(
                    f"waiting for {what}: {proc.name} exited with {proc.popen.returncode}\n"
                    f"{proc.tail()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


class Proc:
    """A child process in its own session with its output in a log file."""

    def __init__(self, name: str, argv: Sequence[str], env: dict[str, str], log: Path,
                 cwd: Path = ROOT) -> None:
        self.name = name
        self.log = log
        with log.open("wb") as out:
            self.popen = subprocess.Popen(
                list(argv), cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def tail(self, lines: int = 60) -> str:
        return "\n".join(self.output().splitlines()[-lines:])

    def wait(self, timeout: float) -> int:
        """The exit status; kill the group and fail when it does not come in time."""
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(
                f"{self.name} did not exit within {timeout:.0f}s\n{self.tail()}") from None
        finally:
            self.kill_group()

    def terminate(self) -> None:
        """SIGTERM: Celery's warm shutdown."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = STOP_LIMIT) -> int:
        """SIGTERM and a bounded wait for the exit status."""
        self.terminate()
        return self.wait(timeout)

    def kill(self) -> None:
        """``kill -9`` of the whole process group: the main process and any pool children."""
        self.kill_group()
        self.popen.wait(10)

    def kill_group(self) -> None:
        """SIGKILL to whatever is left of the group (pool children outliving their parent)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGKILL)


def worker_ready(proc: Proc) -> bool:
    """Celery logs ``<name>@<host> ready.`` once it consumes."""
    out = proc.output()
    return f"{proc.name}@" in out and " ready." in out


def worker_argv(app: str, pool: str, concurrency: int) -> list[str]:
    """``celery -A app worker`` with a pool, logging at info (for "ready."), without the
    gossip, mingle and heartbeat the sqlinbox transport does not serve."""
    argv = [sys.executable, "-m", "celery", "-A", app, "worker", "-P", pool,
            "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "info"]
    return argv if pool == "solo" else [*argv, "-c", str(concurrency)]


class Processes:
    """The processes a test (or a fixture shared by tests) starts, with their logs in ``tmp``:
    every one is killed at the end, and a failed test prints their output."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[Proc] = []

    def spawn(self, name: str, argv: Sequence[str], env: Mapping[str, str] | None = None
              ) -> Proc:
        """``argv`` with ``env`` over this process's environment and the repository on the
        import path; its output goes to ``<tmp>/<name>.log``."""
        full = {**os.environ, **(env or {})}
        full["PYTHONPATH"] = os.pathsep.join(
            path for path in (full.get("PYTHONPATH", ""), str(ROOT)) if path)
        proc = Proc(name, argv, full, self.tmp / f"{name}.log")
        self.procs.append(proc)
        return proc

    def workers(self, app: str, names: Sequence[str], env: Mapping[str, str] | None = None,
                pool: str = "prefork", concurrency: int = 2, args: Sequence[str] = ()
                ) -> list[Proc]:
        """Real ``celery -A app worker`` processes (``args``: more options) started together,
        returned once all are ready; one that exits first fails the wait."""
        argv = [*worker_argv(app, pool, concurrency), *args]
        started = [self.spawn(name, [*argv, "-n", f"{name}@%h"], env) for name in names]
        for proc in started:
            wait_until(partial(worker_ready, proc), START_LIMIT,
                       f"worker {proc.name} to be ready", alive=started)
        return started

    def worker(self, app: str, name: str = "w1", env: Mapping[str, str] | None = None,
               pool: str = "prefork", concurrency: int = 2, args: Sequence[str] = ()) -> Proc:
        """One :meth:`workers`."""
        return self.workers(app, [name], env, pool, concurrency, args)[0]

    def kill(self) -> None:
        """``kill -9`` every group still running (before dropping what they use)."""
        for proc in self.procs:
            proc.kill()

    def close(self, failed: bool) -> None:
        """Kill them all; when the test ``failed``, print the end of each one's output."""
        self.kill()
        if failed:
            for proc in self.procs:
                print(f"\n===== {proc.name} ({proc.log}) =====\n{proc.tail(200)}")
