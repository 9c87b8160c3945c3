"""What a page of the dashboard reads beyond the ``queues`` figures: a queue's ready rows
and its blocked FIFO groups, a keyset page at a time; the figures themselves estimated
where counting them would read a large table.

Every read walks the primary key from a given id and stops after ``limit`` rows (the
dialects' ``ready_page`` and ``blocked_groups``): no count, no offset, so a page costs
the same at the millionth row as at the first. Beside :mod:`.operations`, at the top of
the layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

from sqlalchemy import Connection

from .codec import Undecodable, decode_row
from .dialects.base import json_text, plain_payload
from .operations import Operations, QueueFigures, _rows, _seconds
from .rows import ClaimedRow
from .tables import TableSpec

__all__ = ["EXACT_UPTO", "BlockedGroup", "ReadyRow", "blocked_groups", "estimated_figures",
           "ready_page"]

#: how many unfinished rows a table may have for the dashboard to count them exactly
EXACT_UPTO = 10_000


@dataclass(frozen=True)
class ReadyRow:
    """A row claimable now: its task (None where the row does not decode: ``problem``
    says why), how long it has been due, its priority and FIFO group."""

    id: int
    attempt: int
    task: str | None
    task_id: str | None
    ready_age: float | None
    priority: int | None
    group: str | None
    problem: str | None = None


@dataclass(frozen=True)
class BlockedGroup:
    """A FIFO group whose head is in work with ``behind`` rows waiting after it."""

    group: str
    head: int
    attempt: int
    lease_left: float | None
    behind: int


def ready_page(ops: Operations, queue: str, after: int = 0, limit: int = 50
               ) -> list[ReadyRow]:
    """Up to ``limit`` of the queue's ready rows after id ``after``, by id (empty when its
    table does not exist)."""
    if not ops.broker.known_table(queue):
        return []
    table = ops.broker.table(queue)
    rows = ops.broker.run(partial(_rows, ops.dialect.ready_page(table.spec),
                                  {"after": after, "limit": limit}), read_only=True)
    found = []
    for row in rows:
        stored = ClaimedRow(id=int(row.id), attempt=int(row.attempt),
                            payload=plain_payload(row.payload),
                            headers=json_text(row.headers), group=None, partition_key=None)
        task = task_id = problem = None
        try:
            headers = decode_row(stored, table, 0)["headers"]
            task, task_id = headers.get("task"), headers.get("id")
        except Undecodable as exc:
            problem = str(exc)
        found.append(ReadyRow(
            stored.id, stored.attempt, task, task_id, _seconds(row.ready_age),
            None if row.priority is None else int(row.priority),
            None if row.grp is None else str(row.grp), problem))
    return found


def blocked_groups(ops: Operations, queue: str, after: int = 0, limit: int = 50
                   ) -> list[BlockedGroup] | None:
    """Up to ``limit`` of a FIFO queue's blocked groups, by their head's id after
    ``after``; None for a queue that is not FIFO (nothing can block)."""
    statement = ops.dialect.blocked_groups(ops.broker.spec_for(queue))
    if statement is None:
        return None
    if not ops.broker.known_table(queue):
        return []
    rows = ops.broker.run(partial(_rows, statement, {"after": after, "limit": limit}),
                          read_only=True)
    return [BlockedGroup(str(row.grp), int(row.id), int(row.attempt),
                         _seconds(row.lease_left), int(row.behind)) for row in rows]


def estimated_figures(ops: Operations, only: Sequence[str] = (),
                      exact_upto: int = EXACT_UPTO) -> list[QueueFigures]:
    """The queues' figures (:meth:`~.operations.Operations.figures`), except that a table
    with more than ``exact_upto`` unfinished rows is not counted: its figures are only
    the planner's estimate of its rows (``about``). Telling the two apart reads
    ``exact_upto + 1`` rows at most; a database that gives no estimate (SQLite) is
    counted whatever its size."""

    def read(conn: Connection, name: str, spec: TableSpec, exists: bool) -> QueueFigures:
        estimate = ops.dialect.row_estimate(spec)
        if exists and estimate is not None:
            counted = int(conn.execute(ops.dialect.bounded_count(spec),
                                       {"limit": exact_upto + 1}).scalar_one())
            if counted > exact_upto:
                about = max(counted, ops.dialect.estimated_rows(conn, estimate))
                return QueueFigures(name, spec.table, True, about=about)
        return ops.exact_figures(conn, name, spec, exists)

    return ops.figures(only, read)
