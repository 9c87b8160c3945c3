"""PgQ under the mvcc section's load: the anchor for the MVCC trap on PostgreSQL.

    python bench/pgq.py [--mvcc-minutes N] [--mvcc-rate MSG_S] [--mvcc-sample S]
                        [--mvcc-snapshot both|held|none]

PgQ (the ``pgq`` extension; Debian's ``postgresql-15-pgq3``, no server restart, no
preloaded library) keeps events in tables it rotates and truncates instead of deleting
rows, the classic answer to dead rows. Here it gets the load of ``bench/mvcc.py``: a
publisher process inserts ``--mvcc-rate`` events a second (``pgq.insert_event``, the
events due every 50 ms in one transaction), a consumer process takes batches
(``pgq.next_batch``, ``pgq.get_batch_events``, ``pgq.finish_batch``) and counts each
event, and this process ticks (``pgq.ticker()`` every 0.5 s, what ``pgqd`` does) and runs
the maintenance ``pgqd`` would (``pgq.maint_operations()``, every 10 s; the queue rotates
every 30 s instead of every 2 hours, so a short run rotates). Per window: events
inserted and consumed, the backlog, the p50 / p99 of the consumer's batch fetch
(``next_batch`` and ``get_batch_events``: what stands for a claim), and the queue's event
tables' size. Runs in a database of its own (``<db>_pgq``, created when missing, with the
extension). A snapshot held anywhere on the server holds PgQ's rotation back (it waits
for the oldest transaction of the cluster). Not a test: figures depend on the machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # run as a script: import the bench package, not its modules
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from sqlalchemy import create_engine, text
from sqlalchemy.engine import Connection, Engine

from bench import mvcc
from bench.children import SPAWN
from bench.cli import run_alone
from bench.kombu_bench import body
from bench.mvcc import (
    MODES,
    START_LIMIT,
    TICK,
    acked_rate,
    claim_figures,
    figure,
    next_window,
    own_database,
)
from bench.registry import Cell, Row, Section, goal, progress
from bench.report import grid
from tests.databases import snapshot_held

NAME = "pgq"
QUEUE = "sqlinbox_bench"
CONSUMER = "bench"
#: seconds between ticks, and between rounds of maintenance
TICKS, MAINTENANCE = 0.5, 10.0
ROTATION = "30 seconds"
#: a maintenance function or table PgQ names (called by name: checked first)
NAMES = re.compile(r"^[a-z_][a-z0-9_]*(\.[a-z_][a-z0-9_]*)?$")


def publisher(url: str, rate: float, seconds: float, published: Any, ready: Any,
              start: Any) -> None:
    """Insert ``rate`` events a second for ``seconds``, the ones due every :data:`TICK`
    seconds in one transaction (as the mvcc section's publisher does)."""
    engine = create_engine(url, pool_size=1)
    insert = text("SELECT pgq.insert_event(:q, 'task', :d)")
    ready.set()
    start.wait(START_LIMIT)
    began, sent = time.monotonic(), 0
    while (now := time.monotonic()) < began + seconds:
        due = min(int((now - began) * rate), int(seconds * rate))
        if due > sent:
            with engine.begin() as db:
                db.execute(insert, [{"q": QUEUE, "d": json.dumps(body(i))}
                                    for i in range(sent, due)])
            with published.get_lock():
                published.value += due - sent
            sent = due
        time.sleep(max(0.0, now + TICK - time.monotonic()))
    engine.dispose()


def consumer(url: str, acked: Any, fetches: Any, stop: Any, ready: Any) -> None:
    """Take batches until ``stop``: each event counted; every fetch's (end, seconds) to
    ``fetches`` once a second."""
    engine = create_engine(url, pool_size=1)
    timings: list[tuple[float, float]] = []
    ready.set()
    sent = time.monotonic()
    while not stop.is_set():
        began = time.perf_counter()
        with engine.begin() as db:
            batch = db.execute(text("SELECT pgq.next_batch(:q, :c)"),
                               {"q": QUEUE, "c": CONSUMER}).scalar()
            events = [] if batch is None else db.execute(
                text("SELECT ev_id, ev_data FROM pgq.get_batch_events(:b)"), {"b": batch}).all()
            timings.append((time.time(), time.perf_counter() - began))
            for event in events:
                json.loads(event.ev_data)
            if batch is not None:
                db.execute(text("SELECT pgq.finish_batch(:b)"), {"b": batch})
        with acked.get_lock():
            acked.value += len(events)
        if batch is None:
            stop.wait(0.05)  # no tick yet: wait for the ticker
        if time.monotonic() - sent >= 1.0:
            fetches.put(timings[:])
            timings.clear()
            sent = time.monotonic()
    fetches.put(timings[:])
    engine.dispose()


def ticker(engine: Engine, stop: threading.Event, failed: list[BaseException]) -> None:
    """What ``pgqd`` does: a tick every :data:`TICKS` seconds, maintenance every
    :data:`MAINTENANCE` (its ``vacuum`` operations as ``VACUUM``). A failure goes to
    ``failed``, which the run checks at every sample."""
    maintained = time.monotonic()
    try:
        with engine.connect() as conn:
            while not stop.wait(TICKS):
                conn.execute(text("SELECT pgq.ticker()"))
                if time.monotonic() - maintained >= MAINTENANCE:
                    maintained = time.monotonic()
                    maintain(conn)
    except Exception as exc:
        failed.append(exc)


def maintain(conn: Connection) -> None:
    for function, argument in conn.execute(
            text("SELECT func_name, func_arg FROM pgq.maint_operations()")).all():
        if not NAMES.match(function) or (argument is not None and not NAMES.match(argument)):
            raise RuntimeError(f"unexpected maintenance {function!r}({argument!r})")
        if function == "vacuum":
            conn.execute(text(f"VACUUM {argument}"))
        elif argument is None:
            conn.execute(text(f"SELECT {function}()"))
        else:
            conn.execute(text(f"SELECT {function}(:a)"), {"a": argument})


def event_tables_mb(engine: Engine) -> float:
    with engine.connect() as conn:
        size = conn.execute(text(
            "SELECT sum(pg_total_relation_size(c.oid)) FROM pg_class c "
            "JOIN pg_namespace n ON n.oid = c.relnamespace "
            "JOIN pgq.queue q ON c.relname LIKE 'event\\_' || q.queue_id || '\\_%' "
            "WHERE n.nspname = 'pgq' AND q.queue_name = :q"), {"q": QUEUE}).scalar()
    return float(size or 0) / 2**20


def prepare(engine: Engine) -> None:
    """The extension, and the queue afresh with its consumer."""
    with engine.connect() as conn:
        conn.execute(text("CREATE EXTENSION IF NOT EXISTS pgq"))
        if conn.execute(text("SELECT 1 FROM pgq.queue WHERE queue_name = :q"),
                        {"q": QUEUE}).first():
            conn.execute(text("SELECT pgq.drop_queue(:q, true)"), {"q": QUEUE})  # consumers too
        conn.execute(text("SELECT pgq.create_queue(:q)"), {"q": QUEUE})
        conn.execute(text("SELECT pgq.set_queue_config(:q, 'rotation_period', :r)"),
                     {"q": QUEUE, "r": ROTATION})
        conn.execute(text("SELECT pgq.register_consumer(:q, :c)"), {"q": QUEUE, "c": CONSUMER})


def measure(args: argparse.Namespace, seconds: float, held: bool) -> Cell:
    """One run, a snapshot ``held`` throughout or not: samples in ``details``."""
    url = own_database("pgq")
    engine = create_engine(url, isolation_level="AUTOCOMMIT", pool_size=3)
    prepare(engine)
    published, acked = SPAWN.Value("q", 0), SPAWN.Value("q", 0)
    fetches, stop, start = SPAWN.Queue(), SPAWN.Event(), SPAWN.Event()
    ready = [SPAWN.Event(), SPAWN.Event()]
    children = [SPAWN.Process(target=consumer, args=(url, acked, fetches, stop, ready[0])),
                SPAWN.Process(target=publisher, args=(url, args.mvcc_rate, seconds, published,
                                                      ready[1], start))]
    ticking = threading.Event()
    failed: list[BaseException] = []
    tick_thread = threading.Thread(target=ticker, args=(engine, ticking, failed), daemon=True)
    samples: list[dict[str, Any]] = []
    timings: list[tuple[float, float]] = []
    try:
        with snapshot_held(engine, "postgresql") if held else contextlib.nullcontext():
            tick_thread.start()
            for child in children:
                child.start()
            if not all(event.wait(START_LIMIT) for event in ready):
                raise RuntimeError("the consumer or the publisher did not start")
            start.set()
            began, last = time.time(), (0, 0)
            while children[1].is_alive() or not samples:
                now, window = next_window(began, len(samples), args.mvcc_sample, children[1],
                                          fetches, timings)
                if failed:
                    raise RuntimeError("the ticker failed") from failed[0]
                counts = (published.value, acked.value)
                sample = {"t": now - began, "published": counts[0] - last[0],
                          "acked": counts[1] - last[1], "backlog": counts[0] - counts[1],
                          **claim_figures(window), "mb": event_tables_mb(engine)}
                last = counts
                samples.append(sample)
                progress(f"{NAME} held={held} " + " ".join(
                    f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}"
                    for k, v in sample.items()))
    finally:
        stop.set()
        ticking.set()
        for child in children:
            child.join(15)
            if child.is_alive():
                child.kill()
        tick_thread.join(10)
        engine.dispose()
    worst = max((s["p99"] for s in samples if s["p99"] is not None), default=None)
    return Cell(worst, figure(worst), {"samples": samples, "rate": args.mvcc_rate,
                                       "seconds": seconds, "held": held})


