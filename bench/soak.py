"""Chaos soak: every kind of task under kills, server restarts and injected failures.

    python bench/soak.py [--databases postgresql,mysql,sqlite] [--minutes N] [--tasks N]
                         [--workers N] [--concurrency N] [--kill-every S]
                         [--restart-every S | --no-restarts] [--kinds ...] [--drain S]

For each database in turn, for ``--minutes``: real ``celery worker`` processes (prefork
and threads pools, alternating) run the tasks of :mod:`bench.soak_app` while tasks of
every kind are published; every ``--kill-every`` seconds or so a random worker's whole
process group gets ``kill -9`` (one time in four a warm shutdown instead) and a
replacement starts; the PostgreSQL / MariaDB server restarts about every
``--restart-every`` seconds; the outbox sends again what stayed unprocessed past its
grace period. Then the queues drain (bounded), the workers get a warm shutdown, and the
ledger, the dead-letter queue and the outbox are checked. Exit status 1 when an
invariant fails: an effect lost or (where exactly once is promised) twice, a FIFO group
out of order, a worker hung, an outbox record left unprocessed, a dead letter that was
not injected.

Restarts take the shared servers away from anyone else using them: run it alone. The
servers are always left running, also on Ctrl-C or an error. Not a test and not in CI.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass, field
from itertools import pairwise
from pathlib import Path
from types import FrameType

if __name__ == "__main__":  # run as a script: import the bench package, not its modules
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from sqlalchemy import func, select, text

from bench.cli import choices, command
from bench.registry import progress
from bench.soak_app import (
    CONFIG_ENV,
    DEAD,
    EXACTLY_ONCE,
    KINDS,
    LEASE,
    PERMANENT,
    make_app,
    queue_table,
    tables,
)
from bench.targets import DATABASES, Context
from celery_ext.outbox import engine_from_url, outbox_of
from kombu_sqlinbox.brokers import close_all
from tests.processes import ROOT, START_LIMIT, STOP_LIMIT, Proc, worker_argv, worker_ready
from tests.servers import restart_server, server_answers, start_server

#: each kind's share of the tasks
MIX = {"plain": 3, "fifo": 2, "keyed": 2, "tx": 2, "txout": 1, "outbox": 1}
#: the failures injected into each kind, as shares of its tasks (see bench/soak_app.py);
#: no ``flaky`` in FIFO groups: Celery's retry sends a new message, last in its group
FATES: dict[str, dict[str, float]] = {
    "plain": {"flaky": 0.03, "retry": 0.03, "doomed": 0.01},
    "fifo": {"retry": 0.03, "doomed": 0.01},
    "keyed": {"flaky": 0.03, "retry": 0.03},
    "tx": {"flaky": 0.03, "retry": 0.03, "nonnull": 0.01, "twice": 0.02},
    "txout": {"flaky": 0.03, "retry": 0.03},
    "outbox": {"flaky": 0.03},
}
#: FIFO groups, and partition keys, the tasks of those kinds spread over
GROUPS = 20
POOLS = ("prefork", "threads")
#: most tasks published and not yet done: queue waits stay well inside the outbox's grace
BACKLOG = 1500
#: publishing ends this far into the run, so the last tasks run under chaos too
PUBLISH_SHARE = 0.8
TICK = 0.25
#: the share of strikes that are a warm shutdown (SIGTERM) instead of kill -9
WARM_SHARE = 0.25
#: the longest a publish, a republish or closing may take before it counts as stuck
SERVICE_LIMIT = 60.0
#: the drain gives up when nothing moved for this long
STALL = 120.0


@dataclass(frozen=True)
class Planned:
    """One task: its kind, key (first argument), fate (second), and for ``fifo`` / ``keyed``
    its group and place in it."""

    kind: str
    key: str
    fate: str
    group: str | None = None
    seq: int = 0

    @property
    def copies(self) -> int:
        return 2 if self.fate == "twice" else 1

    @property
    def headers(self) -> dict[str, str]:
        header = {"fifo": "group_key", "keyed": "partition_key"}.get(self.kind)
        return {header: self.group} if header and self.group else {}


def plan(count: int, kinds: list[str], rng: random.Random) -> list[Planned]:
    """``count`` tasks of the chosen kinds, fates drawn per :data:`FATES`."""
    groups: Counter[str] = Counter()
    made = []
    for n, kind in enumerate(rng.choices(kinds, [MIX[k] for k in kinds], k=count)):
        roll, fate = rng.random(), "ok"
        for name, share in FATES[kind].items():
            if roll < share:
                fate = name
                break
            roll -= share
        group = None
        if kind in ("fifo", "keyed"):
            group = f"{kind[0]}{rng.randrange(GROUPS)}"
            groups[group] += 1
        made.append(Planned(kind, f"{kind}-{n}", fate, group, groups[group] if group else 0))
    return made


@dataclass
class Figures:
    """What one database's soak found."""

    database: str
    minutes: float = 0.0
    published: int = 0
    publish_errors: int = 0
    kills: int = 0
    #: warm shutdowns among the strikes
    stops: int = 0
    restarts: int = 0
    #: workers that ended by themselves (each was replaced)
    exits: int = 0
    hung: int = 0
    runs: int = 0
    #: at-least-once keys whose effect landed more than once (allowed, reported)
    duplicates: int = 0
    #: exactly-once keys whose effect landed more than once (must be 0)
    twice: int = 0
    lost: int = 0
    fifo_disorder: int = 0
    outbox_left: int = 0
    outbox_resent: int = 0
    dead: int = 0
    dead_unexpected: int = 0
    left_in_queues: int = 0
    drain_seconds: float = 0.0
    #: the publishing side (or closing) got stuck in the library
    stuck_service: bool = False
    #: why the soak itself stopped early, if it did
    broken: str = ""
    notes: list[str] = field(default_factory=list)

    def failures(self) -> list[str]:
        checks = {"lost": self.lost, "exactly-once effects twice": self.twice,
                  "FIFO groups out of order": self.fifo_disorder, "hung workers": self.hung,
                  "workers that exited by themselves": self.exits,
                  "outbox records left unprocessed": self.outbox_left,
                  "dead letters not injected": self.dead_unexpected,
                  "rows left in the queues": self.left_in_queues,
                  "publishing stuck in the library": int(self.stuck_service)}
        found = [f"{what}: {count}" for what, count in checks.items() if count]
        return [f"the soak did not finish: {self.broken}", *found] if self.broken else found


