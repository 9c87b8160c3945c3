"""What the dashboard's limits page reads: each queue's configured limits (concurrency
limits per key prefix, ``max_in_work``, ``rate_limit``, ``task_rate_limits``) and, for a
queue with concurrency limits, the rows in work per limit key now.

The rows in work per key are counted by one statement per queue (the dialects'
``keys_in_work``): a pass over the rows with a live lease, grouped by the key their
envelope names, the busiest keys first and at most ``keys`` of them. Beside
:mod:`.operations`, at the top of the layers.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial

from .limits import limit_of
from .operations import Operations, _rows
from .tables import Role

__all__ = ["KeyInWork", "QueueLimits", "queue_limits"]


@dataclass(frozen=True)
class KeyInWork:
    """A limit key's rows in work (``key`` None: rows sent without one) and its limit
    (None: no prefix of the queue's limits matches it)."""

    key: str | None
    in_work: int
    limit: int | None


@dataclass(frozen=True)
class QueueLimits:
    """One queue's limits as configured, and its keys in work (None: the queue has no
    concurrency limits, or no table yet); ``more``: keys beyond those listed are in
    work too."""

    queue: str
    concurrency_limits: tuple[tuple[str, int], ...]
    max_in_work: int | None
    rate_limit: str | None
    task_rate_limits: tuple[tuple[str, str], ...]
    keys: list[KeyInWork] | None = None
    more: bool = False

    @property
    def in_work(self) -> int:
        """The listed keys' rows in work (all the queue's unless ``more``)."""
        return sum(each.in_work for each in self.keys or ())


def queue_limits(ops: Operations, keys: int = 50) -> list[QueueLimits]:
    """The queues of ``ops`` that have a limit of any kind, by name, each with up to
    ``keys`` of its busiest limit keys where it has concurrency limits."""
    found = []
    for name, spec in ops.queues():
        options = ops.options.for_queue(name)
        shown = QueueLimits(
            name, options.concurrency_limits, options.max_in_work,
            None if options.rate_limit is None else options.rate_limit.text,
            tuple((task, rate.text) for task, rate in options.task_rate_limits))
        if not (shown.concurrency_limits or shown.max_in_work is not None
                or shown.rate_limit or shown.task_rate_limits):
            continue
        if ((shown.concurrency_limits or shown.max_in_work is not None)
                and spec.has(Role.HEADERS) and ops.broker.database.has_table(spec)):
            rows = ops.broker.run(partial(_rows, ops.dialect.keys_in_work(spec),
                                          {"limit": keys + 1}), read_only=True)
            listed = [KeyInWork(None if row.limit_key is None else str(row.limit_key),
                                int(row.in_work),
                                None if row.limit_key is None
                                else limit_of(options, str(row.limit_key)))
                      for row in rows]
            shown = replace(shown, keys=listed[:keys], more=len(listed) > keys)
        found.append(shown)
    return sorted(found, key=lambda each: each.queue)
