"""Celery's own integration suite (its ``t/integration``) on the sqlinbox result backend,
beside Celery's Redis backend.

    python -m bench.celery_integration --celery-src PATH [--runs postgresql,redis-on-postgresql]
        [--tests t/integration] [--timeout 60] [--json FILE] [--compare redis-on-postgresql]

``PATH`` is a copy of Celery's source at the installed version (its sdist, or its
repository at the release's tag): the suite is not installed with Celery. Each run sets
Celery's ``TEST_BROKER`` and ``TEST_BACKEND`` and runs pytest in ``PATH``; the suite starts
its own worker (``celery.contrib.testing``, prefork pool) in the test process. A run's
sqlinbox tables sit under a prefix of their own (``integration-tests-config.json``, which
Celery's conftest reads, sets it while the run lasts) and are dropped after it. Every test
has ``--timeout`` seconds (pytest-timeout; the suite's own ``timeout`` marks stand where it
set them), so a hang costs bounded time; the suite's reruns of its flaky tests (five, a
second apart, of each test failing with an OSError or a TimeoutError) are off unless
``--reruns``, for the same reason. Prints passed/failed/errors/skipped/timeouts and
the wall time per run, then every test that passes on the ``--compare`` run and not on
another. ``--open-redis-gate`` runs the tests the suite gates on a Redis result backend
(most use Redis only as a side channel) on a copy of the suite, ``--only-gated`` only
them. Needs the ``celery-suite`` extra (pytest-timeout, pytest-rerunfailures, pytest-order,
redis).
"""

from __future__ import annotations

import argparse
import ast
import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from functools import partial
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, inspect, text

from kombu_sqlinbox.urls import sqlalchemy_url

POSTGRESQL = os.environ.get("SQLINBOX_BENCH_POSTGRES", "postgresql://root@127.0.0.1/test")
MYSQL = os.environ.get("SQLINBOX_BENCH_MYSQL", "mysql://root@127.0.0.1/test")
REDIS = os.environ.get("SQLINBOX_BENCH_REDIS", "redis://127.0.0.1:6379/0")
#: run name: (broker database, backend); ``{sqlite}`` is a file of the run's own
RUNS = {
    "postgresql": (POSTGRESQL, "sqlinbox+" + POSTGRESQL),
    "mysql": (MYSQL, "sqlinbox+" + MYSQL),
    "sqlite": ("sqlite:///{sqlite}", "sqlinbox+sqlite:///{sqlite}"),
    "redis-on-postgresql": (POSTGRESQL, REDIS),
    "redis-on-mysql": (MYSQL, REDIS),
    "redis-on-sqlite": ("sqlite:///{sqlite}", REDIS),
    "redis": (None, REDIS),  # Redis broker and backend: Celery's reference set-up
}
#: the suite, less the Azure backend's tests (they import Azure's SDK, and skip without its
#: service, ``AZUREBLOCKBLOB_URL``) and the Redis backend's socket leak test (twenty
#: worker start-stop cycles: past the timeout on a shared machine, and the timeout leaves
#: its worker's pool blocking the session; other backends skip it)
TESTS = ("t/integration", "--ignore=t/integration/test_backend.py",
         "--ignore=t/integration/test_backend_leak_in_fixture_teardown.py")
OUTCOMES = ("passed", "failed", "errors", "skipped", "timeouts")
CONFIG = "integration-tests-config.json"
#: the Redis backend's own tests (its keys, its pub/sub): their gate stays shut
OWN = ("test_redis_backend.py",)
OUTCOMES_ENV = "CELERY_SUITE_OUTCOMES"
#: the suite's gate on tests that keep their side channel (``redis_echo``...) in Redis; only
#: its ``if not ...: skip`` form (``test_group_args_and_kwargs`` asks a Redis backend for a
#: weaker assertion with the bare form, which stays)
GATE = re.compile(r"""\bnot\s+(?:\w+\.)?app\.conf\.result_backend\.startswith\("""
                  r"""\(?(['"])redis\1(?:,\s*(['"])rpc\2\))?\)""")


