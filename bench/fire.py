"""Chords and results under fire: workers SIGKILLed and restarted while they run.

    python bench/fire.py [--databases postgresql,mysql,sqlite] [--parts chords,results]
                         [--width 1000] [--rounds 3] [--tasks 5000] [--json PATH]

Four real ``celery worker`` processes (prefork, one pool process each, late acks) share
one sqlinbox queue; every few seconds one of them, in turn, is killed with its pool
(``kill -9`` of its process group) and a new one started in its place. Every run of a
task is recorded in a SQLite ledger of its own (``bench/fire_app.py``), so runs are
counted outside the broker and the backend under test.

``chords``: ``--rounds`` chords of ``--width`` header tasks each, one after the other,
a worker killed every 5 s; once with the sqlinbox result backend, once with Celery's
Redis backend (same broker). Per chord: how many times its body ran (must be once),
whether it got every header value in order, each from its task's last run, and the time
from the last header task's end to the body's start (p50 / p99 over the chords).

``results``: ``--tasks`` tasks, a worker killed every 3 s, the sqlinbox backend. Every
task must end with one stored result naming its last run; a run after the one whose
result was stored is a violation, as is a run again that no kill explains.

Exit status 1 when a check failed. Not a test and not in CI: the figures depend on the
machine and on what else runs on it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sqlite3
import sys
import threading
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # run as a script: import the bench package, not its modules
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from celery import Celery, chord
from sqlalchemy import create_engine, text

from bench.cli import choices, command
from bench.fire_app import BODY, CONFIG_ENV, JOB, PART, RUNS, WORKER_ENV, make_app
from bench.registry import gist, progress, spread
from bench.report import grid, machine, parse_markdown
from bench.targets import DATABASES, REDIS_URL, RUN_ID, SERVERS, drop_tables
from kombu_sqlinbox.tables import table_name_for_queue
from tests.processes import ROOT, START_LIMIT, Proc, wait_until, worker_argv, worker_ready

PARTS = ("chords", "results")
WORKERS = 4
#: the lease: a killed worker's rows come back after it
LEASE = 5.0
#: seconds between kills
CHORD_KILLS, RESULT_KILLS = 5.0, 3.0
#: seconds each header task and each job works
WORK = 0.01
#: the longest the queue may take to drain, or a results run go without a result stored
STALL = 120.0
#: the longest a chord's body may take to be stored, beside the time its header works
CHORD_LIMIT = 60.0


@dataclass
class Chords:
    """One backend's chords on one database."""

    database: str
    backend: str
    chords: int = 0
    kills: int = 0
    #: runs of the bodies (one per chord expected)
    bodies: int = 0
    #: chords whose body got every value in order, each from its task's last run
    complete: int = 0
    #: seconds from each chord's last header task's end to its body's start
    waits: list[float] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.chords > 0 and self.bodies == self.complete == self.chords


@dataclass
class Results:
    """The exactly-once results run on one database."""

    database: str
    tasks: int = 0
    kills: int = 0
    runs: int = 0
    #: runs after a task's first
    reruns: int = 0
    #: of them, those whose earlier run's worker was not killed
    unexplained: int = 0
    results: int = 0
    #: a task without exactly one result naming its last run, or run after its result's run
    violations: int = 0
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.tasks > 0 and not self.violations and not self.unexplained


