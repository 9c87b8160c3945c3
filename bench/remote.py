"""Remote control and events: ``celery inspect ping`` round trip and event delivery.

    python bench/remote.py [--quick] [--databases postgresql,mysql,sqlite] [--json PATH]
                           [--remote-brokers sqlinbox,redis,rabbitmq]

For the sqlinbox transport on each database, and for Redis and RabbitMQ: two real
``celery worker`` processes (prefork -c 1, task events on with ``-E``, heartbeats every
2 s; gossip and mingle off for every broker) on one queue, and an event receiver in
this process from start to end. Then:

* **ping**: ``app.control.ping`` to both workers by name, Celery's default 1 s timeout;
  the round trip until both replied (a call that lost a reply counts as its timeout);
  **ping one**: the same to the first worker alone (it returns with its reply);
* **CLI**: ``celery -A app inspect ping`` as a user runs it (no destination: it waits the
  whole 1 s timeout), wall time including the interpreter's start-up;
* **events**: tasks sent at random gaps; the latency of every task event the workers send
  (received, started, succeeded), from the event's timestamp to its arrival here;
* **heartbeats**: the gaps between worker-heartbeat arrivals per worker (sent every 2 s;
  a monitor counts a worker offline 4 s after its last heartbeat).

Also a section of ``bench/run.py``. Not a test: the figures depend on the machine and
whatever else runs on it.
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # run as a script: import the bench package, not its modules
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from celery import Celery
from celery.utils.nodenames import host_format
from sqlalchemy import create_engine

from bench.celery_app import TASK, counter, make_app
from bench.cli import choices, run_alone
from bench.registry import Cell, Row, Section, gist, goal, guarded, progress, spread
from bench.report import table
from bench.targets import Context, Sizes, Target, celery_env, delete_queue
from bench.workers import MONITORED_FLAGS, REPO, STARTUP, stop_all, worker
from kombu_sqlinbox.urls import sqlalchemy_url

NAME = "remote"
BROKERS = ("sqlinbox", "redis", "rabbitmq")
POOL = ("-P", "prefork", "-c", "1")
WORKERS = ("a", "b")
#: Celery's defaults: ``inspect ping`` waits 1 s; heartbeats every 2 s, offline after 4 s
PING_TIMEOUT = 1.0
HEARTBEAT = 2.0
OFFLINE = 4.0
#: gaps between the tasks of the events measurement, at random up to this (seconds)
TASK_GAP = 0.25
#: heartbeat arrivals are watched for at least this long (seconds)
HEARTBEAT_SPAN = 16.0
#: runs of the ``celery inspect ping`` command (quick: fewer)
CLI_RUNS = 5
QUICK_CLI_RUNS = 3
FIGURES = {
    "ping": "ping p50 / p99 ms",
    "ping1": "ping one p50 / p99 ms",
    "missed": "pings missing a reply",
    "cli": "CLI inspect ping s (p50)",
    "statements": "statements / commits per ping one",
    "events": "task events p50 / p99 ms",
    "heartbeat": "heartbeat gap p50 / max s",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(NAME)
    group.add_argument("--remote-brokers", default=list(BROKERS), type=choices(BROKERS),
                       help=f"default all: {','.join(BROKERS)}")


# -- an event monitor ------------------------------------------------------------------------
@dataclass
class Seen:
    """One event as a monitor got it: type, sending node, its timestamp, arrival here."""

    kind: str
    hostname: str
    sent: float
    arrived: float


@dataclass
class Monitor:
    """An event receiver of ``app`` (what ``celery events`` and Flower run), on a connection
    of its own, noting every event of the nodes ``ours`` accepts."""

    app: Celery
    ours: Callable[[str], bool]
    seen: list[Seen] = field(default_factory=list)
    receiver: Any = None
    consuming: threading.Event = field(default_factory=threading.Event)

    def on_event(self, event: dict[str, Any]) -> None:
        hostname = str(event.get("hostname", ""))
        if self.ours(hostname):
            self.seen.append(Seen(event["type"], hostname, float(event["timestamp"]),
                                  float(event["local_received"])))

    def run(self) -> None:
        """Receive until :meth:`stop` (within a second of it)."""
        with self.app.connection_for_read() as conn:
            self.receiver = self.app.events.Receiver(conn, handlers={"*": self.on_event})
            self.receiver.on_consume_ready = lambda *_, **__: self.consuming.set()
            self.receiver.capture(limit=None, timeout=None, wakeup=False)

    def stop(self) -> None:
        if self.receiver is not None:
            self.receiver.should_stop = True

    def count(self, kind: str) -> int:
        return sum(1 for s in self.seen if s.kind == kind)

    def heartbeat_gaps(self) -> list[float]:
        """Seconds between one worker's heartbeat arrivals, for every worker."""
        arrivals: dict[str, list[float]] = {}
        for s in self.seen:
            if s.kind == "worker-heartbeat":
                arrivals.setdefault(s.hostname, []).append(s.arrived)
        return [b - a for times in arrivals.values() for a, b in pairwise(times)]

    def first_heartbeat(self) -> float | None:
        return min((s.arrived for s in self.seen if s.kind == "worker-heartbeat"), default=None)


