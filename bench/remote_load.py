"""Remote control and events under load: do the tables stay bounded, what does it write?

    python bench/remote_load.py [--databases postgresql,mysql,sqlite] [--minutes 5]
                                [--workers 4] [--monitors 2] [--rate 5] [--sample 5]
                                [--churn 60] [--json PATH]

For each database in turn, for ``--minutes``: ``--workers`` real ``celery worker``
processes (prefork -c 1, task events on with ``-E``, heartbeats every 2 s) on the
sqlinbox transport run tasks published at ``--rate`` per second, and ``--monitors``
event monitors (an ``EventReceiver`` each, in processes of their own) watch them. Each
sample this process pings every worker by name. Every ``--churn`` seconds one monitor
is killed with ``kill -9`` and replaced, and a ``celery inspect ping`` command runs (a
process with a reply queue of its own): queues whose owner is gone must expire.

Every ``--sample`` seconds it counts the rows of every table of the run, and the
writes of the database:

* PostgreSQL: the run gets a database of its own; rows written per table from
  ``pg_stat_user_tables`` (inserted + updated + deleted), commits from
  ``pg_stat_database.xact_commit``;
* MariaDB: rows written per table from ``information_schema.TABLE_STATISTICS``
  (``ROWS_CHANGED``; the server's ``userstat`` is switched on for the run, and back off
  after, if it was off); commits from the server-wide ``Com_commit``, beside its rate
  in the seconds before the run (other work on the server counts in both);
* SQLite: rows written per table counted by triggers the run adds to each table (one
  counter-row UPDATE inside the writer's transaction, so a little extra work); no
  commit count.

Prints a table per database (max / last rows and rows written per second, per table)
and a summary. Exit status 1 when a table other than the task queue grows without
bound (its most rows in the last third of the samples above twice the larger of its most
in the first third and :data:`FLOOR` rows), when the number of the run's tables does, when a
monitor saw a worker's heartbeats more than 4 s apart (it would count the worker
offline), or when a worker exits. Everything it starts is stopped at the end, also on
Ctrl-C or SIGTERM. Not a test and not in CI.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack, suppress
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from types import FrameType
from typing import Any

if __name__ == "__main__":  # run as a script: import the bench package, not its modules
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from celery.utils.nodenames import host_format
from sqlalchemy import create_engine, inspect, text
from sqlalchemy.engine import Connection, Engine, make_url

from bench.celery_app import TASK, counter, make_app
from bench.children import SPAWN, Children, Link
from bench.cli import choices, command
from bench.registry import gist, progress, spread
from bench.remote import OFFLINE, PING_TIMEOUT, POOL, cli_ping, monitoring, wait_for
from bench.report import grid
from bench.targets import DATABASES, Context, Target, celery_env
from bench.workers import MONITORED_FLAGS, STARTUP, stop_all, worker
from kombu_sqlinbox.brokers import close_all
from kombu_sqlinbox.tables import table_name_for_queue

#: a table counts as growing when the most rows it had in the last third of the samples
#: exceed twice the larger of this and the most it had in the first third (the peaks, not
#: the last sample: a killed monitor's queue fills with events until it expires, so the
#: rows rise and fall with every kill; runs of at least three ``--churn`` periods)
FLOOR = 10
#: seconds of server-wide commits measured on MariaDB before the run starts
BASELINE = 10.0
TICK = 0.2
IDENTIFIER = re.compile(r"^[A-Za-z0-9_]+$")


# -- what the database says ----------------------------------------------------------------
class Meter:
    """Row counts and writes of the run's tables (names starting with ``prefix``)."""

    def __init__(self, url: str, prefix: str, **engine: Any) -> None:
        self.prefix = prefix
        self.engine: Engine = create_engine(url, pool_pre_ping=True, **engine)

    def tables(self, conn: Connection) -> list[str]:
        return sorted(name for name in inspect(conn).get_table_names()
                      if name.startswith(self.prefix) and not self.own(name))

    def own(self, name: str) -> bool:
        """A table of the meter's, not of the transport's."""
        return False

    def rows(self, conn: Connection, tables: list[str]) -> dict[str, int]:
        quote = conn.dialect.identifier_preparer.quote
        found = {}
        for name in tables:
            with suppress(Exception):  # dropped since it was listed: no rows
                found[name] = int(conn.execute(
                    text(f"SELECT COUNT(*) FROM {quote(name)}")).scalar_one())
        return found

    def written(self, conn: Connection, tables: list[str]) -> dict[str, int]:
        """Rows written (inserted, updated, deleted) so far, per table."""
        raise NotImplementedError

    def commits(self, conn: Connection) -> int | None:
        """Commits so far (None: this database does not say)."""
        return None

    def sample(self) -> Sample:
        with self.engine.connect() as conn:
            tables = self.tables(conn)
            found = Sample(time.monotonic(), self.rows(conn, tables),
                           self.written(conn, tables), self.commits(conn))
            conn.commit()
        return found

    def close(self) -> None:
        self.engine.dispose()


