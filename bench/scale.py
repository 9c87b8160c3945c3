"""Scale benchmark: claim time, drain rates and worker memory against the backlog's size.

    python bench/scale.py [--quick] [--million] [--scale claims,drains,rss]
                          [--databases postgresql,mysql,sqlite] [--json PATH]

* Claim time: a queue table filled with 1,000 / 10,000 / 100,000 (and with
  ``--million`` 1,000,000) waiting rows by one bulk ``INSERT ... SELECT`` (copies of
  one published message), then claims in the transaction the transport claims in on
  the pool, each rolled back, p50 / p99 in ms: on a plain table (the first row is
  taken; and the first 8), the claims of 8 with the table's statistics taken while it
  was empty (what autovacuum leaves a queue that is empty more often than not with:
  PostgreSQL used to plan such claims as a read of the whole backlog), and on a FIFO
  table whose rows all belong to one group whose head is in work (every row waits
  behind it, the claim finds nothing: the case that used to read the whole backlog).
* Drain rates: one kombu consumer at prefetch 1 acking each message, on a plain
  table, one FIFO group, and 1,000 FIFO groups; the ratios to the plain table are
  the targets (one group at least 0.5, 1,000 groups at least 0.8). Beside them the
  statements alone: claim one row, delete it, repeat (``Dialect.claim`` and the
  delete, no transport).
* Worker memory: a real ``celery worker -P solo`` started on a backlog of each size
  (copies of one task message); its RSS a few seconds in and again later. Nothing
  beyond the prefetch is held, so it must not grow with the backlog.

Runs alone or as the ``scale`` section of ``bench/run.py``; a benchmark, not a test:
its figures depend on the machine and on what else runs there.
"""

from __future__ import annotations

import argparse
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # run as a script: import the bench package, not its modules
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from kombu import Connection
from sqlalchemy import text

from bench.celery_app import TASK, counter, make_app
from bench.cli import choices, run_alone
from bench.kombu_bench import drain, publish_many
from bench.ordering import inbox_table
from bench.registry import Cell, Row, Section, goal, progress, ratio, spread
from bench.report import table
from bench.targets import Context, Sizes, Target, celery_env, connect, scratch_queue
from bench.workers import worker
from kombu_sqlinbox.tables import Role