@contextmanager
def monitoring(app: Celery, ours: Callable[[str], bool]) -> Iterator[Monitor]:
    """A :class:`Monitor` in a thread of this process, consuming once the block starts."""
    monitor = Monitor(app, ours)
    failed: list[BaseException] = []

    def run() -> None:
        try:
            monitor.run()
        except Exception as exc:  # reported below, in the measuring thread
            failed.append(exc)
            monitor.consuming.set()

    thread = threading.Thread(target=run, name="event-monitor", daemon=True)
    thread.start()
    try:
        if not monitor.consuming.wait(STARTUP) or failed:
            raise RuntimeError("event receiver did not start: "
                               + (gist(str(failed[0])) if failed else "no consumer in time"))
        yield monitor
    finally:
        monitor.stop()
        thread.join(10)


def wait_for(check: Callable[[], bool], seconds: float, what: str,
             workers: list[subprocess.Popen[bytes]]) -> None:
    """Poll ``check`` until true; raise naming ``what`` after ``seconds`` or when a worker
    has exited."""
    deadline = time.monotonic() + seconds
    while not check():
        if any(process.poll() is not None for process in workers):
            raise RuntimeError(f"a worker exited while waiting for {what}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"no {what} within {seconds:.0f} s")
        time.sleep(0.2)


# -- the measurements ------------------------------------------------------------------------
def server_counts(target: Target) -> Callable[[], tuple[int, int]] | None:
    """MariaDB's statements and commits so far, all sessions (its global ``Questions`` and
    ``Com_commit``; the read itself is one more statement); None elsewhere."""
    if target.database != "mysql":
        return None
    engine = create_engine(sqlalchemy_url(target.url), isolation_level="AUTOCOMMIT")

    def counts() -> tuple[int, int]:
        with engine.connect() as conn:
            found: dict[str, Any] = dict(conn.exec_driver_sql(
                "SHOW GLOBAL STATUS WHERE Variable_name IN ('Questions', 'Com_commit')").all())
        return int(found["Questions"]), int(found["Com_commit"])

    return counts


def ping_rows(app: Celery, names: list[str], calls: int,
              counts: Callable[[], tuple[int, int]] | None = None) -> dict[str, Cell]:
    """``calls`` pings to both workers, one after another, then as many to the first alone
    (a reply limit of one): round trip ms, calls short of a reply; with ``counts``, the
    server's statements and commits per ping to one worker (its workers' idle polls,
    heartbeats and this process's event receiver included)."""
    found: dict[int, list[float]] = {len(names): [], 1: []}
    missed = 0
    first = None
    for many, _ in [(many, call) for many in found for call in range(calls)]:
        if many == 1 and first is None and counts is not None:
            first = counts()
        began = time.perf_counter()
        replies = app.control.ping(destination=names[:many], timeout=PING_TIMEOUT)
        found[many].append((time.perf_counter() - began) * 1000)
        missed += len(replies) < many
        time.sleep(random.uniform(0, 0.05))
    cells = {"ping": spread(found[len(names)]), "ping1": spread(found[1]),
             "missed": Cell(missed, f"{missed} of {calls * 2}")}
    if counts is not None and first is not None:
        last = counts()
        statements, commits = ((b - a) / calls for a, b in zip(first, last, strict=True))
        statements -= 1 / calls  # the first read of the counts
        cells["statements"] = Cell(statements, f"{statements:.1f} / {commits:.1f}",
                                   {"statements": statements, "commits": commits})
    return cells


def cli_ping(env: dict[str, str], names: list[str], runs: int) -> Cell:
    """``celery -A bench.celery_app inspect ping``: wall seconds (p50), runs that listed
    both workers."""
    found, both = [], 0
    for _ in range(runs):
        began = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-m", "celery", "-A", "bench.celery_app", "inspect", "ping"],
            env=env, cwd=REPO, capture_output=True, text=True, timeout=60)
        found.append(time.perf_counter() - began)
        both += all(name in done.stdout for name in names)
        if done.returncode != 0 and not both:
            raise RuntimeError(f"celery inspect ping: exit {done.returncode}: "
                               + gist(done.stdout + done.stderr))
    median = statistics.median(found)
    return Cell(median, f"{median:.2f} ({both}/{runs} both)", {"runs": found, "both": both})