def run(args: argparse.Namespace) -> list[Row]:
    if "postgresql" not in args.databases:
        return []
    seconds = 60 * (args.mvcc_minutes or (1 if args.quick else 10))
    rows = []
    for setup, held in MODES[args.mvcc_snapshot]:
        try:
            cell = measure(args, seconds, held)
        except Exception as exc:
            cell = Cell.failed(exc)
        rows.append(cell.row(NAME, "postgresql", setup, "p99_max"))
    return rows


def markdown(rows: list[Row], args: argparse.Namespace) -> str:
    lines = []
    for row in rows:
        samples = row["details"].get("samples")
        if not samples:
            lines.append([row["setup"], row["text"], "", "", "", ""])
            continue
        lines.append([row["setup"],
                      figure(sum(s["published"] for s in samples) / samples[-1]["t"], 0),
                      figure(acked_rate(samples), 0), row["text"],
                      f"{samples[-1]['backlog']}/{max(s['backlog'] for s in samples)}",
                      f"{figure(samples[-1]['mb'])}/{figure(max(s['mb'] for s in samples))}"])
    minutes = 60 * (args.mvcc_minutes or (1 if args.quick else 10)) / 60
    return (grid(["run", "inserted/s", "consumed/s", "batch fetch p99 max ms",
                  "backlog last/max", "event tables MB last/max"], lines)
            + f"\n\nPgQ at {args.mvcc_rate:g} events/s for {minutes:g} min a run; ticks every "
            f"{TICKS:g} s, maintenance every {MAINTENANCE:g} s, rotation every {ROTATION}.")


def targets(rows: list[Row]) -> list[Row]:
    runs = {r["setup"]: r["details"]["samples"] for r in rows if r["details"].get("samples")}
    if len(runs) < 2:
        return []
    return [goal(NAME, "postgresql", "PgQ consumed/s, snapshot held ÷ none",
                 acked_rate(runs["snapshot held"]) / max(1e-9, acked_rate(runs["no snapshot"])),
                 None)]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """None: the mvcc section's (``--mvcc-*``) say the load, and it adds them."""


SECTION = Section(NAME, "PgQ under the same load: the MVCC trap's anchor",
                  add_arguments, run, markdown, targets)

if __name__ == "__main__":
    run_alone(replace(SECTION, add_arguments=mvcc.add_arguments))