class PostgresMeter(Meter):
    """The run's own database: its statistics are the run's alone."""

    def written(self, conn: Connection, tables: list[str]) -> dict[str, int]:
        found = conn.execute(text(
            "SELECT relname, n_tup_ins + n_tup_upd + n_tup_del FROM pg_stat_user_tables"))
        return {name: int(count) for name, count in found if name in tables}

    def commits(self, conn: Connection) -> int | None:
        return int(conn.execute(text(
            "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
        )).scalar_one())


class MariaDBMeter(Meter):
    """Rows from the per-table statistics (``userstat``), commits server-wide."""

    def __init__(self, url: str, prefix: str) -> None:
        super().__init__(url, prefix)
        with self.engine.connect() as conn:
            self.userstat = int(conn.execute(text("SELECT @@GLOBAL.userstat")).scalar_one())
            if not self.userstat:
                conn.execute(text("SET GLOBAL userstat = 1"))

    def written(self, conn: Connection, tables: list[str]) -> dict[str, int]:
        found = conn.execute(text(
            "SELECT TABLE_NAME, ROWS_CHANGED FROM information_schema.TABLE_STATISTICS "
            "WHERE TABLE_SCHEMA = DATABASE()"))
        return {name: int(count) for name, count in found if name in tables}

    def commits(self, conn: Connection) -> int | None:
        return int(conn.execute(text(
            "SELECT VARIABLE_VALUE FROM information_schema.GLOBAL_STATUS "
            "WHERE VARIABLE_NAME = 'COM_COMMIT'")).scalar_one())

    def close(self) -> None:
        if not self.userstat:
            with self.engine.connect() as conn:
                conn.execute(text("SET GLOBAL userstat = 0"))
        super().close()


class SQLiteMeter(Meter):
    """Triggers on every table of the run count its rows written into one counter table."""

    def __init__(self, url: str, prefix: str) -> None:
        super().__init__(url, prefix, connect_args={"timeout": 30})
        self.counts = f"{prefix}meter_writes"
        self.counted: set[str] = set()
        with self.engine.begin() as conn:
            conn.execute(text(f'CREATE TABLE IF NOT EXISTS "{self.counts}" '
                              "(tbl TEXT PRIMARY KEY, n INTEGER NOT NULL)"))

    def own(self, name: str) -> bool:
        return name == self.counts

    def count_writes(self, conn: Connection, name: str) -> None:
        """Triggers on ``name`` (a validated identifier: it is spelled into their SQL)."""
        if not IDENTIFIER.match(name):
            raise ValueError(f"unexpected table name {name!r}")
        conn.execute(text(f'INSERT OR IGNORE INTO "{self.counts}" (tbl, n) VALUES (:t, 0)'),
                     {"t": name})
        for event in ("INSERT", "UPDATE", "DELETE"):
            conn.execute(text(
                f'CREATE TRIGGER IF NOT EXISTS "{name}_meter_{event.lower()}" AFTER {event} '
                f'ON "{name}" BEGIN UPDATE "{self.counts}" SET n = n + 1 '
                f"WHERE tbl = '{name}'; END"))

    def written(self, conn: Connection, tables: list[str]) -> dict[str, int]:
        new = [name for name in tables if name not in self.counted]
        if new:
            with self.engine.begin() as ddl:
                for name in new:
                    self.count_writes(ddl, name)
            self.counted.update(new)
        found = conn.execute(text(f'SELECT tbl, n FROM "{self.counts}"'))
        return {name: int(count) for name, count in found if name in tables}


METERS: dict[str, Callable[[str, str], Meter]] = {
    "postgresql": PostgresMeter, "mysql": MariaDBMeter, "sqlite": SQLiteMeter}


@dataclass
class Sample:
    at: float
    rows: dict[str, int]
    written: dict[str, int]
    commits: int | None