def event_rows(app: Celery, monitor: Monitor, queue: str, tasks: int, key: str,
               workers: list[subprocess.Popen[bytes]]) -> dict[str, Cell]:
    """Send ``tasks`` tasks at random gaps; latency of every task event of ours, and the
    heartbeat gaps seen meanwhile (watched for at least :data:`HEARTBEAT_SPAN` s)."""
    with app.producer_or_acquire() as producer:
        for _ in range(tasks):
            app.send_task(TASK, args=(key, tasks), queue=queue, producer=producer)
            time.sleep(random.uniform(0, TASK_GAP))
    wait_for(lambda: monitor.count("task-succeeded") >= tasks, 30.0,
             f"task-succeeded events for all {tasks} tasks", workers)
    first = monitor.first_heartbeat() or time.time()
    wait_for(lambda: time.time() - first >= HEARTBEAT_SPAN, HEARTBEAT_SPAN + 5,
             "heartbeat watch", workers)
    latencies = [(s.arrived - s.sent) * 1000 for s in monitor.seen if s.kind.startswith("task-")]
    gaps = monitor.heartbeat_gaps()
    heartbeat = Cell(max(gaps), f"{statistics.median(gaps):.2f} / {max(gaps):.2f}",
                     {"gaps": len(gaps), "median": statistics.median(gaps)}) if gaps else Cell(
        None, "no heartbeats")
    return {"events": spread(latencies), "heartbeat": heartbeat}


def measure(target: Target, ctx: Context, cli_runs: int) -> dict[str, Cell]:
    """Two monitored workers on ``target``, an event receiver here, then every figure."""
    queue = ctx.queue_name("remote")
    env = celery_env(target, queue)
    app = make_app(target.url, target.transport_options, queue, target.polling_interval)
    names = [host_format(f"{queue}{w}@%h") for w in WORKERS]
    key = f"bench:{ctx.run_id}:{queue}"
    samples = ctx.sizes.latency
    try:
        with app.connection_for_write() as conn:
            if not conn.supports_exchange_type("fanout"):
                raise RuntimeError("the transport offers no fanout exchange: Celery turns "
                                   "remote control and events off")
        with ExitStack() as stack:
            workers = [stack.enter_context(worker(
                "bench.celery_app", POOL, queue, env, ctx.scratch / f"{queue}{w}.log",
                name=f"{queue}{w}", flags=MONITORED_FLAGS)) for w in WORKERS]
            stack.callback(stop_all, workers)
            monitor = stack.enter_context(monitoring(app, lambda host: host in names))
            wait_for(lambda: len(app.control.ping(destination=names, timeout=PING_TIMEOUT))
                     == len(names), STARTUP * 2, "ping reply from both workers", workers)
            cells = ping_rows(app, names, samples, server_counts(target))
            cells["cli"] = guarded(lambda: cli_ping(env, names, cli_runs))
            events = event_rows(app, monitor, queue, samples, key, workers)
            return {**cells, **events}
    finally:
        app.close()
        counter().delete(key, f"{key}:1", f"{key}:{samples}")
        delete_queue(target, queue)