class Worker:
    """One ``celery worker`` of the soak, and by when it must be ready (or, once told to
    stop, gone)."""

    def __init__(self, proc: Proc) -> None:
        self.proc = proc
        self.deadline = time.monotonic() + START_LIMIT
        self.ready = False

    def check_ready(self) -> bool:
        self.ready = self.ready or worker_ready(self.proc)
        return self.ready


class Soak:
    """The soak on one database."""

    def __init__(self, ctx: Context, database: str, args: argparse.Namespace,
                 logs: Path) -> None:
        self.database = database
        self.args = args
        self.logs = logs
        self.db_url = ctx.url(database, "soak")
        self.prefix = ctx.prefix
        self.config = {"db_url": self.db_url, "prefix": ctx.prefix,
                       "keyed_claim": "lease" if database == "sqlite" else args.keyed_claim}
        self.app = make_app(self.config)
        self.outbox = outbox_of(self.app)
        self.engine = engine_from_url(self.db_url)
        self.rng = random.Random(args.seed)
        self.planned = plan(args.tasks, args.kinds, self.rng)
        self.sent = 0  # planned tasks published, in order
        self.checked = 0  # of which the checks look at (all, unless publishing got stuck)
        #: held by the publishing side for a batch, by a server restart meanwhile
        self.quiet = threading.Lock()
        self.closing = threading.Event()
        self.uncertain: set[str] = set()
        self.workers: list[Worker] = []
        self.stopping: list[Worker] = []
        self.started = 0
        self.figures = Figures(database)
        self.done_seen = (0, 0.0)  # (effects, when counted)

    # -- workers ----------------------------------------------------------------------------
    def start_worker(self, slot: int) -> Worker:
        self.started += 1
        name = f"{self.database}-w{self.started}"
        argv = [*worker_argv("bench.soak_app", POOLS[slot % len(POOLS)], self.args.concurrency),
                "-Q", ",".join(self.args.kinds), "-n", f"{name}@%h"]
        env = {**os.environ, CONFIG_ENV: json.dumps(self.config),
               "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH"))
                                             if p)}
        return Worker(Proc(name, argv, env, self.logs / f"{name}.log"))

    def tend_workers(self) -> None:
        """Replace a worker that ended by itself; one not ready within :data:`START_LIMIT` s,
        or still there :data:`STOP_LIMIT` s after its warm shutdown began, hung."""
        now = time.monotonic()
        for worker in list(self.stopping):
            if worker.proc.popen.poll() is not None:
                worker.proc.wait(1.0)  # and its pool children, if any stayed
            elif now > worker.deadline:
                self.hung(worker, f"ignored the warm shutdown for {STOP_LIMIT:.0f} s")
            else:
                continue
            self.stopping.remove(worker)
        for slot, worker in enumerate(self.workers):
            if worker.proc.popen.poll() is not None:
                self.figures.exits += 1
                self.note(f"{worker.proc.name} exited with {worker.proc.popen.returncode}; "
                          f"log {worker.proc.log}")
            elif not worker.check_ready() and now > worker.deadline:
                self.hung(worker, f"not ready within {START_LIMIT:.0f} s")
            else:
                continue
            self.workers[slot] = self.start_worker(slot)

    def hung(self, worker: Worker, what: str) -> None:
        self.figures.hung += 1
        self.note(f"{worker.proc.name} {what}; log {worker.proc.log}")
        worker.proc.kill()

    def stop(self, worker: Worker) -> None:
        """Begin a warm shutdown; :meth:`tend_workers` sees it through."""
        worker.proc.terminate()
        worker.deadline = time.monotonic() + STOP_LIMIT
        self.stopping.append(worker)

    def strike(self) -> None:
        """``kill -9`` of a random ready worker's process group (or, for a share
        :data:`WARM_SHARE` of the strikes, a warm shutdown), and a replacement at once."""
        ready = [slot for slot, worker in enumerate(self.workers) if worker.check_ready()]
        if not ready:
            return
        slot = self.rng.choice(ready)
        if self.rng.random() < WARM_SHARE:
            self.stop(self.workers[slot])
            self.figures.stops += 1
        else:
            self.workers[slot].proc.kill()
            self.figures.kills += 1
        self.workers[slot] = self.start_worker(slot)

    def stop_workers(self) -> None:
        """Warm shutdown of every worker, waited for (bounded: a worker still there after
        :data:`STOP_LIMIT` s hung)."""
        for worker in self.workers:
            self.stop(worker)
        self.workers = []
        while self.stopping:
            self.tend_workers()
            time.sleep(0.2)

    # -- the server -------------------------------------------------------------------------
    def restart(self) -> None:
        """Restart the server, with the publishing side paused (it finishes its batch first,
        unless it is stuck)."""
        paused = self.quiet.acquire(timeout=SERVICE_LIMIT)
        try:
            restart_server(self.database, self.db_url)
            self.figures.restarts += 1
        except Exception as exc:
            self.note(f"server restart failed: {said(exc)}")
        finally:
            self.ensure_server()
            self.engine.dispose()
            if paused:
                self.quiet.release()

    def ensure_server(self) -> None:
        if self.database != "sqlite" and server_answers(self.db_url) is not None:
            start_server(self.database, self.db_url)

    # -- publishing -------------------------------------------------------------------------
    def effects(self) -> int:
        """Effects so far (counted at most every 2 s; the last count while the database is
        away)."""
        count, at = self.done_seen
        if time.monotonic() - at > 2.0:
            ledger, _ = tables(self.prefix)
            with suppress(Exception), self.engine.connect() as conn:
                count = int(conn.execute(select(func.count()).select_from(ledger)
                                         .where(ledger.c.event == "done")).scalar_one())
            self.done_seen = (count, time.monotonic())
        return count

    def publish(self, due: int) -> None:
        """Publish the next ``due`` planned tasks; a failed publish makes its task uncertain
        (its outcome is not checked) and ends the batch."""
        with self.quiet, self.app.producer_or_acquire() as producer:
            for planned in self.planned[self.sent:self.sent + due]:
                sent = 0
                try:
                    for _ in range(planned.copies):
                        self.app.send_task(
                            f"soak.{planned.kind}", args=(planned.key, planned.fate),
                            queue=planned.kind, headers=planned.headers, producer=producer)
                        sent += 1
                except Exception as exc:  # its outcome is unknown: left out of the checks
                    self.figures.publish_errors += 1
                    self.note(f"publish of {planned.key} failed: {said(exc)}")
                    self.uncertain.add(planned.key)
                    self.sent += 1
                    self.figures.published += sent
                    return
                self.sent += 1
                self.figures.published += sent

    def publish_due(self, elapsed: float, duration: float) -> None:
        rate = len(self.planned) / (PUBLISH_SHARE * duration)
        due = min(int(rate * elapsed) - self.sent, len(self.planned) - self.sent, 500)
        if due > 0 and self.figures.published - self.effects() < BACKLOG:
            self.publish(due)

    def service(self, began: float, duration: float) -> None:
        """The service's side, in a thread of its own, so that a publish stuck in the library
        stops neither the chaos nor the clock: tasks published at an even pace (at most
        :data:`BACKLOG` waiting), and the outbox republished every grace period, as a beat
        schedule would. Nothing is published while the server restarts."""
        next_republish = began
        while not self.closing.is_set():
            now = time.monotonic()
            self.publish_due(now - began, duration)
            if now >= next_republish:
                with self.quiet:
                    self.republish(older_than=None)
                next_republish = now + self.outbox.grace
            self.closing.wait(TICK)

    def end_service(self, thread: threading.Thread) -> None:
        """Stop publishing; a publish still stuck after :data:`SERVICE_LIMIT` s is a hang."""
        self.closing.set()
        thread.join(SERVICE_LIMIT)
        self.checked = self.sent
        if thread.is_alive():
            self.figures.stuck_service = True
            stuck = self.planned[self.sent].key if self.sent < len(self.planned) else "-"
            self.note(f"the publishing side is stuck in the library (at {stuck}) for more "
                      f"than {SERVICE_LIMIT:.0f} s")
            self.uncertain.add(stuck)

    def bounded(self, work: Callable[[], object], what: str,
                limit: float = SERVICE_LIMIT) -> None:
        """Run ``work`` in a thread of its own and wait at most ``limit`` s for it."""
        thread = threading.Thread(target=work, name=what, daemon=True)
        thread.start()
        thread.join(limit)
        if thread.is_alive():
            self.figures.stuck_service = True
            self.note(f"{what} is stuck in the library for more than {limit:.0f} s")

    # -- the run ----------------------------------------------------------------------------
    def prepare(self) -> None:
        """The ledger, the outbox and every queue's table, before several workers start
        (first use of a new table from several processes at once is racy)."""
        ledger, _ = tables(self.prefix)
        ledger.metadata.create_all(self.engine)
        self.outbox.create()
        with self.app.connection_for_write() as conn:
            for queue in [*self.args.kinds, DEAD]:
                conn.default_channel.queue_declare(queue)

    def run(self) -> Figures:
        self.prepare()
        self.workers = [self.start_worker(slot) for slot in range(self.args.workers)]
        duration = self.args.minutes * 60.0
        restarts = self.database != "sqlite" and not self.args.no_restarts
        began = time.monotonic()
        next_kill = began + self.jitter(self.args.kill_every)
        next_restart = began + self.jitter(self.args.restart_every)
        next_report = began
        service = threading.Thread(target=self.service, args=(began, duration),
                                   name="service", daemon=True)
        service.start()
        while (now := time.monotonic()) < began + duration:
            self.tend_workers()
            if now >= next_kill:
                self.strike()
                next_kill = now + self.jitter(self.args.kill_every)
            if restarts and now >= next_restart:
                self.restart()
                next_restart = time.monotonic() + self.jitter(self.args.restart_every)
            if now >= next_report:
                self.report(now - began)
                next_report = now + 15.0
            time.sleep(TICK)
        self.figures.minutes = (time.monotonic() - began) / 60.0
        self.end_service(service)
        self.drain()
        self.stop_workers()
        self.check()
        return self.figures

    def republish(self, older_than: float | None) -> None:
        try:
            done = self.outbox.republish(older_than=older_than)
        except Exception as exc:  # the server may be restarting; the next round sends them
            self.note(f"outbox republish failed: {said(exc)}")
            return
        self.figures.outbox_resent += done.sent
        if done.failed:
            self.note(f"outbox republish could not send records {list(done.failed)[:8]}")

    def jitter(self, seconds: float) -> float:
        return seconds * self.rng.uniform(0.5, 1.5)

    def report(self, elapsed: float) -> None:
        ready = sum(worker.ready for worker in self.workers)
        f = self.figures
        progress(f"{self.database} {elapsed:5.0f}s: published {f.published}, effects "
                 f"{self.effects()}, kills {f.kills}, restarts {f.restarts}, workers ready "
                 f"{ready}/{len(self.workers)}")

    def queue_tables(self) -> list[str]:
        return [queue_table(self.prefix, kind) for kind in self.args.kinds]

    def rows_left(self) -> int:
        with self.engine.connect() as conn:
            quote = conn.dialect.identifier_preparer.quote
            return sum(int(conn.execute(text(f"SELECT COUNT(*) FROM {quote(name)}"))
                           .scalar_one()) for name in self.queue_tables())

    def drain(self) -> None:
        """Keep the workers (no more chaos) until every queue is empty and every outbox record
        processed, for at most ``--drain`` s; records whose messages are gone once the
        queues are empty are sent again, as the outbox's republish would after its grace."""
        began = time.monotonic()
        last, moved = (-1, -1), began
        while time.monotonic() - began < self.args.drain:
            self.tend_workers()
            try:
                left, unprocessed = self.rows_left(), self.outbox.status().unprocessed
            except Exception as exc:  # the database is back soon after a restart
                self.note(f"drain: {said(exc)}")
                left, unprocessed = last
            if (left, unprocessed) == (0, 0):
                break
            if left == 0 and time.monotonic() - moved > 10.0:
                self.bounded(lambda: self.republish(older_than=0), "outbox republish")
                moved = time.monotonic()
            if (left, unprocessed) != last:
                last, moved = (left, unprocessed), time.monotonic()
            elif time.monotonic() - moved > STALL:
                self.note(f"drain stalled for {STALL:.0f} s: {left} rows left, "
                          f"{unprocessed} outbox records unprocessed")
                break
            time.sleep(1.0)
        self.figures.drain_seconds = time.monotonic() - began
        progress(f"{self.database}: drained in {self.figures.drain_seconds:.0f}s")

    # -- checking ---------------------------------------------------------------------------
    def keys_in(self, tables: Sequence[str]) -> Counter[str]:
        """The key (first argument) of every message in these queue tables, read in SQL:
        the payload column holds the task's body, ``[args, kwargs, embed]``."""
        found: Counter[str] = Counter()
        with self.engine.connect() as conn:
            quote = conn.dialect.identifier_preparer.quote
            for name in tables:
                for (payload,) in conn.execute(text(f"SELECT payload FROM {quote(name)}")):
                    if isinstance(payload, bytes | memoryview):
                        payload = bytes(payload).decode("utf-8", "replace")
                    try:
                        found[str(json.loads(payload)[0][0])] += 1
                    except (ValueError, LookupError, TypeError):
                        found[f"undecodable row of {name}"] += 1
        return found

    def check(self) -> None:
        f = self.figures
        ledger, _ = tables(self.prefix)
        with self.engine.connect() as conn:
            counts = conn.execute(select(ledger.c.key, ledger.c.event, func.count())
                                  .group_by(ledger.c.key, ledger.c.event)).all()
            fifo = conn.execute(select(ledger.c.key, ledger.c.event, ledger.c.at).where(
                ledger.c.kind == "fifo").order_by(ledger.c.n)).all()
        done = Counter({key: n for key, event, n in counts if event == "done"})
        f.runs = sum(n for _, event, n in counts if event == "start")
        dead = self.keys_in([queue_table(self.prefix, DEAD)])
        queued = self.keys_in(self.queue_tables())
        f.dead, f.left_in_queues = sum(dead.values()), sum(queued.values())
        lost: list[Planned] = []
        unexpected: list[str] = []
        for planned in self.planned[:self.checked]:
            key = planned.key
            if key in self.uncertain:
                continue
            if dead[key] and (planned.fate not in PERMANENT or dead[key] > planned.copies):
                unexpected.append(key)  # not injected, or dead-lettered twice
            elif not (done[key] or dead[key] or queued[key]):
                lost.append(planned)  # its message is gone, its work never done
            elif done[key] > 1 and planned.kind in EXACTLY_ONCE:
                f.twice += 1
                self.note(f"{key} ({planned.fate}): effect {done[key]} times")
            elif done[key] > 1:
                f.duplicates += 1
        keys = {p.key for p in self.planned}
        unexpected += [key for key in dead if key not in keys]
        f.lost, f.dead_unexpected = len(lost), len(unexpected)
        if lost:
            fates = Counter(f"{p.kind}/{p.fate}" for p in lost)
            self.note(f"lost by kind/fate: {dict(fates)}; first {[p.key for p in lost[:8]]}")
        if unexpected:
            self.note(f"dead letters not injected: {unexpected[:8]}")
        f.fifo_disorder = self.fifo_disorder([(key, event, at) for key, event, at in fifo])
        f.outbox_left = self.outbox.status().unprocessed
        if queued:
            self.note(f"left in the queues: {sorted(queued)[:8]}")

    def fifo_disorder(self, events: Sequence[tuple[str, str, float]]) -> int:
        """Groups out of order: a row's effect after a later row's (the same row again,
        after a kill, is in order), or a row started before the previous row's last
        effect (two rows of the group in work at once). ``events``: the FIFO ledger rows
        (key, event, when) in the order they were written."""
        where = {p.key: (p.group, p.seq) for p in self.planned if p.kind == "fifo"}
        latest: dict[str | None, int] = {}
        first_start: dict[str, float] = {}
        last_done: dict[str, float] = {}
        disordered: set[str | None] = set()
        for key, event, at in events:
            group, seq = where[key]
            if event == "start":
                first_start.setdefault(key, at)
                continue
            last_done[key] = at
            if seq < latest.get(group, 0):
                disordered.add(group)
                self.note(f"FIFO group {group}: row {seq} done after row {latest[group]}")
            latest[group] = max(seq, latest.get(group, 0))
        rows: dict[str | None, list[tuple[int, str]]] = {}
        for key, (group, seq) in where.items():
            rows.setdefault(group, []).append((seq, key))
        for group, mine in rows.items():
            ordered = [key for _, key in sorted(mine)]
            for before, after in pairwise(ordered):
                if (before in last_done and after in first_start
                        and first_start[after] < last_done[before]):
                    disordered.add(group)
                    self.note(f"FIFO group {group}: {after} started before {before} was done")
        return len(disordered)

    def note(self, message: str) -> None:
        self.figures.notes.append(message)
        progress(f"{self.database}: {message}")

    def close(self) -> None:
        """Every worker gone, the server running, this process's connections closed."""
        self.closing.set()
        for worker in self.workers + self.stopping:
            worker.proc.kill_group()
            with suppress(Exception):
                worker.proc.popen.wait(10)
        self.ensure_server()

        def disconnect() -> None:
            self.app.close()
            self.outbox.close()
            self.engine.dispose()
            close_all()

        self.bounded(disconnect, "closing the connections")


