"""What the ordering tests, their consumer program and their Celery app share.

Every name is derived from the test's table prefix, so each test's tables are
its own and the prefix fixture drops them afterwards. The work log is a table
in the database under test: each process in work on a row writes one line per
delivery with the times it started and ended, which the tests then check for
overlaps and order.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

from sqlalchemy import (
    Column,
    Double,
    Integer,
    MetaData,
    String,
    Table,
    create_engine,
    func,
    select,
)
from sqlalchemy.engine import Engine

from kombu_sqlinbox import TableBuilder, TableSpec
from kombu_sqlinbox.broker import sqlalchemy_url


def declaration(prefix: str, kind: str) -> TableSpec | None:
    """The queue table of ``kind``: a FIFO group (``fifo``), a partition key (``keyed``), a
    FIFO group in row mode (``rows``: rows written with SQL run ``ord.step`` with the
    payload's JSON as keyword arguments)."""
    if kind == "plain":
        return None
    if kind == "rows":
        return (TableBuilder(f"{prefix}rows_jobs").id().payload().group("grp", fifo=True)
                .available_at().locked_until().attempt()
                .task("ord.step", arguments="kwargs").build())
    builder = TableBuilder(f"{prefix}{kind}_jobs").id().payload().headers()
    if kind == "fifo":
        builder.group("grp", fifo=True)
    else:
        builder.partition_key("pkey")
    return builder.priority().available_at().locked_until().attempt().build()


def transport_options(prefix: str, queue: str, kind: str, **queue_options: Any) -> dict[str, Any]:
    """Transport options with ``queue`` on its ``kind`` of table; ``queue_options`` go to
    the queue (claim, max_attempts, ...) except the global ones."""
    global_keys = {"polling_interval", "polling_interval_min", "polling_backoff", "notify",
                   "max_batch"}
    options: dict[str, Any] = {"table_prefix": prefix, "polling_interval": 0.05}
    options.update({k: v for k, v in queue_options.items() if k in global_keys})
    settings = {k: v for k, v in queue_options.items() if k not in global_keys}
    table = declaration(prefix, kind)
    if table is not None:
        settings["table"] = table
    options["queues"] = {queue: settings}
    return options


def log_table(prefix: str) -> Table:
    return Table(
        f"{prefix}work_log", MetaData(),
        Column("n", Integer, primary_key=True, autoincrement=True),
        Column("grp", String(64), nullable=False),
        Column("seq", Integer, nullable=False),
        Column("pid", Integer, nullable=False),
        Column("outcome", String(16), nullable=False),
        Column("started", Double, nullable=False),
        Column("ended", Double),
    )


@dataclass(frozen=True)
class Entry:
    """One delivery as its process recorded it (``ended`` is None while held)."""

    grp: str
    seq: int
    pid: int
    outcome: str
    started: float
    ended: float | None


class WorkLog:
    """The work log of one test: created by the test, written by every process."""

    def __init__(self, db_url: str, prefix: str) -> None:
        self.table = log_table(prefix)
        self.engine: Engine = create_engine(sqlalchemy_url(db_url))

    def create(self) -> None:
        self.table.create(self.engine, checkfirst=True)

    def record(self, grp: str, seq: int, outcome: str, started: float,
               ended: float | None = None) -> None:
        with self.engine.begin() as conn:
            conn.execute(self.table.insert(), {
                "grp": grp, "seq": seq, "pid": os.getpid(), "outcome": outcome,
                "started": started, "ended": ended})

    def entries(self) -> list[Entry]:
        with self.engine.connect() as conn:
            rows = conn.execute(select(*(c for c in self.table.c if c.name != "n"))
                                .order_by(self.table.c.n)).all()
        return [Entry(*row) for row in rows]

    def done(self, outcome: str = "done") -> int:
        """How many deliveries ended with ``outcome``."""
        with self.engine.connect() as conn:
            return int(conn.execute(select(func.count()).select_from(self.table)
                                    .where(self.table.c.outcome == outcome)).scalar_one())

    def close(self) -> None:
        self.engine.dispose()


def by_group(entries: Iterable[Entry]) -> dict[str, list[Entry]]:
    """Each group's (or key's) entries, in the order they started."""
    found: dict[str, list[Entry]] = {}
    for entry in sorted(entries, key=lambda e: e.started):
        found.setdefault(entry.grp, []).append(entry)
    return found


def overlaps(entries: list[Entry]) -> list[tuple[Entry, Entry]]:
    """Pairs of one group's deliveries that were in work at the same time."""
    ordered = sorted(entries, key=lambda e: e.started)
    found = []
    for before, after in pairwise(ordered):
        end = before.ended if before.ended is not None else time.time()
        if after.started < end:
            found.append((before, after))
    return found


def check_serial_in_order(entries: Iterable[Entry], expected: dict[str, int]) -> None:
    """Per group: deliveries never overlap, and the rows completed are 0..n-1 in order,
    each once."""
    groups = by_group(entries)
    assert sorted(groups) == sorted(expected), "groups seen differ from groups sent"
    for grp, mine in groups.items():
        clashes = overlaps(mine)
        assert not clashes, f"group {grp}: {len(clashes)} overlaps, first {clashes[0]}"
        completed = [e.seq for e in mine if e.outcome == "done"]
        assert completed == list(range(expected[grp])), (
            f"group {grp}: completed out of order or not once each: {completed[:20]}...")


def any_overlap_across(entries: Iterable[Entry]) -> bool:
    """Whether rows of two different groups were ever in work at the same time."""
    latest_end: dict[str, float] = {}  # group -> latest end among entries started so far
    for entry in sorted((e for e in entries if e.ended is not None), key=lambda e: e.started):
        if any(end > entry.started for grp, end in latest_end.items() if grp != entry.grp):
            return True
        latest_end[entry.grp] = max(latest_end.get(entry.grp, 0.0), entry.ended or 0.0)
    return False