def opened(source: Path, directory: Path) -> Path:
    """A copy of Celery's tree whose tests gated on a Redis *result backend* run whatever
    the backend: they need Redis only for their side channel, which stays Redis."""
    tree = directory / "celery-src"
    if tree.exists():
        return tree
    tree.mkdir()
    for entry in source.iterdir():
        if entry.name != "t":
            (tree / entry.name).symlink_to(entry)
    shutil.copytree(source / "t", tree / "t")
    for path in (tree / "t" / "integration").glob("test_*.py"):
        if path.name not in OWN:
            path.write_text(GATE.sub("False", path.read_text()))
    return tree


def _holds_gate(text: str, node: ast.AST) -> bool:
    return bool(GATE.search(ast.get_source_segment(text, node) or ""))


def gated(source: Path) -> list[str]:
    """The node ids of the tests behind ``GATE``: a test function holding it, or every test
    of a class whose fixture holds it (pytest runs all of a function's parameters)."""
    found = []
    for path in sorted((source / "t" / "integration").glob("test_*.py")):
        if path.name in OWN:
            continue
        text = path.read_text()
        name = path.relative_to(source).as_posix()
        holds = partial(_holds_gate, text)
        for node in ast.parse(text).body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test") and holds(node):
                found.append(f"{name}::{node.name}")
            elif isinstance(node, ast.ClassDef):
                tests = [item for item in node.body if isinstance(item, ast.FunctionDef)
                         and item.name.startswith("test")]
                whole = any(holds(item) for item in node.body if item not in tests)
                found.extend(f"{name}::{node.name}::{item.name}" for item in tests
                             if whole or holds(item))
    return found


def pytest_runtest_logreport(report: Any) -> None:
    """Loaded into the suite's pytest (``-p bench.celery_integration``): appends each
    test's outcome to ``$CELERY_SUITE_OUTCOMES`` as it is known, so a run cut at its
    limit keeps every test it ran."""
    target = os.environ.get(OUTCOMES_ENV)
    if not target or report.outcome == "rerun":
        return
    if report.when == "call" or report.outcome != "passed":
        found = {"passed": "passed", "skipped": "skipped"}.get(report.outcome, "failed")
        if hasattr(report, "wasxfail"):  # xfail counts as skipped, xpass as passed
            found = "skipped" if report.outcome == "skipped" else "passed"
        elif report.when != "call" and found == "failed":
            found = "errors"
        text = str(report.longrepr or "")
        if found != "passed" and "Timeout (>" in text:
            found = "timeouts"
        lines = [line for line in text.splitlines() if line.startswith("E ")]
        message = (lines[-1] if lines else text.splitlines()[-1] if text else "")[:300]
        if isinstance(report.longrepr, tuple):  # a skip: (file, line, reason)
            message = str(report.longrepr[2])[:300]
        with open(target, "a") as out:
            out.write(json.dumps({"test": report.nodeid, "when": report.when,
                                  "outcome": found, "message": message,
                                  "seconds": round(report.duration, 2)}) + "\n")


def read_outcomes(path: Path) -> dict[str, dict[str, Any]]:
    """Every test's outcome: the call's, unless its setup or teardown failed."""
    tests: dict[str, dict[str, Any]] = {}
    if not path.exists():
        return tests
    for line in path.read_text().splitlines():
        seen = json.loads(line)
        test = seen.pop("test")
        if test not in tests or seen["outcome"] != "passed":
            if test in tests and tests[test]["outcome"] != "passed":
                continue  # the first failure stands (a teardown's after a failed call)
            tests[test] = seen
    return tests