# -- the command ----------------------------------------------------------------------------
def parser() -> argparse.ArgumentParser:
    made = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    made.add_argument("--databases", default=list(DATABASES), type=choices(DATABASES),
                      help=f"comma-separated (default all: {','.join(DATABASES)})")
    made.add_argument("--minutes", type=float, default=10.0,
                      help="chaos per database (default 10)")
    made.add_argument("--tasks", type=int, default=20000,
                      help="tasks per database (default 20000; published over the first "
                           f"{PUBLISH_SHARE * 100:.0f}%% of the minutes, at most {BACKLOG} "
                           "waiting)")
    made.add_argument("--kinds", default=list(KINDS), type=choices(KINDS),
                      help=f"kinds of task (default all: {','.join(KINDS)})")
    made.add_argument("--workers", type=int, default=3,
                      help="celery workers at any time (pools alternate prefork, threads)")
    made.add_argument("--concurrency", type=int, default=2, help="pool size of each worker")
    made.add_argument("--kill-every", type=float, default=20.0,
                      help="seconds between kill -9 of a worker, on average (default 20)")
    made.add_argument("--restart-every", type=float, default=60.0,
                      help="seconds between server restarts, on average (default 60)")
    made.add_argument("--no-restarts", action="store_true",
                      help="never restart the database servers (when others use them)")
    made.add_argument("--drain", type=float, default=300.0,
                      help="longest wait for the queues to drain at the end (default 300 s)")
    made.add_argument("--keyed-claim", default="advisory", choices=("advisory", "lease"),
                      help="claim form of the partition-keyed queue on PostgreSQL and "
                           "MariaDB (default advisory; SQLite has only lease)")
    made.add_argument("--pg-driver", default="psycopg2", choices=("psycopg2", "psycopg"),
                      help="PostgreSQL driver (default psycopg2)")
    made.add_argument("--seed", type=int, default=None, help="random seed (default: new)")
    made.add_argument("--json", type=Path, help="also write the figures as JSON here")
    made.add_argument("--keep", action="store_true",
                      help="keep the tables and the SQLite file for a look afterwards")
    return made


