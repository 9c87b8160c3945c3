"""Chaos scenarios as a neutral job-queue benchmark runs them, one table row each.

    python bench/chaos.py [--targets postgresql,mysql,sqlite,redis,rabbitmq]
                          [--scenarios kill,kills,sessions,restart,hold,storm,priority]
                          [--scale F] [--json PATH] [server URLs and restart commands]

For each target (Celery on the sqlinbox transport on PostgreSQL, MariaDB and SQLite;
Celery on Redis and on RabbitMQ as controls) and each scenario that applies to it: a
backlog of jobs is published, one real ``celery worker`` (prefork, late acks) runs it,
the fault strikes part-way, and the run waits until every job is done (bounded). Every
delivery's start, finish and ack is recorded in a SQLite ledger of its own, so jobs
lost and jobs run again after their ack are counted exactly. Exit status 1 when a
scenario did not recover, lost a job or ran a finished one again.

The faults restart servers, terminate sessions and fill every connection slot: run it
against servers of its own (``docs/soak.rst`` shows how to start private ones on other
ports), never against servers others use. Not a test and not in CI.
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import sys
import time
from contextlib import suppress
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # run as a script: import the bench package, not its modules
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from bench.chaos_app import CONFIG_ENV, LEDGER, TASK, make_app, record
from bench.chaos_faults import DEFAULTS, HOLD, SQL, Servers, group_ports
from bench.cli import choices, command
from bench.registry import progress
from bench.soak import said
from bench.targets import RUN_ID, drop_tables
from kombu_sqlinbox.tables import table_name_for_queue
from tests.processes import ROOT, START_LIMIT, STOP_LIMIT, Proc, wait_until, worker_argv

TARGETS = (*SQL, "redis", "rabbitmq")
SCENARIOS = ("kill", "kills", "sessions", "restart", "hold", "storm", "priority")
#: what a target has no equivalent of
NOT_APPLICABLE = {"sqlite": {"sessions", "restart"}, "rabbitmq": {"hold"}}
#: jobs per scenario (``--scale`` multiplies them)
LOADS = {"kill": 500, "kills": 1000, "sessions": 1000, "restart": 1000, "hold": 1000,
         "storm": 1700, "priority": 1700}
#: the lease (sqlinbox) and visibility timeout (Redis): a dead worker's jobs come back
LEASE = 10.0
#: seconds each job works; the pool size of the worker
WORK = 0.05
CONCURRENCY = 4
#: kills of ``kills``, and terminations of ``sessions``, at these shares of jobs done
KILLS_AT = (0.1, 0.25, 0.4, 0.55, 0.7)
SESSIONS_AT = (0.2, 0.45, 0.7)
#: the other scenarios' fault comes at this share done
FAULT_AT = 0.25
#: ``storm``: every third job fails this many times before it succeeds
STORM_FAILS = 3
#: ``priority``: high-priority jobs published once this many low ones are done
HIGH_JOBS, HIGH_AFTER = 200, 100
#: the run gives up on a scenario when no job finished for this long (Redis gives a dead
#: worker's jobs back every ``unacked_restore_interval * unacked_restore_throttle``: 100 s)
STALL = 150.0
@dataclass
class Figures:
    """One scenario on one target."""

    target: str
    scenario: str
    jobs: int = 0
    done: int = 0
    lost: int = 0
    #: deliveries that ran again after their ack returned (finished): must be 0
    twice: int = 0
    #: deliveries that ran again before their ack (killed mid-run): at least once, allowed
    redelivered: int = 0
    #: of ``twice``, those whose worker was killed after the ack returned
    twice_killed: int = 0
    #: messages still in the queue after every job was done and the worker stopped
    left: int = 0
    #: seconds from the fault's end to the first job that started after it being done
    #: (``priority``: to the last high-priority job done; None: none was)
    recover: float | None = None
    #: seconds from the fault's end to the last job done
    drained: float | None = None
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return (not (self.lost or self.twice or self.left) and self.recover is not None
                and not any(note.startswith("FAILED") for note in self.notes))


def prefix(scenario: str) -> str:
    return f"c{RUN_ID}_{scenario}_"


class Run:
    """One scenario on one target."""

    def __init__(self, servers: Servers, target: str, scenario: str, args: argparse.Namespace,
                 logs: Path) -> None:
        self.servers, self.target, self.scenario = servers, target, scenario
        self.logs = logs
        self.broker, options, self.db = self.broker_of(logs)
        self.queue = f"chaos{RUN_ID}_{scenario}"
        self.ledger = str(logs / f"ledger-{target}-{scenario}.db")
        priority = scenario == "priority"
        self.config = {"broker": self.broker, "options": options, "queue": self.queue,
                       "ledger": self.ledger, "max_priority": 10 if priority else None,
                       "prefetch": 1 if priority else 4}
        self.app = make_app(self.config)
        self.jobs = max(20, int(LOADS[scenario] * args.scale))
        self.figures = Figures(target, scenario, self.jobs)
        self.worker: Proc | None = None
        self.started = 0
        self.fault = 0.0
        with sqlite3.connect(self.ledger) as conn:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute(LEDGER)

    def broker_of(self, scratch: Path) -> tuple[str, dict[str, Any], str | None]:
        """The broker URL, its transport options and the SQLAlchemy URL (SQL targets)."""
        target = self.target
        if target not in SQL:
            options: dict[str, Any] = {"visibility_timeout": LEASE} if target == "redis" else {}
            return self.servers.urls[target], options, None
        db = (f"sqlite:///{scratch / self.scenario}.db" if target == "sqlite"
              else self.servers.urls[target])
        options = {"table_prefix": prefix(self.scenario), "polling_interval": 0.2,
                   "visibility_timeout": LEASE}
        return f"sqlinbox+{db}", options, db

    # -- the worker and the jobs --------------------------------------------------------------
    def start_worker(self) -> Proc:
        self.started += 1
        name = f"{self.target}-{self.scenario}-w{self.started}"
        env = {**os.environ, CONFIG_ENV: json.dumps(self.config),
               "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH"))
                                             if p)}
        argv = [*worker_argv("bench.chaos_app", "prefork", CONCURRENCY), "-Q", self.queue,
                "-n", f"{name}@%h"]
        self.worker = Proc(name, argv, env, self.logs / f"{name}.log")
        return self.worker

    def ready(self) -> None:
        worker = self.worker
        assert worker is not None
        wait_until(lambda: " ready." in worker.output(), START_LIMIT,
                   f"{worker.name} to be ready", alive=[worker])

    def publish(self, jobs: list[tuple[str, int, int]]) -> None:
        """Jobs ``(key, fails, priority)``, through one producer."""
        with self.app.producer_or_acquire() as producer:
            for key, fails, priority in jobs:
                self.app.send_task(TASK, args=(key, fails, WORK), queue=self.queue,
                                   routing_key=self.queue, priority=priority, producer=producer)

    def events(self, event: str = "done") -> list[tuple[str, int, float, int]]:
        """``(key, retries, at, pid)`` of every ledger row of this event."""
        with sqlite3.connect(self.ledger, timeout=60) as conn:
            return conn.execute("SELECT key, retries, at, pid FROM runs WHERE event = ?",
                                (event,)).fetchall()

    def done(self) -> int:
        with sqlite3.connect(self.ledger, timeout=60) as conn:
            return int(conn.execute("SELECT COUNT(DISTINCT key) FROM runs WHERE event = 'done'"
                                    ).fetchone()[0])

    def until_done(self, share: float, limit: float = STALL) -> None:
        """Wait until this share of the jobs is done; a worker that exits is replaced."""
        wait_until(lambda: self.tend() or self.done() >= share * self.jobs, limit,
                   f"{share:.0%} of the jobs done", interval=0.2)

    def tend(self) -> bool:
        if self.worker is not None and self.worker.popen.poll() is not None:
            self.note(f"{self.worker.name} exited with {self.worker.popen.returncode}; "
                      f"log {self.worker.log}")
            self.start_worker()
        return False

    def kill(self) -> None:
        """``kill -9`` of the worker's whole process group, and a replacement at once."""
        assert self.worker is not None
        self.fault = time.time()  # when the signal goes: killing waits for the group to go
        self.worker.kill()
        record(self.ledger, "", -1, "kill", self.worker.popen.pid, self.fault)
        self.start_worker()

    # -- the scenarios ---------------------------------------------------------------------------
    def run(self) -> Figures:
        began = time.monotonic()
        low = 9 if self.target == "redis" else 0  # Redis: 0 is the highest priority
        count = self.jobs - HIGH_JOBS if self.scenario == "priority" else self.jobs
        fails = STORM_FAILS if self.scenario == "storm" else 0
        backlog = [(f"j{n}", fails if n % 3 == 0 else 0, low) for n in range(count)]
        with self.app.connection_for_write() as conn:  # the queue (its table) exists first
            self.app.amqp.queues[self.queue].bind(conn.default_channel).declare()
        self.publish(backlog)
        self.start_worker()
        self.ready()
        getattr(self, f"fault_{self.scenario}")()
        self.drain()
        self.finish()
        self.figures.seconds = time.monotonic() - began
        return self.figures

    def fault_kill(self) -> None:
        self.until_done(FAULT_AT)
        self.kill()

    def fault_kills(self) -> None:
        for share in KILLS_AT:
            self.until_done(share)
            self.kill()
            self.ready()

    def fault_sessions(self) -> None:
        for share in SESSIONS_AT:
            self.until_done(share)
            assert self.worker is not None
            self.fault = time.time()  # issued: rabbitmqctl takes seconds to list and close
            ended = self.servers.terminate(self.target, group_ports(self.worker.popen.pid))
            self.note(f"{ended} sessions ended at {share:.0%}")

    def fault_restart(self) -> None:
        self.until_done(FAULT_AT)
        began = time.time()
        self.fault = self.servers.restart(self.target, self.logs / f"restart-{self.target}.log")
        self.note(f"the server answered again {self.fault - began:.1f} s after the restart "
                  "began")

    def fault_hold(self) -> None:
        self.until_done(FAULT_AT)
        before = self.done()
        table = table_name_for_queue(self.queue, prefix(self.scenario))
        with self.servers.held(self.target, self.db, table) as what:
            time.sleep(HOLD)
        self.fault = time.time()
        self.note(f"{what}; {self.done() - before} jobs done during the {HOLD:.0f} s hold")

    def fault_storm(self) -> None:
        """No fault but the failures: recovery is counted from the worker's start."""
        self.fault = time.time()

    def fault_priority(self) -> None:
        self.until_done(HIGH_AFTER / self.jobs)
        high = 0 if self.target == "redis" else 9
        self.fault = time.time()
        self.publish([(f"h{n}", 0, high) for n in range(HIGH_JOBS)])

    # -- the checks ------------------------------------------------------------------------------
    def drain(self) -> None:
        """Until every job is done, or none finished for :data:`STALL` s."""
        last, moved = -1, time.monotonic()
        while (now := self.done()) < self.jobs and time.monotonic() - moved < STALL:
            self.tend()
            if now != last:
                last, moved = now, time.monotonic()
            time.sleep(0.5)

    def finish(self) -> None:
        """Stop the worker (warm), count what is left in the queue, then read the ledger."""
        if self.worker is not None:
            try:
                self.worker.stop(STOP_LIMIT)
            except AssertionError as exc:
                self.note(f"FAILED: {exc}".splitlines()[0])
        with self.app.connection_for_write() as conn:  # declared again: its size
            bound = self.app.amqp.queues[self.queue].bind(conn.default_channel)
            self.figures.left = int(bound.queue_declare().message_count or 0)
        f = self.figures
        done = self.events("done")
        f.done = len({key for key, *_ in done})
        f.lost = self.jobs - f.done
        starts = sorted(self.events("start"), key=lambda e: e[2])
        runs: dict[tuple[str, int], list[float]] = {}
        for key, retries, at, _ in starts:
            runs.setdefault((key, retries), []).append(at)
        fresh = [at for key, retries, at, _ in done  # its run began after the fault
                 if max(s for s in runs[key, retries] if s <= at) >= self.fault]
        if fresh:  # the first job that began after the fault, done
            f.recover = min(fresh) - self.fault
            f.drained = max(at for _, _, at, _ in done) - self.fault
        self.reruns(starts)
        if self.scenario == "priority":
            self.starvation(done)

    def reruns(self, starts: list[tuple[str, int, float, int]]) -> None:
        """Count each run of a delivery after its first: after its ack returned, it ran twice
        after finishing (``killed``: its worker was killed after the ack, before the ack
        reached the broker's store); before, it was redelivered (killed mid-run)."""
        f = self.figures
        acked: dict[tuple[str, int], tuple[float, int]] = {}
        for key, retries, at, pid in self.events("acked"):
            if (key, retries) not in acked or at < acked[key, retries][0]:
                acked[key, retries] = (at, pid)
        kills = self.events("kill")
        seen: set[tuple[str, int]] = set()
        for key, retries, at, _ in starts:
            ack = acked.get((key, retries))
            if ack is not None and at > ack[0]:
                f.twice += 1
                gaps = [when - ack[0] for *_, when, pid in kills
                        if pid == ack[1] and ack[0] <= when <= at]
                f.twice_killed += bool(gaps)
                killed = f", its worker killed {min(gaps) * 1000:.0f} ms after it" if gaps else ""
                self.note(f"FAILED: {key} (retry {retries}) ran again {at - ack[0]:.1f} s after "
                          f"its ack{killed}")
            elif (key, retries) in seen:
                f.redelivered += 1
            seen.add((key, retries))

    def starvation(self, done: list[tuple[str, int, float, int]]) -> None:
        """The high-priority jobs must finish while low ones still wait: they went ahead."""
        highs = [at for key, _, at, _ in done if key.startswith("h")]
        if len(highs) < HIGH_JOBS:
            return
        last = max(highs)
        waiting = sum(1 for key, _, at, _ in done if key.startswith("j") and at > last)
        self.figures.recover = last - self.fault
        self.note(f"the last high-priority job finished {last - self.fault:.1f} s after they "
                  f"were sent, {waiting} low-priority jobs still waiting"
                  if waiting else "FAILED: the high-priority jobs waited for the whole backlog")

    def note(self, message: str) -> None:
        self.figures.notes.append(message)
        progress(f"{self.target}/{self.scenario}: {message}")

    def close(self) -> None:
        if self.worker is not None:
            self.worker.kill()
        with suppress(Exception):
            if self.db is not None and self.target != "sqlite":
                drop_tables(self.db, prefix(self.scenario))
            elif self.db is None:
                with self.app.connection_for_write() as conn:
                    self.app.amqp.queues[self.queue].bind(conn.default_channel).delete()
        self.app.close()