def drop_tables(database: str, prefix: str) -> None:
    """Drop the run's tables (only those under its own prefix)."""
    engine = create_engine(sqlalchemy_url(database))
    try:
        with engine.begin() as conn:
            quote = engine.dialect.identifier_preparer.quote
            for table in inspect(conn).get_table_names():
                if table.startswith(prefix):
                    conn.execute(text(f"DROP TABLE {quote(table)}"))
    finally:
        engine.dispose()


def run(name: str, args: argparse.Namespace, directory: Path) -> dict[str, Any]:
    """One run of the suite: its counts, wall time and every test's outcome."""
    database, backend = RUNS[name]
    sqlite = directory / f"{name}.db"
    prefix = f"cit{uuid.uuid4().hex[:6]}_"
    broker = REDIS if database is None else "sqlinbox+" + database.format(sqlite=sqlite)
    backend = backend.format(sqlite=sqlite)
    source = Path(args.celery_src).resolve()
    if args.open_redis_gate:
        source = opened(source, directory)
    (source / CONFIG).write_text(json.dumps({
        "broker_transport_options": {"table_prefix": prefix},
        "result_backend_transport_options": {"table_prefix": prefix}}))
    outcomes = directory / f"{name}.jsonl"
    outcomes.unlink(missing_ok=True)
    log = directory / f"{name}.log"
    selection = gated(Path(args.celery_src)) if args.only_gated else args.tests.split()
    command = [sys.executable, "-m", "pytest", *selection, "-p", "no:cacheprovider",
               "-p", "celery.contrib.pytest",  # the fixtures pytest-celery would register
               f"--timeout={args.timeout}", "-p", "bench.celery_integration",
               "-q", "-rN", *([] if args.reruns else ["-p", "no:rerunfailures"]),
               *args.pytest_args]
    env = {**os.environ, "TEST_BROKER": broker, "TEST_BACKEND": backend,
           OUTCOMES_ENV: str(outcomes), "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
           # the suite runs the ``celery`` command: this Python's
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]),
           "REDIS_HOST": "127.0.0.1", "REDIS_PORT": "6379"}
    started = time.monotonic()
    cut = False
    try:
        with log.open("wb") as out:
            process = subprocess.Popen(command, cwd=source, env=env, stdout=out,
                                       stderr=subprocess.STDOUT, start_new_session=True)
            try:
                process.wait(args.run_limit)
            except subprocess.TimeoutExpired:  # the whole run's bound: stop it, keep what ran
                cut = True
                os.killpg(process.pid, signal.SIGINT)
                try:
                    process.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()
    finally:
        (source / CONFIG).unlink(missing_ok=True)
        if database is not None:
            drop_tables(database.format(sqlite=sqlite), prefix)
    wall = time.monotonic() - started
    tests = read_outcomes(outcomes)
    counts = {key: sum(1 for test in tests.values() if test["outcome"] == key)
              for key in OUTCOMES}
    return {"run": name, "broker": broker, "backend": backend, "wall_seconds": round(wall, 1),
            "exit_code": process.returncode, "cut_at_run_limit": cut, **counts,
            "log": str(log), "tests": tests}


def selected(args: argparse.Namespace) -> str:
    """The tests a run selects, as the tables name them."""
    gate = ", its Redis gate opened" if args.open_redis_gate else ""
    return ("tests gated on a Redis backend" if args.only_gated else args.tests) + gate


