"""How failed work is tried again: after a doubling back-off, and each part alone, so
that a part that keeps failing holds up no other."""

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
