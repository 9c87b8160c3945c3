"""The database scheduler under fire: schedulers killed and restarted at random, each tick
counted once.

    python bench/schedules_fire.py [--databases postgresql,mysql,sqlite] [--minutes 10]
                                   [--json PATH]

For each database: three real ``celery worker -B --scheduler
celery_ext.beat:DatabaseScheduler`` processes (a scheduler embedded in each) run three
schedules (every second, every 5 seconds, a crontab every minute); every 20 to 60 s one
worker, picked at random, is killed with SIGKILL (its whole process group, embedded beat
included) and a new one started at once. Each task run appends its task id, schedule and
time to a SQLite ledger of its own, away from the broker; the tick each task belongs to
(its due time) is the ``<prefix>schedule_ticks`` row of that task id. After the run the
schedules are paused, the queue drained, and the figures read:

* ticks sent twice: a due time with more than one tick row (the key forbids it), or a task
  id with more than one run in the ledger (run twice for one tick);
* missed: every due time of each schedule's grid from its first due time up to
  :data:`SETTLE` s before the pause, not sent, or sent but never run. The ``skip`` policy
  drops a tick only when no scheduler reached it within its 60 s grace: with one worker
  of three down at a time, two schedulers are always up, so the policy excuses none;
* lateness: a tick's ``sent_at - due`` (both by the database's clock) and its task's run
  time (this host's clock, the databases' servers are local) minus its due time.

Exit status 1 when a tick was sent twice, run twice or missed. Not a test and not in CI.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import sqlite3
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # run as a script: import the bench package, not its modules
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from celery import Celery, Task
from celery.schedules import crontab
from kombu import Queue
from sqlalchemy import text

import kombu_sqlinbox  # noqa: F401  (registers the sqlinbox+ alias)
from bench.chaos_app import ledger
from bench.cli import choices, command
from bench.mvcc import percentile
from bench.registry import progress
from bench.report import machine, parse_markdown
from bench.targets import DATABASES, RUN_ID, SERVERS, drop_tables
from celery_ext.beat import Schedules
from celery_ext.schedule_times import next_after
from tests.processes import ROOT, START_LIMIT, STOP_LIMIT, Proc, wait_until, worker_argv

CONFIG_ENV = "FIRE_CONFIG"
TASK = "fire.tick"
#: the schedules: every second, every 5 seconds, every minute
SCHEDULES = {"every-1s": 1.0, "every-5s": 5.0, "every-minute": crontab()}
WORKERS = 3
#: seconds between kills, drawn uniformly
KILL_EVERY = (20.0, 60.0)
#: the lease: a task whose worker was killed before its late ack runs again after it
LEASE = 10.0
#: due times this close (seconds) to the pause need not have been sent yet: a scheduler
#: sleeps at most 5 s between ticks
SETTLE = 10.0
#: how long the queue may take to drain once the schedules are paused
DRAIN = 120.0
RUNS = ("CREATE TABLE IF NOT EXISTS runs (task_id TEXT NOT NULL, name TEXT NOT NULL, "
        "at REAL NOT NULL, pid INTEGER NOT NULL)")


def tick(self: Task, name: str) -> None:
    """A schedule's task: its run in the ledger (the tick table knows its due time)."""
    ledger(self.app.conf.fire["ledger"], os.getpid()).execute(
        "INSERT INTO runs VALUES (?, ?, ?, ?)", (self.request.id, name, time.time(),
                                                 os.getpid()))


def make_app(config: dict[str, Any]) -> Celery:
    """The app of the workers and of the run: one queue, late acks, the schedules."""
    made = Celery("fire", broker=config["broker"], set_as_current=False)
    made.conf.update(
        broker_transport_options=config.get("options", {}),
        broker_connection_retry_on_startup=True,
        broker_connection_max_retries=None,
        task_queues=[Queue("fire", routing_key="fire")],
        task_default_queue="fire",
        task_acks_late=True,
        task_ignore_result=True,
        worker_prefetch_multiplier=1,
        worker_redirect_stdouts=False,
        worker_enable_remote_control=False,
        beat_schedule={name: {"task": TASK, "schedule": timing, "args": [name]}
                       for name, timing in SCHEDULES.items()},
        fire=config,
    )
    made.task(name=TASK, bind=True, shared=False)(tick)
    return made


@dataclass
class Figures:
    """One database's run."""

    database: str
    minutes: float = 0.0
    kills: int = 0
    #: per schedule: due times expected, ticks sent, tasks run
    expected: dict[str, int] = field(default_factory=dict)
    sent: dict[str, int] = field(default_factory=dict)
    #: due times with two tick rows; task ids run more than once
    sent_twice: int = 0
    run_twice: int = 0
    #: expected due times not sent; ticks sent whose task never ran
    missed: int = 0
    not_run: int = 0
    #: ``sent_at - due`` and task run time ``- due``: p50, p99, max (seconds)
    send_late: list[float] = field(default_factory=list)
    run_late: list[float] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.sent_twice or self.run_twice or self.missed or self.not_run
                    or any(note.startswith("FAILED") for note in self.notes))