# -- section -------------------------------------------------------------------------------
def targets_of(ctx: Context, args: argparse.Namespace) -> list[Target]:
    found = [ctx.sqlinbox(database, "remote") for database in args.databases
             if "sqlinbox" in args.remote_brokers]
    return found + ctx.server_targets(set(args.remote_brokers))


def run(args: argparse.Namespace) -> list[Row]:
    """A row per broker (``args``: ``quick``, ``databases``, ``remote_brokers``)."""
    rows: list[Row] = []
    cli_runs = QUICK_CLI_RUNS if args.quick else CLI_RUNS
    with Context(Sizes().quick() if args.quick else Sizes()) as ctx:
        for target in targets_of(ctx, args):
            try:
                cells = measure(target, ctx, cli_runs)
            except Exception as exc:  # one broker failing must not end the run
                cells = dict.fromkeys(FIGURES, Cell.failed(exc))
            progress(f"{NAME} {target.label}: "
                     + ", ".join(f"{k}={c.text}" for k, c in cells.items()))
            rows += [cell.row(NAME, target.database, target.broker, figure)
                     for figure, cell in cells.items()]
    return rows


def markdown(rows: list[Row], args: argparse.Namespace) -> str:
    samples = (Sizes().quick() if args.quick else Sizes()).latency
    cli_runs = QUICK_CLI_RUNS if args.quick else CLI_RUNS
    order = [*args.databases, None]
    shown = sorted(rows, key=lambda r: order.index(r["database"]))
    return "\n".join([
        table(shown, FIGURES, "broker"),
        "",
        f"Two workers (prefork -c 1, -E, heartbeats every {HEARTBEAT:g} s) on one queue and "
        f"an event receiver in the benchmark process. Ping: {samples} "
        f"app.control.ping calls to both workers by name, timeout {PING_TIMEOUT:g} s (a "
        "call short of a reply counts as its timeout); ping one: as many to the first "
        "worker alone. Statements / commits (MariaDB): the server's, all sessions, per "
        "ping one, the workers' idle polls, heartbeats and events included. "
        f"CLI: {cli_runs} runs of "
        "`celery -A app inspect ping` (waits its whole 1 s timeout), wall time with "
        f"start-up; (k/n both): runs that listed both workers. Events: {samples} tasks "
        f"at random gaps up to {TASK_GAP * 1000:.0f} ms; task-received/started/succeeded, "
        "event timestamp to arrival. Heartbeat gap: between one worker's heartbeat "
        f"arrivals, watched for at least {HEARTBEAT_SPAN:.0f} s; a monitor marks a "
        f"worker offline after {OFFLINE:g} s. Redis and RabbitMQ (database -) are measured "
        "once.",
    ])


def targets(rows: list[Row]) -> list[Row]:
    found = []
    for r in rows:
        if r["setup"] != "sqlinbox" or r["value"] is None:
            continue
        if r["figure"] == "missed":
            found.append(goal(NAME, r["database"], "pings missing a reply (1 s timeout)",
                              r["value"], 0, at_most=True))
        elif r["figure"] == "heartbeat":
            found.append(goal(NAME, r["database"], "longest heartbeat gap, s", r["value"],
                              OFFLINE, at_most=True))
    return found


SECTION = Section(NAME, "Remote control and events: inspect ping, event delivery",
                  add_arguments, run, markdown, targets)

if __name__ == "__main__":
    run_alone(SECTION)
