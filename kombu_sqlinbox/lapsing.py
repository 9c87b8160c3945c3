"""Values this process keeps for a while each, then reads or writes again: what it read of
the shared tables (bindings, message TTLs) and what it wrote of them lately
(:mod:`.written`). Each entry lapses by this process's monotonic clock, so a host clock
stepped back or forth neither keeps one for ever nor drops it early."""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class Lapsing(Generic[K, V]):
    """A value per key, each kept for the seconds it was kept with (not thread-safe beyond
    a dict's own: a race reads or writes once more, which the callers allow)."""

    def __init__(self, clock: Callable[[], float] | None = None) -> None:
        #: this module's monotonic clock, looked up at each reading (a test may stand it)
        self._clock = clock or (lambda: time.monotonic())
        self._kept: dict[K, tuple[float, V]] = {}

    def keep(self, key: K, value: V, seconds: float) -> None:
        """Keep ``value`` for ``key`` for ``seconds`` from now."""
        self._kept[key] = (self._clock() + seconds, value)

    def fresh(self, key: K) -> bool:
        """Whether ``key`` holds a value that has not lapsed."""
        kept = self._kept.get(key)
        return kept is not None and kept[0] > self._clock()

    def read(self, key: K, seconds: float, load: Callable[[], V]) -> V:
        """The value of ``key`` while fresh, else ``load()`` kept for ``seconds``."""
        kept = self._kept.get(key)
        if kept is None or kept[0] <= self._clock():
            value = load()
            self.keep(key, value, seconds)
            return value
        return kept[1]

    def forget(self, key: K) -> None:
        self._kept.pop(key, None)

    def forget_where(self, which: Callable[[K], bool]) -> None:
        """Forget every key ``which`` accepts."""
        for key in [key for key in list(self._kept) if which(key)]:
            del self._kept[key]