# -- the command --------------------------------------------------------------------------------
def parser() -> argparse.ArgumentParser:
    made = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    made.add_argument("--targets", default=list(TARGETS), type=choices(TARGETS),
                      help=f"comma-separated (default all: {','.join(TARGETS)})")
    made.add_argument("--scenarios", default=list(SCENARIOS), type=choices(SCENARIOS),
                      help=f"comma-separated (default all: {','.join(SCENARIOS)})")
    made.add_argument("--scale", type=float, default=1.0,
                      help="multiplies every scenario's jobs (default 1: 500 to 1,700)")
    for name, (url_env, url, restart_env, restart) in DEFAULTS.items():
        made.add_argument(f"--{name}-url", default=os.environ.get(url_env, url),
                          help=f"{name} server (${url_env}; default {url})")
        made.add_argument(f"--restart-{name}", default=os.environ.get(restart_env, restart),
                          help=f"shell command that restarts it (${restart_env}; "
                               f"default {restart!r})")
    made.add_argument("--rabbitmqctl", default=os.environ.get("CHAOS_RABBITMQCTL", "rabbitmqctl"),
                      help="how to call rabbitmqctl for the RabbitMQ server ($CHAOS_RABBITMQCTL; "
                           "e.g. 'rabbitmqctl -n chaos@localhost')")
    made.add_argument("--json", type=Path, help="also write the figures as JSON here")
    return made


def seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def table(found: list[Figures]) -> str:
    lines = ["| target | scenario | jobs | done | lost | ran twice after finishing "
             "(worker killed after the ack) | redelivered (killed mid-run) | left in queue "
             "| recover (s) | drained (s) | result |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for f in found:
        lines.append(f"| {f.target} | {f.scenario} | {f.jobs:,} | {f.done:,} | {f.lost} "
                     f"| {f.twice} ({f.twice_killed}) | {f.redelivered} | {f.left} "
                     f"| {seconds(f.recover)} | {seconds(f.drained)} "
                     f"| {'ok' if f.ok else 'FAILED'} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    logs = Path(f"/tmp/sqlinbox-chaos-{RUN_ID}")
    logs.mkdir(parents=True, exist_ok=True)
    servers = Servers(args)
    progress(f"chaos {RUN_ID}: worker logs and ledgers in {logs}")
    found: list[Figures] = []
    began = time.monotonic()
    for target in args.targets:
        for scenario in args.scenarios:
            if scenario in NOT_APPLICABLE.get(target, ()):
                continue
            run = Run(servers, target, scenario, args, logs)
            try:
                found.append(run.run())
            except Exception as exc:  # the next scenario still runs
                run.note(f"FAILED: the scenario itself failed: {said(exc)}")
                found.append(run.figures)
            finally:
                run.close()
            f = found[-1]
            progress(f"{target}/{scenario}: done {f.done}/{f.jobs}, lost {f.lost}, "
                     f"twice {f.twice}, recover {seconds(f.recover)} s")
    print(f"\n## Chaos {RUN_ID} ({(time.monotonic() - began) / 60:.1f} min)\n\n{table(found)}\n")
    for f in found:
        for note in f.notes:
            print(f"* {f.target}/{f.scenario}: {note}")
    if args.json:
        args.json.write_text(json.dumps([{**asdict(f), "ok": f.ok} for f in found], indent=2))
    return 0 if all(f.ok for f in found) else 1


if __name__ == "__main__":
    command(main, "the workers are gone")