# -- the monitors --------------------------------------------------------------------------
def _monitor(link: Link, target: Target, names: list[str], stop: Any, every: float) -> None:
    """A spawned event monitor: reports what it saw every ``every`` s until ``stop.value``
    (a flag without a lock: a multiprocessing Event's ``set`` waits for every waiter to
    wake, and one killed with ``kill -9`` never does)."""
    app = make_app(target.url, target.transport_options, "unused", target.polling_interval)

    def summary() -> dict[str, Any]:
        gaps = monitor.heartbeat_gaps()
        return {"pid": os.getpid(), "events": len(monitor.seen),
                "heartbeats": monitor.count("worker-heartbeat"),
                "max_gap": max(gaps, default=None)}

    with monitoring(app, lambda host: host in names) as monitor:
        link.report("ready")
        reported = time.monotonic()
        while not stop.value:
            time.sleep(TICK)
            if time.monotonic() - reported >= every:
                link.report("seen", summary())
                reported = time.monotonic()
        link.report("seen", summary())
    app.close()


# -- one database --------------------------------------------------------------------------
@dataclass
class Figures:
    database: str
    prefix: str = ""
    minutes: float = 0.0
    samples: list[Sample] = field(default_factory=list)
    task_table: str = ""
    tasks_sent: int = 0
    tasks_done: int = 0
    pings: int = 0
    pings_short: int = 0
    ping_ms: list[float] = field(default_factory=list)
    cli_pings: int = 0
    cli_pings_both: int = 0
    monitor_kills: int = 0
    #: the last report of every monitor process (by pid)
    monitors: dict[int, dict[str, Any]] = field(default_factory=dict)
    commits_before: float | None = None
    broken: str = ""
    notes: list[str] = field(default_factory=list)

    def growing(self) -> list[str]:
        """Tables (and the count of tables) whose rows grew without bound."""
        if len(self.samples) < 6:
            return []
        third = len(self.samples) // 3
        found = []
        names = {name for s in self.samples for name in s.rows} - {self.task_table}
        series = {name: [s.rows.get(name, 0) for s in self.samples] for name in names}
        series["(tables of the run)"] = [len(s.rows) for s in self.samples]
        for name, counts in sorted(series.items()):
            limit = 2 * max(FLOOR, *counts[:third])
            if max(counts[-third:]) > limit:
                found.append(f"{name}: up to {max(counts[-third:])} rows in the last third "
                             f"of the run, limit {limit:g}")
        return found

    def max_gap(self) -> float | None:
        """The longest gap between two heartbeats of one worker at one monitor."""
        return max((m["max_gap"] for m in self.monitors.values() if m["max_gap"] is not None),
                   default=None)

    def failures(self) -> list[str]:
        found = [f"grows without bound: {g}" for g in self.growing()]
        gap = self.max_gap()
        if gap is not None and gap > OFFLINE:
            found.append(f"a heartbeat gap of {gap:.1f} s: a monitor marked a worker offline")
        return [f"the load did not run to its end: {self.broken}", *found] if self.broken \
            else found