def regressions(results: list[dict[str, Any]], reference: str) -> list[tuple[str, str, str]]:
    """(run, test, outcome: message) for every test that passes on ``reference`` only."""
    found = [result for result in results if result["run"] == reference]
    if not found:
        return []
    passing = {test for test, seen in found[0]["tests"].items() if seen["outcome"] == "passed"}
    return [(result["run"], test, f"{seen['outcome']}: {seen['message']}")
            for result in results if result["run"] != reference
            for test in sorted(passing)
            for seen in [result["tests"].get(test, {"outcome": "absent", "message": ""})]
            if seen["outcome"] != "passed"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--celery-src", required=True, help="Celery's source tree")
    parser.add_argument("--runs", default="postgresql,redis-on-postgresql",
                        help=f"comma-separated, of: {', '.join(RUNS)}")
    parser.add_argument("--tests", default=" ".join(TESTS), help="pytest's selection")
    parser.add_argument("--timeout", type=int, default=60, help="seconds per test")
    parser.add_argument("--run-limit", type=int, default=3600, help="seconds per run")
    parser.add_argument("--compare", default="redis-on-postgresql",
                        help="the run whose passing tests the others are checked against")
    parser.add_argument("--reruns", action="store_true",
                        help="keep the suite's reruns of its flaky tests (up to 5 each)")
    parser.add_argument("--open-redis-gate", action="store_true",
                        help="run the tests gated on a Redis result backend whatever the backend "
                             "(they use Redis as a side channel; on a copy of the tests)")
    parser.add_argument("--only-gated", action="store_true",
                        help="run only the tests gated on a Redis result backend (with "
                             "--open-redis-gate: the gap between the backends)")
    parser.add_argument("--keep", default=None, help="directory for the outcomes and logs")
    parser.add_argument("--json", default=None, help="write the runs to this file")
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    args = parser.parse_args()
    import celery
    print(f"Celery {celery.__version__}'s {selected(args)} in {args.celery_src}, "
          f"{args.timeout} s per test")
    results = []
    with tempfile.TemporaryDirectory(prefix="sqlinbox-celery-suite-") as scratch:
        directory = Path(args.keep or scratch)
        directory.mkdir(parents=True, exist_ok=True)
        print(f"{'run':<22} {'passed':>7} {'failed':>7} {'errors':>7} {'skipped':>8} "
              f"{'timeouts':>9} {'wall s':>8}", flush=True)
        for name in args.runs.split(","):
            result = run(name, args, directory)
            results.append(result)
            print(f"{name:<22} {result['passed']:>7} {result['failed']:>7} "
                  f"{result['errors']:>7} {result['skipped']:>8} {result['timeouts']:>9} "
                  f"{result['wall_seconds']:>8.0f}"
                  + (" (cut at --run-limit)" if result["cut_at_run_limit"] else ""), flush=True)
    missing = regressions(results, args.compare)
    if missing:
        print(f"\npassing on {args.compare}, not on:")
        for name, test, seen in missing:
            print(f"  {name:<20} {test}  {seen}")
    if args.json:
        write_json(Path(args.json), args, results, missing)


def write_json(path: Path, args: argparse.Namespace, results: list[dict[str, Any]],
               missing: list[tuple[str, str, str]]) -> None:
    """The runs in the format of ``bench/results`` (its README): the two tables as printed,
    and every test's outcome per run under ``runs``; ``round`` and ``notes`` are the
    committer's to fill in."""
    import platform

    import celery
    import kombu
    columns = ["run", "broker", "backend", *OUTCOMES, "wall s"]
    rows = [[r["run"], r["broker"], r["backend"], *(str(r[key]) for key in OUTCOMES),
             f"{r['wall_seconds']:.0f}"] for r in results]
    tables = [{"title": f"Celery {celery.__version__}'s {selected(args)}, "
                        f"{args.timeout} s per test",
               "columns": columns, "rows": rows}]
    if missing:
        tables.append({"title": f"passing on {args.compare}, not on",
                       "columns": ["run", "test", "outcome"],
                       "rows": [list(row) for row in missing]})
    path.write_text(json.dumps({
        "date": datetime.date.today().isoformat(), "round": "", "section": "celery_integration",
        "command": "python -m bench.celery_integration " + " ".join(sys.argv[1:]),
        "machine": f"Python {platform.python_version()}, Celery {celery.__version__}, "
                   f"kombu {kombu.__version__}", "notes": "[table 1]", "tables": tables,
        "arguments": vars(args), "runs": results}, indent=2) + "\n")

if __name__ == "__main__":
    main()