class Fleet:
    """:data:`WORKERS` workers on the run's queue; while the block runs, one of them in
    turn is killed every ``every`` seconds and replaced at once."""

    def __init__(self, config: dict[str, Any], logs: Path, every: float) -> None:
        self.config, self.logs, self.every = config, logs, every
        self.procs: list[Proc] = []
        self.started = 0
        self.killed: set[str] = set()
        self._calm = threading.Event()
        self._killer = threading.Thread(target=self._kill_loop, daemon=True)

    def start(self) -> Proc:
        self.started += 1
        name = f"fire-{self.config['queue']}-w{self.started}"
        env = {**os.environ, CONFIG_ENV: json.dumps(self.config), WORKER_ENV: name,
               "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH"))
                                             if p)}
        argv = [*worker_argv("bench.fire_app", "prefork", 1), "-Q", self.config["queue"],
                "-n", f"{name}@%h"]
        return Proc(name, argv, env, self.logs / f"{name}.log")

    def __enter__(self) -> Fleet:
        self.procs = [self.start() for _ in range(WORKERS)]
        wait_until(lambda: all(worker_ready(p) for p in self.procs), START_LIMIT,
                   "the workers to be ready", alive=self.procs)
        self._killer.start()
        return self

    def _kill_loop(self) -> None:
        while not self._calm.wait(self.every):
            slot = len(self.killed) % WORKERS
            victim = self.procs[slot]
            victim.kill()
            self.killed.add(victim.name)
            self.procs[slot] = self.start()

    def calm(self) -> None:
        """No more kills (the workers stay)."""
        self._calm.set()
        if self._killer.is_alive():
            self._killer.join()

    def __exit__(self, *exc: object) -> None:
        self.calm()
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(30)
            except AssertionError as failed:
                progress(gist(str(failed)))


class Run:
    """One part on one database and backend: its app, queue, tables and ledger."""

    def __init__(self, database: str, backend: str, logs: Path, tag: str) -> None:
        self.db = f"sqlite:///{logs / tag}.db" if database == "sqlite" else SERVERS[database]
        self.prefix = f"fire{RUN_ID}{tag}_"
        self.queue = f"fire{RUN_ID}{tag}"
        self.config = {"broker": f"sqlinbox+{self.db}", "prefix": self.prefix,
                       "backend": REDIS_URL if backend == "redis" else f"sqlinbox+{self.db}",
                       "queue": self.queue, "lease": LEASE,
                       "ledger": str(logs / f"ledger-{tag}.db")}
        self.logs = logs
        self.app: Celery = make_app(self.config)
        self.engine = create_engine(self.db)
        with sqlite3.connect(self.config["ledger"]) as conn:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute(RUNS)
        with self.app.connection_for_write() as conn:  # the queue (its table) exists first
            self.app.amqp.queues[self.queue].bind(conn.default_channel).declare()

    def fleet(self, every: float) -> Fleet:
        return Fleet(self.config, self.logs, every)

    def count(self, table: str) -> int:
        with self.engine.connect() as conn:
            quote = conn.dialect.identifier_preparer.quote
            return int(conn.execute(text(f"SELECT COUNT(*) FROM {quote(table)}")).scalar_one())

    def drained(self) -> None:
        """Until the queue's table is empty (each row run and completed), bounded."""
        table = table_name_for_queue(self.queue, self.prefix)
        wait_until(lambda: self.count(table) == 0, STALL, "the queue to drain", interval=0.5)

    def runs(self) -> dict[str, list[tuple[str, str, str, float]]]:
        """Per task id, its ledger rows ``(token, event, worker, at)`` in time order."""
        found: dict[str, list[tuple[str, str, str, float]]] = defaultdict(list)
        with sqlite3.connect(self.config["ledger"], timeout=60) as conn:
            for task_id, *rest in conn.execute(
                    "SELECT task_id, token, event, worker, at FROM runs ORDER BY at"):
                found[task_id].append(tuple(rest))  # type: ignore[arg-type]
        return found

    def close(self) -> None:
        self.app.close()
        self.engine.dispose()
        if not self.db.startswith("sqlite"):
            drop_tables(self.db, self.prefix)


def starts(rows: list[tuple[str, str, str, float]]) -> list[tuple[str, str, float]]:
    """A task's runs ``(token, worker, at)`` in the order they began."""
    return [(token, worker, at) for token, event, worker, at in rows if event == "start"]