def spread(values: list[float]) -> list[float]:
    return [round(percentile(values, share), 3) for share in (0.5, 0.99, 1.0)] if values else []


class Run:
    """One database: the workers, the kills, the count."""

    def __init__(self, database: str, minutes: float, logs: Path) -> None:
        self.database, self.minutes, self.logs = database, minutes, logs
        url = (f"sqlite:///{logs / 'fire'}.db" if database == "sqlite"
               else SERVERS[database])
        self.url, self.prefix = url, f"f{RUN_ID}_"
        self.ledger = str(logs / f"ledger-{database}.db")
        self.config = {"broker": f"sqlinbox+{url}", "ledger": self.ledger,
                       "options": {"table_prefix": self.prefix, "polling_interval": 0.1,
                                   "visibility_timeout": LEASE}}
        self.app = make_app(self.config)
        self.store = Schedules.for_app(self.app)
        self.workers: list[Proc] = []
        self.started = 0
        self.figures = Figures(database, minutes)
        with sqlite3.connect(self.ledger) as conn:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute(RUNS)

    def start(self) -> Proc:
        self.started += 1
        name = f"fire-{self.database}-w{self.started}"
        env = {**os.environ, CONFIG_ENV: json.dumps(self.config),
               "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH"))
                                             if p)}
        argv = [*worker_argv("bench.schedules_fire", "solo", 1), "-B", "--scheduler",
                "celery_ext.beat:DatabaseScheduler", "-Q", "fire", "-n", f"{name}@%h"]
        worker = Proc(name, argv, env, self.logs / f"{name}.log")
        self.workers.append(worker)
        return worker

    def run(self) -> Figures:
        with self.app.connection_for_write() as conn:  # the queue's tables before the race
            self.app.amqp.queues["fire"].bind(conn.default_channel).declare()
        self.store.load(self.app.conf.beat_schedule)
        first = {each.name: each.next_run_at for each in self.store.all()}
        for _ in range(WORKERS):
            self.start()
        for worker in self.workers:
            wait_until(lambda w=worker: " ready." in w.output(), START_LIMIT,
                       f"{worker.name} to be ready", alive=[worker])
        ready = self.store.now()  # due times before: no scheduler was up, skipped by policy
        until = time.monotonic() + self.minutes * 60
        while (left := until - time.monotonic()) > 0:
            time.sleep(min(left, random.uniform(*KILL_EVERY)))
            if time.monotonic() >= until:
                break
            self.replace_dead()
            victim = random.choice([w for w in self.workers if w.popen.poll() is None])
            victim.kill()
            self.workers.remove(victim)
            self.figures.kills += 1
            self.start()
            progress(f"{self.database}: killed {victim.name}, started "
                     f"fire-{self.database}-w{self.started}")
        for name in SCHEDULES:
            self.store.pause(name)
        paused = self.store.now()
        self.drain()
        self.count(first, ready, paused)
        return self.figures

    def replace_dead(self) -> None:
        """A worker that exited on its own is noted and replaced."""
        for worker in [w for w in self.workers if w.popen.poll() is not None]:
            self.figures.notes.append(f"FAILED: {worker.name} exited with "
                                      f"{worker.popen.returncode}; log {worker.log}")
            self.workers.remove(worker)
            self.start()

    def tick_rows(self) -> list[tuple[str, float, float, str]]:
        table = self.store.dialect.quote(self.store.sql.names[1])
        rows = self.store.database.run(lambda conn: conn.execute(
            text(f"SELECT name, due, sent_at, task_id FROM {table}")).all(), read_only=True)
        return [(str(bytes(n).decode() if isinstance(n, (bytes, bytearray, memoryview)) else n),
                 float(d), float(s), str(t)) for n, d, s, t in rows]

    def runs(self) -> list[tuple[str, str, float]]:
        with sqlite3.connect(self.ledger, timeout=60) as conn:
            return conn.execute("SELECT task_id, name, at FROM runs").fetchall()

    def drain(self) -> None:
        """Until every tick's task ran (bounded), then the workers stopped warm."""
        try:
            wait_until(lambda: {t[3] for t in self.tick_rows()} <= {r[0] for r in self.runs()},
                       DRAIN, "every tick's task to run", interval=1.0)
        except AssertionError as exc:
            self.figures.notes.append(f"FAILED: {exc}".splitlines()[0])
        for worker in self.workers:
            try:
                worker.stop(STOP_LIMIT)
            except AssertionError as exc:
                self.figures.notes.append(f"{worker.name}: {exc}".splitlines()[0])

    def count(self, first: dict[str, float], ready: float, paused: float) -> None:
        f = self.figures
        ticks, runs = self.tick_rows(), self.runs()
        ran: dict[str, list[float]] = {}
        for task_id, _, at in runs:
            ran.setdefault(task_id, []).append(at)
        f.run_twice = sum(len(ats) > 1 for ats in ran.values())
        stray = set(ran) - {t[3] for t in ticks}
        if stray:
            f.notes.append(f"FAILED: {len(stray)} task runs of no tick")
        for name in SCHEDULES:
            mine = sorted((due, sent_at, task_id) for n, due, sent_at, task_id in ticks
                          if n == name)
            dues = [due for due, _, _ in mine]
            f.sent[name] = len(dues)
            f.sent_twice += len(dues) - len(set(dues))
            found = self.store.get(name)
            assert found is not None
            expected, at = [], first[name]
            while at <= paused - SETTLE:  # the schedule's grid from its first due time
                if at >= ready:
                    expected.append(at)
                at = next_after(found.schedule, at)
            f.expected[name] = len(expected)
            sent = {round(due, 3) for due in dues}  # a grid walked by sums or products
            missed = [due for due in expected if round(due, 3) not in sent]
            f.missed += len(missed)
            if missed:
                f.notes.append(f"FAILED: {name}: due times not sent, seconds after the "
                               f"workers were up: {[round(d - ready, 1) for d in missed]}")
            f.not_run += sum(task_id not in ran for _, _, task_id in mine)
            window = [tick for tick in mine if tick[0] >= ready]
            f.send_late += [sent_at - due for due, sent_at, _ in window]
            f.run_late += [min(ran[task_id]) - due for due, _, task_id in window
                           if task_id in ran]
        f.send_late, f.run_late = spread(f.send_late), spread(f.run_late)

    def close(self) -> None:
        for worker in self.workers:
            worker.kill()
        self.store.close()
        if self.database != "sqlite":
            drop_tables(self.url, self.prefix)


