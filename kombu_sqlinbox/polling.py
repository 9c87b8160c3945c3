"""When an idle consumer claims again, where no wake-up comes first."""

from __future__ import annotations


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