# -- chords -----------------------------------------------------------------------------
def chords(database: str, backend: str, args: argparse.Namespace, logs: Path) -> Chords:
    found = Chords(database, backend)
    run = Run(database, backend, logs, f"c{backend[0]}{database[0]}")
    sent = []
    try:
        with run.fleet(CHORD_KILLS) as fleet:
            for round_ in range(args.rounds):
                header = [run.app.signature(PART, args=(n, WORK)) for n in range(args.width)]
                result = chord(header)(run.app.signature(BODY))
                sent.append((result.id, [part.id for part in result.parent.results]))
                try:
                    values = result.get(timeout=CHORD_LIMIT + args.width * WORK * 4)
                except Exception as exc:  # counted below: no body run, or a failed one
                    found.notes.append(f"chord {round_ + 1}: {type(exc).__name__}: "
                                       f"{gist(str(exc))}")
                    values = None
                found.chords += 1
                check_chord(found, run.runs(), sent[-1], values)
                progress(f"{database}/{backend}: chord {round_ + 1} of {args.rounds}, "
                         f"{len(fleet.killed)} kills so far")
            fleet.calm()
            run.drained()
            found.kills = len(fleet.killed)
        ledger = run.runs()  # bodies run late (after their chord was checked) count too
        found.bodies = sum(len([r for r in ledger[body] if r[1] == "body"]) for body, _ in sent)
    except Exception as exc:  # the other parts still run
        found.notes.append(f"FAILED: {type(exc).__name__}: {gist(str(exc))}")
    finally:
        run.close()
    return found


def check_chord(found: Chords, ledger: dict[str, list[tuple[str, str, str, float]]],
                sent: tuple[str, list[str]], values: list[Any] | None) -> None:
    """Whether the body got every value in order, each its task's last run's, and how long
    after the last of those runs ended the body began."""
    body, parts = sent
    began = [at for _, event, _, at in ledger[body] if event == "body"]
    if values is None or not began:
        return
    ends = {token: at for token, event, _, at in
            (row for part in parts for row in ledger[part]) if event == "end"}
    last = [starts(ledger[part])[-1][0] if ledger[part] else None for part in parts]
    if [list(value) for value in values] == [[n, token] for n, token in enumerate(last)]:
        found.complete += 1
    else:
        wrong = sum(value != [n, token] for n, (value, token) in enumerate(
            zip(values, last, strict=False))) + abs(len(values) - len(last))
        found.notes.append(f"chord {body}: {wrong} of {len(parts)} values not their task's "
                           f"last run's, or out of place")
    if all(token in ends for _, token in values):
        found.waits.append(min(began) - max(ends[token] for _, token in values))


# -- exactly-once results ---------------------------------------------------------------
def results(database: str, args: argparse.Namespace, logs: Path) -> Results:
    found = Results(database, args.tasks)
    run = Run(database, "sqlinbox", logs, f"r{database[0]}")
    began = time.monotonic()
    try:
        with run.app.producer_or_acquire() as producer:
            ids = [run.app.send_task(JOB, args=(WORK,), producer=producer).id
                   for _ in range(args.tasks)]
        stored = run.prefix + "task_results"
        with run.fleet(RESULT_KILLS) as fleet:
            done, moved = 0, time.monotonic()
            while done < args.tasks and time.monotonic() - moved < STALL:
                time.sleep(0.5)
                if (now := run.count(stored)) != done:
                    done, moved = now, time.monotonic()
            fleet.calm()
            found.kills = len(fleet.killed)
            run.drained()
            killed = set(fleet.killed)
        found.seconds = time.monotonic() - began
        check_results(found, run, ids, killed)
    except Exception as exc:  # the other parts still run
        found.notes.append(f"FAILED: {type(exc).__name__}: {gist(str(exc))}")
        found.violations = max(found.violations, 1)
    finally:
        run.close()
    return found


def check_results(found: Results, run: Run, ids: list[str], killed: set[str]) -> None:
    """Each task: one stored result, the token of its last run; every run but the last
    one's worker killed."""
    backend = run.app.backend
    table = backend.store.sql.names[0]
    with run.engine.connect() as conn:
        rows = Counter(  # MariaDB's key is binary
            task_id.decode() if isinstance(task_id, bytes) else task_id for task_id, in
            conn.execute(text(f"SELECT task_id FROM "
                              f"{conn.dialect.identifier_preparer.quote(table)}")))
    stored = backend.store.read_many(ids)
    ledger = run.runs()
    for task_id in ids:
        began = starts(ledger[task_id])
        found.runs += len(began)
        found.reruns += max(0, len(began) - 1)
        found.unexplained += sum(worker not in killed for _, worker, _ in began[:-1])
        result = stored.get(task_id)
        token = backend.decode_result(result.meta)["result"] if result is not None else None
        found.results += result is not None and result.status == "SUCCESS"
        if rows[task_id] != 1 or not began or token != began[-1][0]:
            found.violations += 1
            if len(found.notes) < 5:
                found.notes.append(f"{task_id}: {rows[task_id]} result(s), result {token!r}, "
                                   f"runs {[t for t, *_ in began]}")


