"""A ledger of task runs kept outside the broker: how many ran at once, per key."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable


def most_at_once(runs: Iterable[tuple[str, float, float]]) -> dict[str, int]:
    """The most runs of each key in work at the same moment, from ``(key, start, end)``
    (one clock: ``time.monotonic`` is the host's); a run ending when another starts does
    not overlap it."""
    events: dict[str, list[tuple[float, int]]] = defaultdict(list)
    for key, start, end in runs:
        events[key] += [(start, 1), (end, -1)]
    most: dict[str, int] = {}
    for key, marks in events.items():
        now = top = 0
        for _, step in sorted(marks):  # an end (-1) sorts before a start at one moment
            now += step
            top = max(top, now)
        most[key] = top
    return most
