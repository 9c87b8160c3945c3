"""Rate limits per task: a queue's ``task_rate_limits={"proj.tasks.call_api": "10/s"}``
holds the claims of that task's messages in the queue across every worker, where Celery's
own ``rate_limit`` is kept by each worker alone.

A claim of such a queue first reads the task names (the ``task`` header Celery sends) of
its first ready rows: one read, all an idle queue costs. It takes tokens from the budget
of each limited task it saw, for as many of its rows as it saw (the budget named
``<queue>\\x1f<task>``, cut into sharded windows as a queue's is: no hot row, see
:mod:`.rates`). Then, in one transaction, it reads the first ready rows whose task is not
spent (locked, passing over rows other claims hold), keeps each limited task's rows to
its tokens, and leases them by id. Tokens it did not use go back. Messages of tasks
without a limit, and those naming no task, are claimed as before beside them.

A queue's own ``rate_limit`` bounds the whole claim first. With concurrency limits the
rows are chosen the same way, unlocked, and the :class:`~.limits.Limiter` claims among
them within its slots.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from sqlalchemy import Connection, TextClause

from .database import Database
from .errors import ConfigurationError
from .keeper import LeaseKeeper
from .limits import OVERSCAN, ROUNDS, Limiter
from .rates import Budget, Claimer, Demand, RateLimits, Taken
from .rows import ClaimedRow, QueueTable

#: between a queue's name and a task's in the name of the task's budget
SEPARATOR = "\x1f"
#: the longest budget name kept readable (a longer one is its digest)
MAX_NAME = 255


def budget_name(queue: str, task: str) -> str:
    """The budget of ``task``'s messages in ``queue``."""
    name = f"{queue}{SEPARATOR}{task}"
    if len(name) <= MAX_NAME:
        return name
    return SEPARATOR + hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()


def choose(found: Iterable[Sequence[Any]], left: dict[str, int], limit: int,
           skip: set[Any], chosen: dict[int, str | None]) -> None:
    """Add to ``chosen`` (id: task) the candidate rows ``id, task[, partition_key]`` (in
    claim order) a claim takes: a limited task's rows while its tokens ``left`` last,
    any other's as they come, none of a partition key in ``skip``, up to ``limit``."""
    for row in found:
        row_id, task = int(row[0]), None if row[1] is None else str(row[1])
        if row_id in chosen or (len(row) > 2 and row[2] in skip):
            continue
        if task in left:
            if not left[task]:
                continue
            left[task] -= 1
        chosen[row_id] = task
        if len(chosen) == limit:
            return


class TaskRates(RateLimits):
    """The rate limits of queues and of their tasks, for this process's consumers."""

    def __init__(self, database: Database, keeper: LeaseKeeper, prefix: str,
                 create: bool) -> None:
        super().__init__(database, prefix, create)
        self.keeper = keeper

    def ready(self, table: QueueTable, limit: int) -> Demand:
        """The task names of the first ready rows (``limit`` times :data:`OVERSCAN`),
        counted, passing over the tasks whose window this process found spent: the rows
        of other tasks queued behind theirs go on."""
        if not table.options.task_rate_limits:
            return super().ready(table, limit)
        tasks, _ = self.reads(table)
        spent = [task for task, _ in table.options.task_rate_limits
                 if self.spent(budget_name(table.queue, task))]

        def read(conn: Connection) -> list[Any]:
            return [row[0] for row in conn.execute(tasks, {
                "limit": limit * OVERSCAN, "spent": spent,
                "floor": self.dialect.claim_floor(conn, table.spec)})]

        return Counter(None if name is None else str(name)
                       for name in self.database.run(read, read_only=True))

    def claim_ready(self, table: QueueTable, limit: int, skip: Sequence[Any],
                    claims: Claimer, demand: Demand) -> list[ClaimedRow]:
        """Take each limited task's tokens for the rows seen, claim within them, give back
        what went unused."""
        limits = dict(table.options.task_rate_limits)
        if not limits:
            return super().claim_ready(table, limit, skip, claims, demand)
        takes: dict[str, tuple[str, Budget, Taken]] = {}
        for task, seen in sorted(demand.items(), key=lambda item: item[0] or ""):
            rate = None if task is None else limits.get(task)
            if task is not None and rate is not None:
                name, budget = budget_name(table.queue, task), Budget.of(rate)
                taken = self.take(name, budget, min(seen, limit))
                if taken.total:
                    takes[task] = (name, budget, taken)
        caps = {task: taken.total for task, (_, _, taken) in takes.items()}
        rows: list[ClaimedRow] = []
        chosen: dict[int, str | None] = {}
        if caps or any(task not in limits for task in demand):
            rows, chosen = self._claim(table, limit, skip, claims, caps, set(limits) - set(caps))
        used = Counter(chosen.get(row.id) for row in rows)
        for task, (name, budget, taken) in takes.items():
            self.finish(name, budget, taken, used[task])
        return rows

    def _claim(self, table: QueueTable, limit: int, skip: Sequence[Any], claims: Claimer,
               caps: dict[str, int], spent: set[str]
               ) -> tuple[list[ClaimedRow], dict[int, str | None]]:
        """The rows chosen (see :func:`choose`) among the first ready ones of tasks not
        ``spent``, leased; with the task of each id chosen. A window of candidates that
        a task whose tokens ran out filled is read again past that task's rows (up to
        :data:`ROUNDS` windows), so the rows of other tasks behind them go on."""
        _, candidates = self.reads(table)

        def pick(conn: Connection) -> dict[int, str | None]:
            left, passed = dict(caps), set(spent)
            chosen: dict[int, str | None] = {}
            floor = self.dialect.claim_floor(conn, table.spec)
            for _ in range(ROUNDS):
                window = (limit - len(chosen)) * OVERSCAN
                found = conn.execute(candidates, {"limit": window, "floor": floor,
                                                  "spent": sorted(passed)}).all()
                choose(found, left, limit, set(skip), chosen)
                done = {task for task, count in left.items() if not count} - passed
                if len(chosen) == limit or len(found) < window or not done:
                    break
                passed |= done
            return chosen

        if isinstance(claims, Limiter):
            chosen = self.database.run(pick, read_only=True)
            return (claims.claim(table, limit, skip, ids=sorted(chosen)) if chosen
                    else []), chosen

        def lease(conn: Connection) -> tuple[list[ClaimedRow], dict[int, str | None]]:
            chosen = pick(conn)
            if not chosen:
                return [], chosen
            return self.dialect.claim(conn, table.spec, len(chosen),
                                      table.options.visibility_timeout,
                                      ids=sorted(chosen)), chosen

        rows, chosen = self.database.run(lease, durable=False, repeatable=True)
        self.keeper.hold(table, rows)
        return rows, chosen

    def reads(self, table: QueueTable) -> tuple[TextClause, TextClause]:
        """The task names' read and the candidates' of ``table``; a table whose rows hold
        no Celery envelope (no headers column, row mode, plain rows, a declared publish
        statement) is refused: it has no task name to read."""
        spec = table.spec
        reads = self.dialect.rated_reads(spec)
        if (reads.tasks is None or reads.candidates is None or spec.publish is not None
                or spec.plain or spec.rows is not None):
            raise ConfigurationError(
                f"queue {table.queue!r}: task_rate_limits need a queue table with a headers "
                "column storing Celery's messages (not row mode, plain rows or a declared "
                "publish statement)")
        return reads.tasks, reads.candidates
