"""The declarations and bindings this process wrote lately: kombu declares a queue and
binds it again for each use (``app.control.ping`` twice a call), and each would be a
write, waiting for the disk where the database cannot relax it."""

from __future__ import annotations

from collections.abc import Callable

from .database import Database
from .lapsing import Lapsing

#: a queue's declaration: (queue,); a binding: (exchange, kind, queue, routing key, pattern)
Key = tuple[str, ...]


class Written:
    """What this process wrote in transactions of its own, and until when it needs no
    writing again: no sweep deletes a queue before it expires, and another process's
    delete or unbind is seen as late as its bindings are (``lately`` seconds). Kept as
    the bindings read are (:class:`~.lapsing.Lapsing`); what is its own is that nothing
    written in a caller's transaction counts, which may yet roll back."""

    def __init__(self, database: Database, lately: float) -> None:
        self.database = database
        self.lately = lately
        self._kept: Lapsing[Key, None] = Lapsing()

    def holds(self, key: Key) -> bool:
        """Whether ``key`` was written lately (never inside a caller's transaction, which
        may yet roll back)."""
        return self.database.bound_caller() is None and self._kept.fresh(key)

    def wrote(self, key: Key, expires: float | None, renewal: Callable[[float], float]) -> None:
        """``key`` was written now, for a queue expiring after ``expires`` seconds (renewed
        every ``renewal(expires)`` while consumed)."""
        if self.database.bound_caller() is None:
            lately = self.lately if expires is None else min(self.lately, renewal(expires))
            self._kept.keep(key, None, lately)

    def drop(self, queue: str | None = None, exchange: str | None = None,
             routing_key: str | None = None) -> None:
        """Forget what was written of ``queue`` (its declaration and bindings), of
        ``exchange`` (its bindings), or of both with ``routing_key`` (one binding)."""
        def of(key: Key) -> bool:
            declaration = len(key) == 1
            return ((queue is None or (key[0] if declaration else key[2]) == queue)
                    and (exchange is None or (not declaration and key[0] == exchange))
                    and (routing_key is None or (not declaration and key[3] == routing_key)))

        self._kept.forget_where(of)