class Load:
    """The load on one database."""

    def __init__(self, ctx: Context, database: str, args: argparse.Namespace,
                 url: str) -> None:
        self.ctx, self.database, self.args = ctx, database, args
        self.target = replace(ctx.sqlinbox(database, "load"), url=f"sqlinbox+{url}")
        self.queue = ctx.queue_name("load")
        self.app = make_app(self.target.url, self.target.transport_options, self.queue,
                            self.target.polling_interval)
        self.names = [host_format(f"{self.queue}w{i}@%h") for i in range(args.workers)]
        self.key = f"bench:{ctx.run_id}:{self.queue}"
        self.meter = METERS[database](url, ctx.prefix)
        self.figures = Figures(database, ctx.prefix,
                               task_table=table_name_for_queue(self.queue, ctx.prefix))

    def commits_rate(self, seconds: float) -> float | None:
        """Commits per second over the next ``seconds`` (before anything of the run starts)."""
        first = self.meter.sample()
        time.sleep(seconds)
        last = self.meter.sample()
        if first.commits is None or last.commits is None:
            return None
        return (last.commits - first.commits) / (last.at - first.at)

    def run(self) -> Figures:
        f = self.figures
        if self.database == "mysql":
            f.commits_before = self.commits_rate(BASELINE)
        env = celery_env(self.target, self.queue)
        with ExitStack() as stack:
            workers = [stack.enter_context(worker(
                "bench.celery_app", POOL, self.queue, env,
                self.ctx.scratch / f"{self.database}-{name}.log", name=name.split("@")[0],
                flags=MONITORED_FLAGS)) for name in self.names]
            stack.callback(stop_all, workers)
            wait_for(lambda: len(self.ping()) == len(self.names), STARTUP * 2,
                     f"ping replies from all {len(self.names)} workers", workers)
            stop = SPAWN.RawValue("b", 0)
            monitors = stack.enter_context(Children(
                self.args.monitors, _monitor, self.target, self.names, stop, self.args.sample))
            stack.callback(setattr, stop, "value", 1)  # before the monitors are joined
            monitors.wait_ready(time.monotonic() + STARTUP * 2)
            self.loop(workers, monitors, env)
            stop.value = 1
            self.reports(monitors, time.monotonic() + 10)
        return f

    def loop(self, workers: list[Any], monitors: Children, env: dict[str, str]) -> None:
        f = self.figures
        began = time.monotonic()
        ends = began + self.args.minutes * 60
        next_sample, next_churn = began, began + self.args.churn
        while (now := time.monotonic()) < ends:
            exited = [i for i, process in enumerate(workers) if process.poll() is not None]
            if exited:
                raise RuntimeError(f"worker {self.names[exited[0]]} exited")
            self.publish(now - began)
            if now >= next_sample:
                self.sample(monitors)
                next_sample = now + self.args.sample
            if self.args.churn and now >= next_churn:
                self.churn(monitors, env)
                next_churn = now + self.args.churn
            time.sleep(TICK)
        f.minutes = (time.monotonic() - began) / 60
        self.sample(monitors)

    def publish(self, elapsed: float) -> None:
        due = int(self.args.rate * elapsed) - self.figures.tasks_sent
        if due > 0:
            with self.app.producer_or_acquire() as producer:
                for _ in range(due):
                    self.app.send_task(TASK, args=(self.key, 0), queue=self.queue,
                                       producer=producer)
            self.figures.tasks_sent += due

    def ping(self) -> list[Any]:
        replies: list[Any] = self.app.control.ping(destination=self.names,
                                                   timeout=PING_TIMEOUT)
        return replies

    def sample(self, monitors: Children) -> None:
        f = self.figures
        began = time.perf_counter()
        answered = len(self.ping())
        f.ping_ms.append((time.perf_counter() - began) * 1000)
        f.pings += 1
        f.pings_short += answered < len(self.names)
        f.samples.append(self.meter.sample())
        f.tasks_done = int(counter().get(self.key) or 0)
        self.reports(monitors, time.monotonic())
        last = f.samples[-1]
        elapsed = last.at - f.samples[0].at
        routing = sum(n for name, n in last.rows.items() if name != f.task_table)
        progress(f"{self.database} {elapsed:4.0f}s: rows {routing} in "
                 f"{len(last.rows) - (f.task_table in last.rows)} tables, task queue "
                 f"{last.rows.get(f.task_table, 0)}, tasks {f.tasks_done}/{f.tasks_sent}, "
                 f"ping {answered}/{len(self.names)}, monitor events "
                 f"{sum(m['events'] for m in f.monitors.values())}")

    def reports(self, monitors: Children, deadline: float) -> None:
        """Take in the monitors' reports (waiting until ``deadline`` for more)."""
        while True:
            try:
                kind, _, value = monitors.next(deadline)
            except TimeoutError:
                return
            except RuntimeError as exc:  # a monitor failed: noted, the load goes on
                self.figures.notes.append(str(exc))
                continue
            if kind == "seen":
                self.figures.monitors[value["pid"]] = value

    def churn(self, monitors: Children, env: dict[str, str]) -> None:
        """``kill -9`` of one monitor and a new one; a ``celery inspect ping`` command."""
        f = self.figures
        monitors.replace(f.monitor_kills % len(monitors.processes))
        f.monitor_kills += 1
        f.cli_pings += 1
        try:
            f.cli_pings_both += cli_ping(env, self.names, 1).details["both"]
        except Exception as exc:  # noted; the load goes on
            f.notes.append(f"celery inspect ping: {gist(str(exc))}")

    def close(self) -> None:
        """This process's connections closed (before the run's database is dropped)."""
        self.app.close()
        close_all()
        counter().delete(self.key)
        self.meter.close()


# -- the report ----------------------------------------------------------------------------
def per_second(first: int | None, last: int | None, seconds: float) -> float | None:
    if first is None or last is None or seconds <= 0:
        return None
    return (last - first) / seconds


def tables_table(f: Figures) -> str:
    if not f.samples:
        return "no samples"
    first, last = f.samples[0], f.samples[-1]
    lines = []
    for name in sorted({n for s in f.samples for n in s.rows}):
        rate = per_second(first.written.get(name, 0), last.written.get(name), last.at - first.at)
        task = " (task queue)" if name == f.task_table else ""
        lines.append([name.removeprefix(f.prefix) + task,
                      max(s.rows.get(name, 0) for s in f.samples), last.rows.get(name, 0),
                      fmt(rate, ".1f")])
    return grid(["table", "max rows", "last rows", "rows written/s"], lines)


def fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def summary_table(found: list[Figures]) -> str:
    lines = []
    for f in found:
        first, last = (f.samples[0], f.samples[-1]) if f.samples else (None, None)
        seconds = last.at - first.at if first and last else 0.0
        written = per_second(sum(first.written.values()), sum(last.written.values()),
                             seconds) if first and last else None
        commits = per_second(first.commits, last.commits, seconds) if first and last else None
        commits_text = fmt(commits, ".1f")
        if f.commits_before is not None:
            commits_text += f" (server-wide; {f.commits_before:.1f} before the run)"
        lines.append([
            f.database, f"{f.minutes:.1f}", f"{f.tasks_done} / {f.tasks_sent}",
            sum(m["events"] for m in f.monitors.values()), fmt(f.max_gap(), ".2f"),
            f"{f.pings - f.pings_short} / {f.pings}",
            spread(f.ping_ms).text if f.ping_ms else "n/a",
            f"{f.cli_pings_both} / {f.cli_pings}", fmt(written, ".1f"), commits_text,
            "FAILED" if f.failures() else "ok"])
    return grid(["database", "minutes", "tasks done / sent", "monitor events",
                 "max heartbeat gap s", "pings all answered", "ping p50 / p99 ms",
                 "CLI pings both", "rows written/s", "commits/s", "result"], lines)


# -- the command ---------------------------------------------------------------------------
def parser() -> argparse.ArgumentParser:
    made = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    made.add_argument("--databases", default=list(DATABASES), type=choices(DATABASES),
                      help=f"one after another (default all: {','.join(DATABASES)})")
    made.add_argument("--minutes", type=float, default=5.0, help="per database (default 5)")
    made.add_argument("--workers", type=int, default=4, help="celery workers (default 4)")
    made.add_argument("--monitors", type=int, default=2, help="event monitors (default 2)")
    made.add_argument("--rate", type=float, default=5.0, help="tasks per second (default 5)")
    made.add_argument("--sample", type=float, default=5.0,
                      help="seconds between samples (default 5)")
    made.add_argument("--churn", type=float, default=60.0,
                      help="seconds between monitor kills and inspect commands (0: none)")
    made.add_argument("--json", type=Path, help="also write the figures as JSON here")
    return made


@dataclass
class Database:
    """Where one database's load runs: the URL, and what to remove afterwards."""

    url: str
    drop: Callable[[], None] = lambda: None


def database_for(ctx: Context, database: str) -> Database:
    """PostgreSQL: a database of the run's own (so its statistics are the run's); the
    others: the usual one (tables prefixed for the run)."""
    url = ctx.url(database, "load")
    if database != "postgresql":
        return Database(url)
    name = f"sqlinbox_load_{ctx.run_id}"
    admin = create_engine(url, isolation_level="AUTOCOMMIT", pool_pre_ping=True)
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))

    def drop() -> None:
        try:
            with admin.connect() as conn:
                conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        except Exception as exc:  # cleanup must not hide the figures
            print(f"cleanup: database {name} left behind: {gist(str(exc))}", file=sys.stderr)
        finally:
            admin.dispose()

    own = make_url(url).set(database=name).render_as_string(hide_password=False)
    return Database(own, drop)


def interrupted(signum: int, frame: FrameType | None) -> None:
    """Ctrl-C or SIGTERM: end the run, once; the clean-up that follows (each step bounded)
    is not interrupted again, so nothing started is left behind."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, interrupted)
    found: list[Figures] = []
    with Context() as ctx:
        progress(f"remote load {ctx.run_id}: logs in {ctx.scratch}")
        for database in args.databases:
            where = database_for(ctx, database)
            load = None
            try:
                load = Load(ctx, database, args, where.url)
                found.append(load.run())
            except Exception as exc:  # the next database still runs
                figures = load.figures if load else Figures(database)
                figures.broken = gist(f"{type(exc).__name__}: {exc}")
                found.append(figures)
            finally:
                if load:
                    load.close()
                where.drop()
    print(f"\n## Remote control and events under load ({args.workers} workers, "
          f"{args.monitors} monitors, {args.rate:g} tasks/s)\n\n{summary_table(found)}\n")
    for f in found:
        print(f"### {f.database}\n\n{tables_table(f)}\n")
        for line in [*f.failures(), *f.notes[:20]]:
            print(f"* {line}")
        print()
    if args.json:
        args.json.write_text(json.dumps([{**asdict(f), "failures": f.failures()}
                                         for f in found], indent=2, default=str))
    return 1 if any(f.failures() for f in found) else 0


if __name__ == "__main__":
    command(main, "every process the load started is gone")
