"""The MVCC trap: a queue under steady load while another session keeps a snapshot open.

    python bench/mvcc.py [--databases postgresql,mysql] [--mvcc-minutes N]
                         [--mvcc-rate MSG_S] [--mvcc-prefetch N] [--mvcc-sample S]
                         [--mvcc-snapshot both|held|none]

Also a section of ``bench/run.py`` (``--sections mvcc``; ``--quick``: 1 minute). For
each server database, at the same time: a publisher process sends ``--mvcc-rate``
messages a second (a batch every 50 ms, one transaction each) into a queue that a
consumer process (the transport's kombu consumer at ``--mvcc-prefetch``, acking each
message) drains, while a third session holds a transaction open the whole time
(PostgreSQL: REPEATABLE READ after a read, with an xid; MariaDB: ``START TRANSACTION
WITH CONSISTENT SNAPSHOT`` and a read), so neither vacuum nor InnoDB purge can remove
what the queue deletes. Every ``--mvcc-sample`` seconds a line: messages published and
acked in the window, the backlog (published, not yet acked), the claims' p50/p99 in the
window (each claim statement timed in the consumer by wrapping the dialect's claim), the
pages one claim reads (PostgreSQL's buffers, MariaDB's pages accessed: the claim run
once under ``EXPLAIN ANALYZE``, rolled back; a figure the machine's load does not
disturb), and the dead rows: PostgreSQL's ``n_dead_tup``/``n_live_tup`` and table+index
size, MariaDB's history list length and table size. PostgreSQL runs in a database of its
own (``<db>_mvcc``, created when missing) so the held snapshot stops vacuum there only.
MariaDB's purge is server-wide: the run holds it back for everyone on the server.
Where the PostgreSQL server runs with autovacuum off (the test machine's servers do),
the run vacuums the queue table as autovacuum would at the server's settings (each
``autovacuum_naptime``, once its dead rows pass ``autovacuum_vacuum_threshold +
autovacuum_vacuum_scale_factor`` times its rows, at its cost delay and limit), so the
figures are those of a server at its defaults; the vacuums it ran are in the samples.
With ``--mvcc-snapshot both`` (the default) each database runs the same load twice, first
with no snapshot held, then with one, and a last table puts the two side by side: the
held run's acked rate over the other's is the cost of the snapshot.
Not a test: the figures depend on the machine and on whatever else runs on it.
"""

from __future__ import annotations

import argparse
import contextlib
import queue as stdlib_queue
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # run as a script: import the bench package, not its modules
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from kombu import Connection, Consumer
from sqlalchemy import create_engine, text
from sqlalchemy.engine import Engine, make_url

import celery_ext
import kombu_sqlinbox  # noqa: F401  (registers the sqlinbox alias)
from bench.children import SPAWN, timed_claims
from bench.cli import run_alone
from bench.kombu_bench import body, declared_producer
from bench.registry import Cell, Row, Section, goal, progress
from bench.report import grid
from bench.targets import SERVERS, kombu_queue
from kombu_sqlinbox.broker import Broker
from kombu_sqlinbox.tables import TableSpec, table_name_for_queue
from tests.databases import pages_read, snapshot_held

