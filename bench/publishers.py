"""Many publishers: 1, 4, 16 and 64 at once, as threads of one process and as processes.

    python bench/publishers.py [--quick] [--publishers 1,4,16,64] [--publishers-seconds S]
                               [--publishers-rounds R] [--databases ...] [--json PATH]

Also a section of ``bench/run.py``. Per database, per kind (threads: one spawned process
running that many threads; processes: that many spawned processes) and per count, the
publishers each hold a kombu Connection of their own and call ``Producer.publish`` in a
loop, one message per commit, all on one queue. In one set of children the sqlinbox
transport and RabbitMQ with persistent messages and publisher confirms
(``confirm_publish``, as ``bench/publish.py`` sets it up) take turns for
``--publishers-seconds`` each, ``--publishers-rounds`` times; each figure is the median of
its rounds. Per count:

* msg/s: messages all publishers published in a turn, over its seconds;
* publish p50 / p99 ms: every publish call's time;
* waits: PostgreSQL, sampled sessions of the publishers waiting on a lock (a NOTIFY's
  commit waits on a global one), of those running a statement; MariaDB the growth of
  ``Innodb_deadlocks``, ``Innodb_row_lock_waits`` and ``Innodb_row_lock_time`` over the
  count's run, server-wide; SQLite, one writer at a time: the write lock held per publish
  (the turn's seconds over its messages) and what a publish waited beyond that (p50).

Targets beside the table: PostgreSQL 16 publishers ÷ 1 (at least 4 times), MariaDB deadlocks (none).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # run as a script: import the bench package, not its modules
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from kombu import Producer
from sqlalchemy import create_engine
from sqlalchemy.engine import Engine

from bench.children import SPAWN, Children, Link
from bench.cli import run_alone
from bench.consumers import LockWaits
from bench.kombu_bench import body, declared_producer
from bench.publish import CONFIRMS
from bench.registry import Cell, Row, Section, goal, progress, spread
from bench.report import table
from bench.targets import Context, Target, connect, kombu_queue, scratch_queue

NAME = "publishers"
COUNTS = (1, 4, 16, 64)
KINDS = ("threads", "processes")
SINGULAR = {"threads": "thread", "processes": "process"}
SECONDS = 4.0
ROUNDS = 3
#: seconds between turns, and before the first: every publisher starts each turn on time
GAP = 0.5
#: seconds the children may take to start (64 processes importing on a loaded machine)
START_LIMIT = 300.0
SQLINBOX = "sqlinbox"
FIGURES = {"msg/s": "msg/s", "latency": "publish p50 / p99 ms", "waits": "waits"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("publishers")
    group.add_argument("--publishers", type=lambda v: [int(n) for n in v.split(",")],
                       help=f"publisher counts (default {','.join(map(str, COUNTS))})")
    group.add_argument("--publishers-seconds", type=float, default=0,
                       help=f"seconds of each turn (default {SECONDS:g}, quick 2)")
    group.add_argument("--publishers-rounds", type=int, default=0,
                       help=f"turns of each broker per count (default {ROUNDS}, quick 1)")


# -- the child process ----------------------------------------------------------------------
def publish_turns(producer: Producer, turns: list[tuple[float, float] | None],
                  published: list[list[int]], took: list[list[float]]) -> None:
    """Publish in each of ``turns`` ((start, end) wall-clock seconds; None: another
    broker's turn): the count of each turn to ``published``, each call's ms to ``took``
    (lists appended to by several threads: the GIL keeps each append whole)."""
    payload = body(0)
    for at, turn in enumerate(turns):
        if turn is None:
            continue
        time.sleep(max(0.0, turn[0] - time.time()))
        count, times = 0, took[at]
        while (began := time.time()) < turn[1]:
            producer.publish(payload, retry=False)
            times.append((time.time() - began) * 1000)
            count += 1
        published[at].append(count)


def publishers(link: Link, targets: dict[str, Target], queue: str, threads: int,
               rounds: int, seconds: float, begins: Any) -> None:
    """``threads`` publishers in this process, each publishing to ``queue`` on every
    target in turn (a connection to each, opened before the first turn), ``rounds``
    times, from the parent's ``begins`` (wall clock) on; reports each turn's count and
    call times."""
    modes = list(targets)
    schedule = [(at * (seconds + GAP), at * (seconds + GAP) + seconds)
                for at in range(rounds * len(modes))]
    published: list[list[int]] = [[] for _ in schedule]
    took: list[list[float]] = [[] for _ in schedule]
    failures: list[BaseException] = []
    ready = threading.Barrier(threads * len(modes) + 1)

    def one(mode: str) -> None:
        try:
            with connect(targets[mode]) as conn:
                producer = declared_producer(conn.channel(), kombu_queue(queue))
                ready.wait(START_LIMIT)
                link.start.wait(START_LIMIT)
                began = begins.value
                turns = [(began + a, began + b) if modes[at % len(modes)] == mode else None
                         for at, (a, b) in enumerate(schedule)]
                publish_turns(producer, turns, published, took)
        except BaseException as exc:  # reported by the process, which the parent hears
            failures.append(exc)
            ready.abort()

    runners = [threading.Thread(target=one, args=(mode,))
               for _ in range(threads) for mode in modes]
    for runner in runners:
        runner.start()
    try:
        ready.wait(START_LIMIT)
        link.ready(START_LIMIT)
    finally:
        for runner in runners:
            runner.join()
    if failures:
        raise failures[0]
    link.report("turns", ([sum(n) for n in published], took))


# -- one count of one kind, on one database ----------------------------------------------------
def waits_cell(database: str, locks: LockWaits | None, rate: float | None,
               latency: Cell) -> Cell:
    """The waits column: the lock account of the server, or SQLite's write lock."""
    if locks is not None:
        return locks.cell()
    if database != "sqlite" or not rate or latency.value is None:
        return Cell(None, "-")
    held = 1000 / rate  # one writer at a time: the turn's time is the locks held end to end
    waited = max(0.0, latency.value - held)
    return Cell(held, f"held {held:.2f} ms/publish, waited p50 {waited:.1f} ms",
                {"held_ms": held, "waited_p50_ms": waited})


def one_count(targets: dict[str, Target], engine: Engine | None, database: str,
              application: str, queue: str, kind: str, count: int, rounds: int,
              seconds: float) -> dict[str, dict[str, Cell]]:
    """``count`` publishers of ``kind`` taking turns on each target: mode -> figure -> cell
    (``application``: the publishers' PostgreSQL ``application_name``)."""
    processes, threads = (1, count) if kind == "threads" else (count, 1)
    begins = SPAWN.Value("d", 0.0)
    modes = list(targets)
    turns = rounds * len(modes)
    counts = [0] * turns
    took: list[list[float]] = [[] for _ in range(turns)]
    locks = None if engine is None else LockWaits(engine, database, application)
    with Children(processes, publishers, targets, queue, threads, rounds, seconds,
                  begins) as children:
        children.wait_ready(time.monotonic() + START_LIMIT)
        begins.value = time.time() + 2 * GAP
        if locks is not None:
            locks.__enter__()
        try:
            children.start.set()
            deadline = time.monotonic() + 2 * GAP + turns * (seconds + GAP) + 120
            for _ in range(processes):
                _, _, (published, times) = children.next(deadline)
                for at in range(turns):
                    counts[at] += published[at]
                    took[at] += times[at]
        finally:
            if locks is not None:
                locks.__exit__()
    found: dict[str, dict[str, Cell]] = {}
    for index, mode in enumerate(modes):
        mine = range(index, turns, len(modes))
        rates = [counts[at] / seconds for at in mine]
        rate = statistics.median(rates)
        latency = spread([ms for at in mine for ms in took[at]])
        cells = {"msg/s": Cell(rate, f"{rate:,.0f}", {"rounds": rates}), "latency": latency}
        if mode == SQLINBOX:
            cells["waits"] = waits_cell(database, locks, rate, latency)
        found[mode] = cells
    return found


def database_rows(ctx: Context, database: str, counts: list[int], rounds: int,
                  seconds: float) -> list[Row]:
    queue = ctx.queue_name("publishers")
    target = ctx.sqlinbox(database, NAME)
    application = f"{ctx.prefix}{queue}"
    if database == "postgresql":  # the publishers' sessions, told apart by their name
        target = replace(target, url=f"{target.url}?application_name={application}")
    targets = {SQLINBOX: target, CONFIRMS.broker: CONFIRMS}
    rows: list[Row] = []
    with scratch_queue(target, queue), scratch_queue(CONFIRMS, queue), \
            connect(target) as conn:
        kombu_queue(queue)(conn.default_channel).declare()
        url = conn.default_channel.broker.engine.url
        engine = None if database == "sqlite" else create_engine(
            url, pool_size=2, isolation_level="AUTOCOMMIT")
        try:
            for kind in KINDS:
                for count in counts:
                    setup = f"{count} {kind if count > 1 else SINGULAR[kind]}"
                    try:
                        cells = one_count(targets, engine, database, application, queue, kind,
                                          count, rounds, seconds)
                    except Exception as exc:  # one count failing spoils only its own row
                        cells = {SQLINBOX: {"msg/s": Cell.failed(exc)}}
                    for mode, figures in cells.items():
                        for figure, cell in figures.items():
                            row = cell.row(NAME, database, f"{mode}: {setup}", figure)
                            rows.append({**row, "mode": mode, "kind": kind, "count": count})
                        progress(f"{NAME} {database} {mode} {setup}: "
                                 + ", ".join(f"{k}={c.text}" for k, c in figures.items()))
        finally:
            if engine is not None:
                engine.dispose()
    return rows


def sizes(args: argparse.Namespace) -> tuple[list[int], int, float]:
    return (args.publishers or list(COUNTS),
            args.publishers_rounds or (1 if args.quick else ROUNDS),
            args.publishers_seconds or (2.0 if args.quick else SECONDS))


def run(args: argparse.Namespace) -> list[Row]:
    counts, rounds, seconds = sizes(args)
    rows: list[Row] = []
    with Context(pg_driver=args.pg_driver) as ctx:
        for database in args.databases:
            try:
                rows += database_rows(ctx, database, counts, rounds, seconds)
            except Exception as exc:  # a database that is down spoils only its own rows
                rows.append(Cell.failed(exc).row(NAME, database, "failed", "msg/s"))
    return rows


def markdown(rows: list[Row], args: argparse.Namespace) -> str:
    _, rounds, seconds = sizes(args)
    shown = sorted(rows, key=lambda r: (r["database"] or "", r.get("mode") != SQLINBOX,
                                        KINDS.index(r.get("kind", KINDS[0]))))
    return "\n".join([
        table(shown, FIGURES, "publishers"),
        "",
        f"Each count: that many publishers (threads of one spawned process, or spawned "
        f"processes), each with a kombu Connection of its own, Producer.publish in a loop on "
        f"one queue; the sqlinbox transport and {CONFIRMS.broker} (persistent messages, "
        f"publisher confirms) take turns of {seconds:g} s, {rounds} each; msg/s the median "
        "of a broker's turns. Waits: PostgreSQL, sampled sessions of the publishers waiting "
        "on a lock, of those running a statement; MariaDB, the growth of Innodb_deadlocks, "
        "Innodb_row_lock_waits / Innodb_row_lock_time over the count's run, server-wide; "
        "SQLite, one writer: the write lock held per publish (turn time ÷ messages) and the "
        "median wait of a publish beyond it.",
    ])


def rate_of(rows: list[Row], database: str, kind: str, count: int) -> float | None:
    return next((r["value"] for r in rows if r["database"] == database
                 and r.get("mode") == SQLINBOX and r.get("kind") == kind
                 and r.get("count") == count and r["figure"] == "msg/s"), None)


def targets(rows: list[Row]) -> list[Row]:
    """Per database and kind, 16 publishers ÷ 1 (PostgreSQL held to 4) and, on MariaDB,
    the deadlocks of the most publishers' run (held to none)."""
    found = []
    for database in sorted({r["database"] for r in rows if r["database"]}):
        for kind in KINDS:
            one, sixteen = rate_of(rows, database, kind, 1), rate_of(rows, database, kind, 16)
            if one and sixteen:
                found.append(goal(NAME, database, f"16 publishers ÷ 1 ({kind})", sixteen / one,
                                  4.0 if database == "postgresql" else None))
        deadlocks = [r["details"].get("Innodb_deadlocks", 0) for r in rows
                     if r["database"] == database and r["figure"] == "waits"
                     and database == "mysql" and r.get("details")]
        if deadlocks:
            found.append(goal(NAME, database, "InnoDB deadlocks, all counts", sum(deadlocks),
                              0, at_most=True))
    return found


SECTION = Section(NAME, "Many publishers: 1 to 64 threads and processes, beside RabbitMQ "
                  "with confirms", add_arguments, run, markdown, targets)

if __name__ == "__main__":
    run_alone(SECTION)
