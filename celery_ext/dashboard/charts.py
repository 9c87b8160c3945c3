"""The queues page's throughput charts: each queue's settled rows per minute over the last
hour (:mod:`kombu_sqlinbox.throughput`), drawn as inline SVG bars."""

from __future__ import annotations

from dataclasses import dataclass

from kombu_sqlinbox.operations import Operations
from kombu_sqlinbox.throughput import HOUR, last_hour

#: a bar's width and the chart's height, in pixels
BAR, HEIGHT = 3, 28


@dataclass(frozen=True)
class Bar:
    """One minute's bar: where it stands, and what it says on hover."""

    x: int
    y: int
    height: int
    settled: int
    ago: int


@dataclass(frozen=True)
class Chart:
    """A queue's last hour: its total, its busiest minute and a bar per minute."""

    queue: str
    total: int
    peak: int
    width: int
    height: int
    bars: list[Bar]


def chart(queue: str, counts: list[int]) -> Chart:
    """The chart of ``counts`` (per minute, oldest first), scaled to its busiest minute."""
    peak = max(counts, default=0)
    bars = []
    for index, settled in enumerate(counts):
        tall = 0 if not settled else max(1, round(HEIGHT * settled / peak))
        bars.append(Bar(index * BAR, HEIGHT - tall, tall, settled, len(counts) - 1 - index))
    return Chart(queue, sum(counts), peak, len(counts) * BAR, HEIGHT, bars)


def charts(ops: Operations, queues: list[str]) -> list[Chart]:
    """The chart of each of ``queues``, in their order (a queue that settled nothing in the
    last hour has a flat one)."""
    found = last_hour(ops.broker.database, ops.options.table_prefix)
    return [chart(queue, found.get(queue, [0] * HOUR)) for queue in queues]