def parser() -> argparse.ArgumentParser:
    made = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    made.add_argument("--databases", default=list(DATABASES), type=choices(DATABASES),
                      help=f"comma-separated (default all: {','.join(DATABASES)})")
    made.add_argument("--minutes", type=float, default=10.0,
                      help="how long the workers run and are killed, per database")
    made.add_argument("--json", type=Path, help="also write the figures as JSON here")
    return made


def late(values: list[float]) -> str:
    return " / ".join(f"{v:.2f}" for v in values) if values else "-"


def table(found: list[Figures]) -> str:
    lines = ["| database | minutes | kills | ticks expected / sent (1 s, 5 s, minute) "
             "| sent twice | run twice | missed | sent, not run | send late p50 / p99 / max (s) "
             "| run late p50 / p99 / max (s) | result |",
             "|---|---:|---:|---|---:|---:|---:|---:|---|---|---|"]
    for f in found:
        counts = ", ".join(f"{f.expected.get(n, 0)} / {f.sent.get(n, 0)}" for n in SCHEDULES)
        lines.append(f"| {f.database} | {f.minutes:g} | {f.kills} | {counts} | {f.sent_twice} "
                     f"| {f.run_twice} | {f.missed} | {f.not_run} | {late(f.send_late)} "
                     f"| {late(f.run_late)} | {'ok' if f.ok else 'FAILED'} |")
    return "\n".join(lines)


def results_record(found: list[Figures], args: argparse.Namespace) -> dict[str, Any]:
    """The run as ``bench/results`` keeps a round (``round`` and ``notes`` to fill in), each
    database's figures under ``runs``."""
    tables, _ = parse_markdown(table(found))
    return {"date": datetime.date.today().isoformat(), "round": "",
            "section": "schedules_fire (bench/schedules_fire.py, a script of its own)",
            "command": " ".join(["python", "bench/schedules_fire.py", *sys.argv[1:]]),
            "machine": machine(), "notes": "[table 1]",
            "tables": [{"title": "Schedules under fire", **made} for made in tables],
            "arguments": vars(args), "runs": [{**asdict(f), "ok": f.ok} for f in found]}


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    logs = Path(f"/tmp/sqlinbox-fire-{RUN_ID}")
    logs.mkdir(parents=True, exist_ok=True)
    progress(f"schedules under fire {RUN_ID}: worker logs and ledgers in {logs}")
    found: list[Figures] = []
    for database in args.databases:
        run = Run(database, args.minutes, logs)
        try:
            found.append(run.run())
        except Exception as exc:  # the next database still runs
            run.figures.notes.append(f"FAILED: the run itself failed: {exc}".splitlines()[0])
            found.append(run.figures)
        finally:
            run.close()
        progress(table(found[-1:]))
    print(f"\n## Schedules under fire {RUN_ID}\n\n{table(found)}\n")
    for f in found:
        for note in f.notes:
            print(f"* {f.database}: {note}")
    if args.json:
        args.json.write_text(json.dumps(results_record(found, args), indent=1,
                                        ensure_ascii=False, default=str) + "\n")
    return 0 if all(f.ok for f in found) else 1


CONFIG: dict[str, Any] | None = json.loads(os.environ.get(CONFIG_ENV, "null"))
app = make_app(CONFIG or {"broker": "memory://", "ledger": "/tmp/fire-unconfigured.db"})

if __name__ == "__main__":
    command(main, "the workers are gone")
