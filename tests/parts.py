"""Run the suite's parts side by side: ``python -m tests.parts`` (what ``tox -e suite``
runs).

Each part is a ``[testenv:NAME]`` of ``tox.ini`` and runs its commands there, so a part
run alone (``tox -e ops``) and a part run here are the same commands. Most of the suite
waits (on real workers, leases, a server's reply) rather than computes, so on two cores
several parts at once finish well before one after the other: they share the servers as
separate users would, every test under a table prefix and queue names of its own. A part
that restarts a database server takes the servers away from everyone: it runs alone,
after the others (``EXCLUSIVE``), and :func:`tests.servers.restart_server` refuses to run
while :data:`SHARED_ENV` says other parts are running beside it.

Each part's output is printed whole when it ends (never interleaved), then a table of
every part's time, the processor time its processes used, and its result; the exit status
is non-zero when any part failed. The processor time against the seconds says how much
a part waits: what :data:`JOBS` is chosen by.
"""

from __future__ import annotations

import argparse
import configparser
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import IO

ROOT = Path(__file__).resolve().parents[1]
#: set for a part that runs beside others: a test must not take a server away
SHARED_ENV = "SQLINBOX_TEST_SHARED_MACHINE"
#: the parts that run side by side, the longest first (by a whole run's seconds, three at
#: a time: acceptance 544, results 414, mysql 355, postgresql 347, remote 279, ordering
#: 235, ops 217, sqlite 199, frameworks 121, drivers 117, docs 116, outbox 104, startup
#: 83, transactional 80, package 44, browser 26, type 8, unit 4) so the short ones fill
#: in behind: a long part started late is the run's last for minutes after the others
SHARED = ("acceptance", "results", "mysql", "postgresql", "remote", "ordering", "ops",
          "sqlite", "frameworks", "drivers", "docs", "outbox", "startup", "transactional",
          "package", "browser", "type", "unit")
#: the parts that must have the machine to themselves (they restart a database server)
EXCLUSIVE = ("restart",)
#: parts at once, on two cores: a part's processes use a third to a half of one core
#: (a part's processor seconds against its seconds in a whole run: results 0.31, outbox
#: 0.31, sqlite 0.39, ordering 0.5, docs 0.53), the rest is waiting on workers, leases
#: and servers; four at once keep both cores about as busy as the servers beside them
#: allow, a fifth only slows the others down
JOBS = 4


@dataclass
class Outcome:
    """One part's run: its name, exit status, seconds, processor seconds and whole output."""

    name: str
    status: int
    seconds: float
    output: str
    cpu: float

    @property
    def summary(self) -> str:
        """The part's last non-empty line (pytest's count of passed and failed)."""
        lines = [line for line in self.output.splitlines() if line.strip()]
        return lines[-1].strip("= ") if lines else ""


def part_commands(name: str, tox_ini: Path = ROOT / "tox.ini") -> list[list[str]]:
    """The commands of ``[testenv:NAME]``, as tox runs them with no positional arguments."""
    config = configparser.ConfigParser(interpolation=None)
    config.read(tox_ini)
    section = f"testenv:{name}"
    if not config.has_option(section, "commands"):
        raise SystemExit(f"tox.ini has no commands for part {name!r}")
    lines = config.get(section, "commands").replace("{posargs}", "").splitlines()
    return [shlex.split(line) for line in lines if line.strip()]


def run_part(name: str, shared: bool) -> Outcome:
    """Run one part's commands one after the other, stopping at the first that fails."""
    env = dict(os.environ)
    # the commands of this interpreter's environment, as tox puts them first on the PATH
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    if shared:
        env[SHARED_ENV] = "1"
    started = time.monotonic()
    status = 0
    cpu = 0.0
    with tempfile.TemporaryFile(mode="w+") as log:
        for argv in part_commands(name):
            log.write(f"$ {shlex.join(argv)}\n")
            log.flush()
            status, used = call(argv, env, log)
            cpu += used
            if status:
                break
        log.seek(0)
        output = log.read()
    return Outcome(name, status, time.monotonic() - started, output, cpu)


def call(argv: list[str], env: dict[str, str], log: IO[str]) -> tuple[int, float]:
    """Run one command; its exit status and the processor seconds it and the children it
    waited for used (a worker's pool processes, not those a test killed outright)."""
    with subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log,
                          stderr=subprocess.STDOUT) as proc:
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, usage.ru_utime + usage.ru_stime


def report(outcome: Outcome) -> None:
    """Print one finished part's whole output under a heading naming it."""
    verdict = "passed" if outcome.status == 0 else f"FAILED (exit {outcome.status})"
    print(f"\n===== part {outcome.name}: {verdict} in {outcome.seconds:.0f} s =====",
          flush=True)
    print(outcome.output, end="", flush=True)


def run_shared(names: Sequence[str], jobs: int) -> list[Outcome]:
    """Run ``names`` with ``jobs`` of them at a time, reporting each as it ends."""
    outcomes: list[Outcome] = []
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        pending: set[Future[Outcome]] = {pool.submit(run_part, name, jobs > 1)
                                         for name in names}
        while pending:
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            for future in done:
                outcomes.append(future.result())
                report(outcomes[-1])
    return outcomes


def table(outcomes: Sequence[Outcome], wall: float) -> str:
    """Every part's seconds, processor seconds and result, and the run's wall time
    against their sum."""
    rows = [f"{'part':<12} {'seconds':>8} {'cpu':>6}  result"]
    rows += [f"{o.name:<12} {o.seconds:>8.0f} {o.cpu:>6.0f}  "
             f"{'ok' if o.status == 0 else 'FAILED'}: {o.summary}" for o in outcomes]
    rows.append(f"{'wall':<12} {wall:>8.0f} {sum(o.cpu for o in outcomes):>6.0f}  "
                f"(the parts' sum: {sum(o.seconds for o in outcomes):.0f} s)")
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("parts", nargs="*", help="parts to run (default: all)")
    parser.add_argument("-j", "--jobs", type=int, default=JOBS,
                        help=f"parts at once (default {JOBS}; 1 runs them one by one)")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error("--jobs must be at least 1")
    chosen = args.parts or [*SHARED, *EXCLUSIVE]
    unknown = sorted(set(chosen) - {*SHARED, *EXCLUSIVE})
    if unknown:
        parser.error(f"unknown part(s): {', '.join(unknown)}")
    started = time.monotonic()
    outcomes = run_shared([name for name in SHARED if name in chosen], args.jobs)
    for name in (name for name in EXCLUSIVE if name in chosen):
        outcomes.append(run_part(name, shared=False))
        report(outcomes[-1])
    print("\n" + table(outcomes, time.monotonic() - started), flush=True)
    return 1 if any(o.status for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