# -- the command ------------------------------------------------------------------------
def milliseconds(waits: list[float]) -> str:
    return spread([w * 1000 for w in waits]).text if waits else "-"


def tables(chorded: list[Chords], exact: list[Results], args: argparse.Namespace
           ) -> list[tuple[str, str]]:
    made = []
    if chorded:
        made.append((f"Chords of {args.width:,} under fire (a worker of {WORKERS} killed every "
                     f"{CHORD_KILLS:.0f} s)", grid(
            ["database", "result backend", "chords", "kills", "body runs",
             "complete, in order, last runs", "last header end -> body start (ms, p50 / p99)",
             "result"],
            [[c.database, c.backend, c.chords, c.kills, c.bodies, c.complete,
              milliseconds(c.waits), "ok" if c.ok else "FAILED"] for c in chorded], left=2)))
    if exact:
        made.append((f"Exactly-once results under fire (a worker of {WORKERS} killed every "
                     f"{RESULT_KILLS:.0f} s)", grid(
            ["database", "tasks", "kills", "runs", "re-runs", "re-runs no kill explains",
             "results", "violations", "seconds", "result"],
            [[r.database, f"{r.tasks:,}", r.kills, f"{r.runs:,}", r.reruns, r.unexplained,
              f"{r.results:,}", r.violations, f"{r.seconds:.0f}", "ok" if r.ok else "FAILED"]
             for r in exact])))
    return made


def parser() -> argparse.ArgumentParser:
    made = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    made.add_argument("--databases", default=list(DATABASES), type=choices(DATABASES),
                      help=f"comma-separated (default all: {','.join(DATABASES)})")
    made.add_argument("--parts", default=list(PARTS), type=choices(PARTS),
                      help=f"comma-separated (default all: {','.join(PARTS)})")
    made.add_argument("--width", type=int, default=1000, help="header tasks per chord")
    made.add_argument("--rounds", type=int, default=3, help="chords per backend and database")
    made.add_argument("--tasks", type=int, default=5000, help="tasks of the results part")
    made.add_argument("--json", type=Path, help="also write the tables and figures as JSON")
    return made


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    logs = Path(f"/tmp/sqlinbox-fire-{RUN_ID}")
    logs.mkdir(parents=True, exist_ok=True)
    progress(f"fire {RUN_ID}: worker logs and ledgers in {logs}")
    chorded: list[Chords] = []
    exact: list[Results] = []
    for database in args.databases:
        if "chords" in args.parts:
            for backend in ("sqlinbox", "redis"):  # side by side, on the same machine load
                chorded.append(chords(database, backend, args, logs))
        if "results" in args.parts:
            exact.append(results(database, args, logs))
    made = tables(chorded, exact, args)
    for title, table in made:
        print(f"\n## {title}\n\n{table}\n")
    for item in (*chorded, *exact):
        for note in item.notes:
            print(f"* {item.database}/{getattr(item, 'backend', 'results')}: {note}")
    if args.json:
        record = {"date": datetime.date.today().isoformat(), "round": "",
                  "section": "fire (bench/fire.py, a script of its own)",
                  "command": " ".join(["python", "bench/fire.py", *argv]),
                  "machine": machine(), "notes": "",
                  "tables": [{"title": title, **parse_markdown(table)[0][0]}
                             for title, table in made],
                  "runs": {"chords": [asdict(c) for c in chorded],
                           "results": [asdict(r) for r in exact]}}
        args.json.write_text(json.dumps(record, indent=1) + "\n")
    return 0 if all(item.ok for item in (*chorded, *exact)) else 1


if __name__ == "__main__":
    command(main, "the workers are gone")