NAME = "mvcc"
DATABASES = ("postgresql", "mysql")
PREFIX = "mvcc_"
QUEUE = "mvccbench"
#: seconds between the publisher's batches
TICK = 0.05
#: seconds a child process may take to start (imports, connections)
START_LIMIT = 120.0
#: what the run must keep to: the last backlog within this many seconds of publishing ...
FLAT_SECONDS = 2.0
#: ... and every window's claim p99 under this many milliseconds
P99_LIMIT = 50.0
#: the acked rate with the snapshot held at least this share of the rate without
RATE_SHARE = 0.9
#: the runs of each ``--mvcc-snapshot`` choice, in order: (setup, snapshot held)
HOW = {True: "a snapshot held throughout", False: "no snapshot held"}
MODES = {"both": (("no snapshot", False), ("snapshot held", True)),
         "held": (("snapshot held", True),), "none": (("no snapshot", False),)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("mvcc")
    group.add_argument("--mvcc-minutes", type=float, default=0,
                       help="minutes of load per database (default 10, quick 1)")
    group.add_argument("--mvcc-rate", type=float, default=200.0,
                       help="messages published a second (default 200)")
    group.add_argument("--mvcc-prefetch", type=int, default=8,
                       help="the consumer's prefetch (default 8: a Celery worker of "
                            "concurrency 2 at the default multiplier)")
    group.add_argument("--mvcc-sample", type=float, default=10.0,
                       help="seconds per line of the table (default 10)")
    group.add_argument("--mvcc-snapshot", choices=tuple(MODES), default="both",
                       help="run the load with a snapshot held, without, or both in turn "
                            "(default both: without first)")
    group.add_argument("--mvcc-queue", default=QUEUE,
                       help=f"the queue (default {QUEUE}): runs side by side take one each")


def database_url(database: str) -> str:
    """The server's URL; PostgreSQL's pointed at a database of this run's own (created
    when missing): there the held snapshot stops vacuum for no one else."""
    if database != "postgresql":
        return make_url(SERVERS[database]).render_as_string(hide_password=False)
    return own_database("mvcc")


def own_database(suffix: str) -> str:
    """The URL of PostgreSQL's ``<db>_<suffix>``, a database created when missing."""
    url = make_url(SERVERS["postgresql"])
    own = f"{url.database}_{suffix}"
    admin = create_engine(url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            if conn.execute(text("SELECT 1 FROM pg_database WHERE datname = :n"),
                            {"n": own}).first() is None:
                conn.execute(text(f'CREATE DATABASE "{own}"'))
    finally:
        admin.dispose()
    return url.set(database=own).render_as_string(hide_password=False)


def transport_url(url: str) -> str:
    return "sqlinbox+" + url


# -- the child processes -------------------------------------------------------------------
def publisher(url: str, name: str, rate: float, seconds: float, published: Any, ready: Any,
              start: Any) -> None:
    """Publish ``rate`` messages a second for ``seconds``: every :data:`TICK` seconds the
    messages due by then, in one transaction (a bound batch: one multi-row INSERT and
    one commit), so that the rate holds on a loaded machine, where a commit per message
    from one process falls far short. A late tick sends more: the rate is kept over the
    run, not per tick."""
    queue = kombu_queue(name)
    engine = create_engine(url, pool_size=1)
    conn = Connection(transport_url(url), transport_options={"table_prefix": PREFIX})
    producer = declared_producer(conn.default_channel, queue)
    ready.set()
    start.wait(START_LIMIT)
    began = time.monotonic()
    sent = 0
    while (now := time.monotonic()) < began + seconds:
        due = min(int((now - began) * rate), int(seconds * rate))
        if due > sent:
            with engine.connect() as db, db.begin(), celery_ext.bind(db):
                for i in range(sent, due):
                    producer.publish(body(i), retry=False)
            with published.get_lock():
                published.value += due - sent
            sent = due
        time.sleep(max(0.0, now + TICK - time.monotonic()))
    conn.release()
    engine.dispose()


def consumer(url: str, name: str, prefetch: int, acked: Any, claims: Any, stop: Any,
             ready: Any) -> None:
    """Consume and ack until ``stop``; every claim statement's duration (and its end time)
    goes to ``claims`` once a second (see :func:`~bench.children.timed_claims`)."""
    timings = timed_claims()

    def on_message(payload: dict[str, Any], message: Any) -> None:
        message.ack()
        with acked.get_lock():
            acked.value += 1

    queue = kombu_queue(name)
    with Connection(transport_url(url), transport_options={"table_prefix": PREFIX}) as conn:
        channel = conn.channel()
        worker = Consumer(channel, [queue], callbacks=[on_message], accept=["json"])
        worker.qos(prefetch_count=prefetch)
        worker.consume()
        ready.set()
        sent = time.monotonic()
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                conn.drain_events(timeout=0.5)
            if time.monotonic() - sent >= 1.0:
                claims.put(timings[:])
                timings.clear()
                sent = time.monotonic()
        claims.put(timings[:])
        worker.cancel()
        channel.close()


# -- the held snapshot and the samples ------------------------------------------------------
def dead_rows(engine: Engine, database: str, table: str) -> dict[str, Any]:
    """PostgreSQL: dead and live tuples, table+index MB; MariaDB: history list length
    (undo records purge has yet to remove) and table+index MB."""
    with engine.connect() as conn:
        if database == "postgresql":
            row = conn.execute(text(
                "SELECT n_dead_tup, n_live_tup, pg_total_relation_size(relid) "
                "FROM pg_stat_user_tables WHERE relname = :t"), {"t": table}).first()
            if row is None:
                return {}
            return {"dead": row[0], "live": row[1], "mb": row[2] / 2**20}
        status = conn.execute(text("SHOW ENGINE INNODB STATUS")).one()[2]
        history = next(int(line.split()[-1]) for line in status.splitlines()
                       if line.startswith("History list length"))
        size = conn.execute(text(
            "SELECT data_length + index_length FROM information_schema.tables "
            "WHERE table_schema = DATABASE() AND table_name = :t"), {"t": table}).scalar()
        return {"history": history, "mb": (size or 0) / 2**20}


class StandInVacuum:
    """Autovacuum's part for one table where the server has autovacuum off: a thread
    that checks every ``autovacuum_naptime`` and vacuums past autovacuum's threshold, at
    autovacuum's pace (its cost delay and limit).
    ``count`` is how many vacuums it ran; nothing runs where autovacuum is on."""

    def __init__(self, engine: Engine, database: str, table: str) -> None:
        self.engine, self.table, self.count = engine, table, 0
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        if database == "postgresql":
            with engine.connect() as conn:
                settings = dict(conn.execute(text(
                    "SELECT name, setting FROM pg_settings WHERE name IN ('autovacuum', "
                    "'autovacuum_naptime', 'autovacuum_vacuum_threshold', "
                    "'autovacuum_vacuum_scale_factor', 'autovacuum_vacuum_cost_delay', "
                    "'autovacuum_vacuum_cost_limit', 'vacuum_cost_limit')")).all())
            if settings["autovacuum"] == "off":
                self.naptime = float(settings["autovacuum_naptime"])
                self.threshold = float(settings["autovacuum_vacuum_threshold"])
                self.scale = float(settings["autovacuum_vacuum_scale_factor"])
                # autovacuum's pace: its cost delay (ms) and limit (-1: vacuum's own)
                limit = settings["autovacuum_vacuum_cost_limit"]
                self.pace = {"delay": float(settings["autovacuum_vacuum_cost_delay"]),
                             "limit": int(settings["vacuum_cost_limit"] if limit == "-1"
                                          else limit)}
                self.thread = threading.Thread(target=self.run, daemon=True)

    def __enter__(self) -> StandInVacuum:
        if self.thread is not None:
            self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join(60)

    def run(self) -> None:
        while not self.stop.wait(self.naptime):
            with self.engine.connect() as conn:
                conn.execute(text("SELECT set_config('vacuum_cost_delay', :delay, false), "
                                  "set_config('vacuum_cost_limit', :limit, false)"),
                             {"delay": f"{self.pace['delay']}ms",
                              "limit": str(self.pace["limit"])})
                row = conn.execute(text(
                    "SELECT s.n_dead_tup, c.reltuples FROM pg_stat_user_tables s "
                    "JOIN pg_class c ON c.oid = s.relid WHERE s.relname = :t"),
                    {"t": self.table}).first()
                if row is not None and row[0] > self.threshold + self.scale * max(0, row[1]):
                    conn.execute(text(f'VACUUM "{self.table}"'))
                    self.count += 1


def claim_pages(broker: Broker, spec: TableSpec, database: str) -> int:
    """The pages (buffers) one claim reads now, above a floor read as the consumer's is."""
    with broker.engine.connect() as conn:
        floor = broker.dialect.claim_floor(conn, spec)
        return pages_read(conn, database, broker, spec, broker.dialect.statements(spec).claim[0],
                          floor or 0.0)[0]


def percentile(values: list[float], top: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(top * (len(ordered) - 1)))]


def next_window(began: float, index: int, seconds: float, publisher: Any, reports: Any,
                timings: list[tuple[float, float]]) -> tuple[float, list[float]]:
    """Wait until sample ``index``'s window ends (or the publisher does), reading the
    consumer's reports of claim timings into ``timings``: the time, and the window's
    claim milliseconds (taken out of ``timings``)."""
    window_end = began + (index + 1) * seconds
    while time.time() < window_end and publisher.is_alive():
        time.sleep(min(0.5, max(0.0, window_end - time.time())))
        with contextlib.suppress(stdlib_queue.Empty):
            while True:
                timings += reports.get_nowait()
    now = time.time()
    window = [d * 1000 for end, d in timings if end <= now]
    timings[:] = [t for t in timings if t[0] > now]
    return now, window


def claim_figures(window: list[float]) -> dict[str, Any]:
    """A window's claims: how many, p50 and p99 (None without any)."""
    return {"claims": len(window), "p50": statistics.median(window) if window else None,
            "p99": percentile(window, 0.99) if window else None}


def measure(database: str, args: argparse.Namespace, seconds: float, held: bool) -> Cell:
    """One database's run, a snapshot ``held`` throughout or not: the samples (in
    ``details``), the figure the claims' worst p99."""
    url = database_url(database)
    # a queue (and table) of each mode's own: the process's broker keeps the first's
    # declaration after the run drops its table
    name = args.mvcc_queue if held else f"{args.mvcc_queue}free"
    table = table_name_for_queue(name, PREFIX)
    engine = create_engine(url, isolation_level="AUTOCOMMIT", pool_size=2)
    published, acked = SPAWN.Value("q", 0), SPAWN.Value("q", 0)
    claims, stop, start = SPAWN.Queue(), SPAWN.Event(), SPAWN.Event()
    ready = [SPAWN.Event(), SPAWN.Event()]
    # the queue exists (empty) before the snapshot is taken
    with engine.connect() as conn:
        conn.execute(text(f"DROP TABLE IF EXISTS {table}"))
    own = Connection(transport_url(url), transport_options={"table_prefix": PREFIX})
    kombu_queue(name)(own.default_channel).declare()
    broker = own.default_channel.broker
    spec = broker.table(name).spec
    samples: list[dict[str, Any]] = []
    timings: list[tuple[float, float]] = []
    children = [SPAWN.Process(target=consumer,
                              args=(url, name, args.mvcc_prefetch, acked, claims,
                                    stop, ready[0])),
                SPAWN.Process(target=publisher,
                              args=(url, name, args.mvcc_rate, seconds, published,
                                    ready[1], start))]
    try:
        with (snapshot_held(engine, database) if held else contextlib.nullcontext(),
              StandInVacuum(engine, database, table) as vacuum):
            for child in children:
                child.start()
            if not all(event.wait(START_LIMIT) for event in ready):
                raise RuntimeError("the consumer or the publisher did not start")
            start.set()
            began = time.time()
            last = {"published": 0, "acked": 0}
            while children[1].is_alive() or not samples:
                now, window = next_window(began, len(samples), args.mvcc_sample, children[1],
                                          claims, timings)
                if not children[0].is_alive():
                    raise RuntimeError("the consumer process ended")
                counts = {"published": published.value, "acked": acked.value}
                sample = {
                    "t": now - began,
                    "published": counts["published"] - last["published"],
                    "acked": counts["acked"] - last["acked"],
                    "backlog": counts["published"] - counts["acked"],
                    **claim_figures(window),
                    "pages": claim_pages(broker, spec, database),
                    **dead_rows(engine, database, table),
                    **({"vacuums": vacuum.count} if vacuum.thread is not None else {}),
                }
                last = counts
                samples.append(sample)
                progress(f"{NAME} {database} " + line(sample))
    finally:
        stop.set()
        for child in children:
            child.join(15)
            if child.is_alive():
                child.kill()
        with engine.connect() as conn:
            conn.execute(text(f"DROP TABLE IF EXISTS {table}"))
        engine.dispose()
        own.release()
    worst = max((s["p99"] for s in samples if s["p99"] is not None), default=None)
    return Cell(worst, "n/a" if worst is None else f"{worst:.1f}",
                {"samples": samples, "rate": args.mvcc_rate, "seconds": seconds,
                 "prefetch": args.mvcc_prefetch, "held": held})


def line(sample: dict[str, Any]) -> str:
    return " ".join(f"{key}={value:.1f}" if isinstance(value, float) else f"{key}={value}"
                    for key, value in sample.items())


def run(args: argparse.Namespace) -> list[Row]:
    """Both databases at once, each in a thread with its own processes; a database's
    modes one after the other."""
    seconds = 60 * (args.mvcc_minutes or (1 if args.quick else 10))
    chosen = [d for d in args.databases if d in DATABASES]
    modes = MODES[getattr(args, "mvcc_snapshot", "held")]
    rows: dict[str, list[Row]] = {d: [] for d in chosen}

    def one(database: str) -> None:
        for setup, held in modes:
            try:
                cell = measure(database, args, seconds, held)
            except Exception as exc:
                cell = Cell.failed(exc)
            rows[database].append(cell.row(NAME, database, setup, "p99_max"))

    threads = [threading.Thread(target=one, args=(d,)) for d in chosen]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [row for d in chosen for row in rows[d]]


def figure(value: Any, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def markdown(rows: list[Row], args: argparse.Namespace) -> str:
    """Per database: a line per sample, then the summary line."""
    parts = []
    for row in rows:
        samples = row["details"].get("samples")
        if not samples:
            parts.append(f"{row['database']}, {row['setup']}: {row['text']}")
            continue
        postgres = row["database"] == "postgresql"
        dead = ("n_dead_tup", "n_live_tup") if postgres else ("history list length",)
        headings = ["t (s)", "published/s", "acked/s", "backlog", "claims", "claim p50 ms",
                    "claim p99 ms", "claim pages", *dead, "table+index MB"]
        lines = []
        before = 0.0
        for s in samples:
            span = max(1e-9, s["t"] - before)
            before = s["t"]
            kept = [figure(s.get("dead"), 0), figure(s.get("live"), 0)] if postgres else [
                figure(s.get("history"), 0)]
            lines.append([f"{s['t']:.0f}", figure(s["published"] / span, 0),
                          figure(s["acked"] / span, 0), s["backlog"], s["claims"],
                          figure(s["p50"], 2), figure(s["p99"], 2), s.get("pages", "-"), *kept,
                          figure(s.get("mb"))])
        details = row["details"]
        parts.append(f"**{row['database']}**, {details['rate']:g} msg/s for "
                     f"{details['seconds'] / 60:g} min, prefetch {details['prefetch']}, "
                     f"{HOW[details.get('held', True)]}\n\n" + grid(headings, lines) + "\n\n"
                     + summary(row["database"], samples, details["seconds"]))
    return "\n\n".join([*parts, *side_by_side(rows)])


def acked_rate(samples: list[dict[str, Any]]) -> float:
    return float(sum(s["acked"] for s in samples) / max(1e-9, samples[-1]["t"]))


def side_by_side(rows: list[Row]) -> list[str]:
    """Per database run both ways: one line per run and the held run's acked rate over the
    other's."""
    parts = []
    for database in dict.fromkeys(r["database"] for r in rows):
        runs = {r["setup"]: r["details"]["samples"] for r in rows
                if r["database"] == database and r["details"].get("samples")}
        if len(runs) < 2:
            continue
        key = "dead" if database == "postgresql" else "history"
        lines = [[setup, figure(sum(s["published"] for s in samples)
                                / max(1e-9, samples[-1]["t"]), 0),
                  figure(acked_rate(samples), 0),
                  figure(max((s["p99"] for s in samples if s["p99"] is not None),
                             default=None), 2),
                  f"{samples[-1]['backlog']}/{max(s['backlog'] for s in samples)}",
                  f"{samples[0]['pages']}/{samples[-1]['pages']}",
                  figure(samples[-1].get(key), 0), figure(samples[-1].get("mb"))]
                 for setup, samples in runs.items()]
        share = acked_rate(runs["snapshot held"]) / max(1e-9, acked_rate(runs["no snapshot"]))
        kept = "n_dead_tup" if key == "dead" else "history list length"
        parts.append(f"**{database}**, the same load without and with the snapshot\n\n"
                     + grid(["run", "published/s", "acked/s", "claim p99 max ms",
                             "backlog last/max", "claim pages first/last", f"{kept} last",
                             "table+index MB last"], lines)
                     + f"\n\nAcked rate, snapshot held ÷ none: {share:.2f}.")
    return parts


def summary(database: str, samples: list[dict[str, Any]], seconds: float) -> str:
    backlog = [s["backlog"] for s in samples]
    p99 = [s["p99"] for s in samples if s["p99"] is not None]
    rate = sum(s["published"] for s in samples) / max(1e-9, samples[-1]["t"])
    key = "dead" if database == "postgresql" else "history"
    kept = [s.get(key) for s in samples]
    name = "n_dead_tup" if key == "dead" else "history list length"
    return (f"Summary {database}: published {rate:.0f} msg/s over {samples[-1]['t']:.0f} s; "
            f"backlog first/last/max {backlog[0]}/{backlog[-1]}/{max(backlog)}; "
            f"claim p99 max {figure(max(p99, default=None), 2)} ms; "
            f"claim pages first/last/max {samples[0]['pages']}/{samples[-1]['pages']}/"
            f"{max(s['pages'] for s in samples)}; "
            f"{name} first/last {figure(kept[0], 0)}/{figure(kept[-1], 0)}.")


def targets(rows: list[Row]) -> list[Row]:
    """Claim p99 under 50 ms in every window; the backlog at the end under 2 s of load."""
    found = []
    for row in rows:
        samples = row["details"].get("samples")
        if not samples:
            continue
        setup = row["setup"]
        found.append(goal(NAME, row["database"], f"{setup}: claim p99, worst window (ms)",
                          row["value"], P99_LIMIT, at_most=True))
        found.append(goal(NAME, row["database"], f"{setup}: backlog at the end (messages)",
                          samples[-1]["backlog"], FLAT_SECONDS * row["details"]["rate"],
                          at_most=True))
    for database in dict.fromkeys(r["database"] for r in rows):
        runs = {r["setup"]: r["details"]["samples"] for r in rows
                if r["database"] == database and r["details"].get("samples")}
        if len(runs) == 2:
            found.append(goal(NAME, database, "acked msg/s, snapshot held ÷ none",
                              acked_rate(runs["snapshot held"])
                              / max(1e-9, acked_rate(runs["no snapshot"])), RATE_SHARE))
    return found


SECTION = Section(NAME, "The MVCC trap: steady load beside a snapshot held open",
                  add_arguments, run, markdown, targets)

if __name__ == "__main__":
    run_alone(SECTION)
