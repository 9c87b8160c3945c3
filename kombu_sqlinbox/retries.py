"""How failed work is tried again: after a doubling back-off, and each part alone, so
that a part that keeps failing holds up no other; and how often idle work looks again
(:class:`Cadence`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

#: the first and the longest wait before a failed settlement group or extension is retried
BACKOFF_FIRST = 0.2
BACKOFF_MAX = 5.0


def next_backoff(backoff: float) -> float:
    """The wait after one more failure: doubling, from the first to the longest."""
    return min(max(backoff * 2, BACKOFF_FIRST), BACKOFF_MAX)


class Cadence:
    """How long an idle consumer waits before it claims again, where no wake-up comes
    first: ``polling_interval_min`` after a delivery, ``polling_backoff`` times longer
    after each empty round, up to the transport's ``polling_interval``. Work tends to
    come in bursts, so a consumer that just had some looks again soon; one idle for a
    while costs one round of claims per ``polling_interval``."""

    def __init__(self, low: float, factor: float) -> None:
        self.low, self.factor = low, factor
        self._next = low

    def active(self) -> None:
        self._next = self.low

    def idle(self, ceiling: float) -> float:
        """The next wait (seconds), never above ``ceiling``; the one after grows."""
        wait = min(self._next, ceiling)
        self._next = min(self._next * self.factor, ceiling)
        return wait


@dataclass
class Failing:
    """A settlement group whose statement failed: when it is tried next."""

    failures: int = 0
    backoff: float = 0.0
    retry_at: float = 0.0


K = TypeVar("K")
V = TypeVar("V")


def isolated(parts: dict[K, V], run: Callable[[dict[K, V]], object],
             failed: Callable[[K, V, Exception], None],
             done: Callable[[K, V], None]) -> list[K]:
    """Run every part in one go; if that fails, each part alone, so that a part that keeps
    failing holds up no other. Returns the parts that failed."""
    try:
        run(parts)
    except Exception as exc:
        if len(parts) == 1:
            ((key, value),) = parts.items()
            failed(key, value, exc)
            return [key]
        broken = []
        for key, value in parts.items():
            try:
                run({key: value})
            except Exception as alone:
                broken.append(key)
                failed(key, value, alone)
            else:
                done(key, value)
        return broken
    for key, value in parts.items():
        done(key, value)
    return []