def table(found: list[Figures]) -> str:
    lines = ["| database | minutes | tasks published | kills | restarts | runs | duplicates "
             "| lost | FIFO groups out of order | hung workers | outbox left unprocessed "
             "| dead-lettered (not injected) | result |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for f in found:
        result = "ok" if not f.failures() else "FAILED"
        lines.append(
            f"| {f.database} | {f.minutes:.1f} | {f.published:,} | {f.kills} (+{f.stops} warm) "
            f"| {f.restarts} "
            f"| {f.runs:,} | {f.duplicates} (+{f.twice} exactly-once) | {f.lost} "
            f"| {f.fifo_disorder} | {f.hung} | {f.outbox_left} "
            f"| {f.dead} ({f.dead_unexpected}) | {result} |")
    return "\n".join(lines)


def details(f: Figures) -> str:
    lines = [f"### {f.database}",
             f"publish errors {f.publish_errors}, workers that exited by themselves "
             f"{f.exits}, outbox records sent again {f.outbox_resent}, rows "
             f"left in the queues {f.left_in_queues}, drain {f.drain_seconds:.0f} s"]
    lines += [f"* FAILED: {failure}" for failure in f.failures()]
    lines += [f"* {note}" for note in f.notes[:40]]
    if len(f.notes) > 40:
        lines.append(f"* ... {len(f.notes) - 40} more notes")
    return "\n".join(lines)


def said(exc: BaseException) -> str:
    """An exception's type and the first line of its message."""
    return f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"


def interrupted(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


@contextmanager
def shielded() -> Iterator[None]:
    """Clean-up runs to its end (each of its steps is bounded): a second Ctrl-C or SIGTERM
    meanwhile is ignored, so no worker and no stopped server is left behind."""
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    signal.signal(signal.SIGTERM, interrupted)  # cleans up as Ctrl-C does
    found: list[Figures] = []
    ctx = Context(pg_driver=args.pg_driver)
    logs = Path(f"/tmp/sqlinbox-soak-{ctx.run_id}")
    logs.mkdir(parents=True, exist_ok=True)
    progress(f"soak {ctx.run_id}: worker logs in {logs}; lease {LEASE:.0f} s")
    try:
        for database in args.databases:
            soak = Soak(ctx, database, args, logs)
            try:
                found.append(soak.run())
            except Exception as exc:  # the next database still runs
                soak.figures.broken = said(exc)
                soak.note(f"the soak itself failed: {soak.figures.broken}")
                found.append(soak.figures)
            finally:
                with shielded():
                    soak.close()
    finally:
        if not args.keep:
            with shielded():
                ctx.__exit__(None, None, None)  # drops the run's tables
    print(f"\n## Chaos soak {ctx.run_id}\n\n{table(found)}\n")
    for figures in found:
        print(details(figures) + "\n")
    if args.json:
        args.json.write_text(json.dumps([{**asdict(f), "failures": f.failures()}
                                         for f in found], indent=2))
    failed = [f.database for f in found if f.failures()]
    print(f"worker logs: {logs}; invariants failed on: {', '.join(failed) or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    command(main, "the workers are gone, the servers running")