NAME = "scale"
#: ten digits, cross joined to number the copies of a bulk fill
DIGITS = " UNION ALL ".join(f"SELECT {d} AS d" for d in range(10))
SIZES = (1_000, 10_000, 100_000)
MILLION = 1_000_000
#: claims timed per size and table, unless they take longer than CLAIMS_FOR seconds
#: (then at least three: a claim that reads the backlog takes seconds at a million rows)
CLAIMS = 50
CLAIMS_FOR = 20.0
#: rows of each drain (``--quick``: a fifth)
DRAIN = 2_000
GROUPS = 1_000
#: seconds a worker runs on its backlog before its RSS is read the first and second time
RSS_AT = (5.0, 20.0)
MEASURES = ("claims", "drains", "rss")
FIGURES = {"claim": "claim p50 / p99 ms", "msg/s": "msg/s", "rss": "RSS MB (5 s → 20 s)"}
#: the drain targets: the FIFO rate at least this share of the plain table's
TARGETS = {"1 FIFO group": 0.5, f"{GROUPS} FIFO groups": 0.8}
TEXT = {"postgresql": "TEXT", "mysql": "CHAR", "sqlite": "TEXT"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("scale")
    group.add_argument("--scale", default=list(MEASURES), type=choices(MEASURES),
                       help=f"default all: {','.join(MEASURES)}")
    group.add_argument("--million", action="store_true",
                       help="also a backlog of 1,000,000 rows (minutes per database)")


def analyze(target: Target, conn: Connection, queue: str) -> None:
    """Have the database take the statistics of the queue's table."""
    broker = conn.default_channel.broker
    table = broker.dialect.table_ref(broker.table(queue).spec)
    with broker.engine.begin() as db:
        command = {"postgresql": "ANALYZE", "mysql": "ANALYZE TABLE"}.get(target.database or "")
        db.execute(text(f"{command or 'ANALYZE'} {table}"))


def fill(target: Target, conn: Connection, queue: str, count: int, groups: int,
         analyzed: bool = True) -> None:
    """Copy the queue's one row (published with group ``0``) until it has ``count``, in one
    ``INSERT ... SELECT``: copy n in group ``n % groups`` (``groups`` 0: no group column).
    Then the table's statistics are taken, unless not ``analyzed``."""
    broker = conn.default_channel.broker
    spec = broker.table(queue).spec
    dialect = broker.dialect
    columns = [c.name for c in spec.columns if c.role not in (Role.GROUP, Role.ID)]
    names = ", ".join(dialect.quote(c) for c in columns)
    places = len(str(count - 1))  # digit tables: every n below 10 ** places, once
    n = " + ".join(f"d{k}.d * {10 ** k}" for k in range(places))
    group_column = group_value = ""
    if groups:
        group_column = ", " + dialect.quote(spec.name_of(Role.GROUP))
        group_value = f", CAST(({n}) % {groups} AS {TEXT[target.database or '']})"
    digits = ", ".join(f"({DIGITS}) AS d{k}" for k in range(places))
    table = dialect.table_ref(spec)
    with broker.engine.begin() as db:
        db.execute(text(f"INSERT INTO {table} ({names}{group_column}) "
                        f"SELECT {', '.join('s.' + dialect.quote(c) for c in columns)}"
                        f"{group_value} FROM {table} AS s, {digits} "
                        f"WHERE {n} BETWEEN 1 AND {count - 1}"))
    if analyzed:
        analyze(target, conn, queue)


def claim_times(conn: Connection, queue: str, hold_head: bool, limit: int = 1) -> list[float]:
    """Milliseconds of :data:`CLAIMS` claims of ``limit`` rows, each rolled back, in a
    transaction set up as the transport's fenced ones on the pool are; with ``hold_head``
    the first row is claimed (and committed) first, so a FIFO group's head is in work."""
    broker = conn.default_channel.broker
    spec = broker.table(queue).spec
    if hold_head:
        with broker.engine.begin() as db:
            broker.dialect.claim(db, spec, 1, 3600.0)
    times: list[float] = []
    ends = time.monotonic() + CLAIMS_FOR
    with broker.engine.connect() as db:
        while len(times) < CLAIMS and (len(times) < 3 or time.monotonic() < ends):
            began = time.perf_counter()
            with db.begin() as transaction:
                if broker.dialect.relaxed_commit:
                    db.exec_driver_sql(broker.dialect.relaxed_commit)
                broker.dialect.claim(db, spec, limit, 30.0)
                transaction.rollback()
            times.append((time.perf_counter() - began) * 1000)
    return times


#: the claim times' tables: what each is called, its kind, whether its statistics were
#: taken while it was empty, the rows a claim takes (8: a Celery worker's at -c 2)
CLAIM_SETUPS = (("plain table", None, False, 1),
                ("plain table, claims of 8", None, False, 8),
                ("plain table, claims of 8, statistics taken while empty", None, True, 8),
                ("FIFO, 1 group, head in work", "fifo", False, 1))


def claim_rows(ctx: Context, database: str, sizes: list[int]) -> list[Row]:
    rows = []
    for size in sizes:
        for setup, kind, analyzed_empty, limit in CLAIM_SETUPS:
            name = ctx.queue_name(f"claim{kind or 'plain'}")
            target = table_target(ctx, database, name, kind)
            with scratch_queue(target, name) as queue, connect(target) as conn:
                if analyzed_empty:
                    queue(conn.default_channel).declare()
                    analyze(target, conn, name)
                publish_many(conn, queue, range(1), lambda i: {"group_key": "0"})
                fill(target, conn, name, size, 1 if kind else 0, not analyzed_empty)
                cell = spread(claim_times(conn, name, kind is not None, limit))
            rows.append(cell.row(NAME, database, f"{setup}: {size:,} rows", "claim"))
            progress(f"{NAME} {database} {setup} {size:,}: {cell.text}")
    return rows


def table_target(ctx: Context, database: str, name: str, kind: str | None) -> Target:
    options: dict[str, Any] = {}
    if kind is not None:
        options["queues"] = {name: {"table": inbox_table(f"{ctx.prefix}{name}", kind)}}
    return ctx.sqlinbox(database, NAME, **options)


DRAINS = (("plain table", None, 0), ("1 FIFO group", "fifo", 1),
          (f"{GROUPS} FIFO groups", "fifo", GROUPS))


def drain_rows(ctx: Context, database: str, count: int) -> list[Row]:
    """``count`` rows of a plain table, 1 group, :data:`GROUPS` groups: drained by one
    kombu consumer at prefetch 1, and by claim-then-delete in series on the dialect (the
    statements alone: a FIFO group's next row is claimable once the ack is written)."""
    rows = []
    for how in ("drain, prefetch 1", "claim, then ack, in series"):
        for setup, kind, groups in DRAINS:
            name = ctx.queue_name(f"drain{groups}")
            target = table_target(ctx, database, name, kind)
            with scratch_queue(target, name) as queue, connect(target) as conn:
                publish_many(conn, queue, range(1), lambda i: {"group_key": "0"})
                fill(target, conn, name, count, groups)
                if how.startswith("drain"):
                    got = drain(conn, queue, 1, lambda d: len(d.ids) >= count, ctx.deadline())
                    done, seconds = len(got.ids) - 1, got.last - got.first
                else:
                    done, seconds = in_series(conn, name, count, ctx.sizes.cap)
            cell = Cell.rate(done, seconds, expected=count)
            if done < count - 1:
                cell.text += f" ({done}/{count} in cap)"
            rows.append(cell.row(NAME, database, f"{how}: {setup}", "msg/s"))
            progress(f"{NAME} {database} {how} {setup}: {cell.text}")
    return rows


def in_series(conn: Connection, queue: str, count: int, cap: float) -> tuple[int, float]:
    """Claim one row, delete it, in two transactions, until ``count`` or ``cap`` seconds:
    (rows, seconds)."""
    broker = conn.default_channel.broker
    spec = broker.table(queue).spec
    delete = broker.dialect.statements(spec).delete
    done, began = 0, time.perf_counter()
    while done < count and time.perf_counter() - began < cap:
        with broker.engine.begin() as db:
            rows = broker.dialect.claim(db, spec, 1, 30.0)
        if not rows:
            break
        with broker.engine.begin() as db:
            broker.dialect.settle(db, delete, {rows[0].attempt: [rows[0].id]})
        done += 1
    return done, time.perf_counter() - began


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def rss_rows(ctx: Context, database: str, sizes: list[int]) -> list[Row]:
    """A ``celery worker -P solo`` on a backlog of each size: RSS at :data:`RSS_AT`."""
    rows = []
    for size in sizes:
        name = ctx.queue_name("rss")
        target = ctx.sqlinbox(database, NAME)
        key = f"{ctx.prefix}{name}"
        app = make_app(target.url, target.transport_options, name, target.polling_interval)
        with scratch_queue(target, name):
            app.send_task(TASK, args=(key, size), queue=name)
            with connect(target) as conn:
                fill(target, conn, name, size, 0)
            log = ctx.scratch / f"{name}.log"
            with worker("bench.celery_app", ["-P", "solo"], name, celery_env(target, name),
                        log) as process:
                began = time.monotonic()
                found = []
                for at in RSS_AT:
                    time.sleep(max(0.0, began + at - time.monotonic()))
                    if process.poll() is not None:
                        raise RuntimeError(f"the worker exited: {log.read_text()[-500:]}")
                    found.append(rss_mb(process.pid))
            done = int(counter().get(key) or 0)
            counter().delete(key)
        cell = Cell(found[-1] - found[0], f"{found[0]:.1f} → {found[-1]:.1f} ({done:,} run)",
                    {"rss": found, "done": done})
        rows.append(cell.row(NAME, database, f"celery worker -P solo: {size:,} rows", "rss"))
        progress(f"{NAME} {database} rss {size:,}: {cell.text}")
    return rows


def run(args: argparse.Namespace) -> list[Row]:
    """Every figure of this module for ``args`` (``quick``, ``million``, ``databases``)."""
    sizes = list(SIZES[:2] if args.quick else SIZES)
    if getattr(args, "million", False):
        sizes.append(MILLION)
    rows: list[Row] = []
    with Context(Sizes().quick() if args.quick else Sizes()) as ctx:
        for database in args.databases:
            drained = DRAIN // (5 if args.quick else 1)
            measures = {"claims": partial(claim_rows, ctx, database, sizes),
                        "drains": partial(drain_rows, ctx, database, drained),
                        "rss": partial(rss_rows, ctx, database, sizes)}
            for measure in (measures[name] for name in getattr(args, "scale", MEASURES)):
                try:
                    rows += measure()
                except Exception as exc:  # a database that is down spoils only its own rows
                    rows.append(Cell.failed(exc).row(NAME, database, "failed", "msg/s"))
    return rows


def markdown(rows: list[Row], args: argparse.Namespace) -> str:
    drained = DRAIN // (5 if args.quick else 1)
    return "\n".join([
        table(rows, FIGURES),
        "",
        f"Claims: {CLAIMS} claims per size and table, of one row unless the setup says "
        f"(fewer past {CLAIMS_FOR:.0f} s, at least 3), each rolled back. Drains: {drained:,} rows, "
        "one kombu consumer at prefetch 1 acking each; in series: the dialect's claim of one "
        "row, then its delete, one transaction each. RSS: a `celery worker -P solo` "
        f"{RSS_AT[0]:.0f} s and {RSS_AT[1]:.0f} s after its start on the backlog.",
    ])


def targets(rows: list[Row]) -> list[Row]:
    found = []
    for database in sorted({r["database"] for r in rows}):
        cells = {r["setup"]: Cell(r["value"], r["text"]) for r in rows
                 if r["database"] == database and r["figure"] == "msg/s"}
        for how in ("drain, prefetch 1", "claim, then ack, in series"):
            plain = cells.get(f"{how}: plain table")
            for setup, limit in TARGETS.items():
                value = ratio(cells.get(f"{how}: {setup}"), plain)
                if value is not None:
                    found.append(goal(NAME, database, f"{how}: {setup} ÷ plain table", value,
                                      limit))
        claims = [r["value"] for r in rows if r["database"] == database
                  and r["setup"].startswith("FIFO") and r["value"]]
        if len(claims) > 1:
            found.append(goal(NAME, database, "FIFO claim p50, largest ÷ smallest backlog",
                              claims[-1] / claims[0], None))
    return found


SECTION = Section(NAME, "Scale: claim time, drain rates and worker memory by backlog size",
                  add_arguments, run, markdown, targets)

if __name__ == "__main__":
    run_alone(SECTION)
