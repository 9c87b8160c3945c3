"""Work a finalizer hands over, to be run by a thread holding none of the transport's locks.

A finalizer (``weakref.finalize``) runs in whichever thread's allocation set off the
garbage collection that freed its object: perhaps a keeper thread holding the keeper's
lock, or one inside a write transaction. Work that takes a lock or runs a statement would
then wait on what its own thread holds, for ever. The finalizer only puts the work here
(``SimpleQueue.put`` is safe to call from a finalizer); the consumer's next turn of the
loop (a round that found nothing, Celery's ``consume_ready``), the keeper's extending
thread (at least every third of the shortest lease held) and a flush run it.
"""

from __future__ import annotations

from collections.abc import Callable
from queue import Empty, SimpleQueue


class HandOver:
    """Work handed over by finalizers, run by :meth:`run`."""

    def __init__(self) -> None:
        self._work: SimpleQueue[Callable[[], object]] = SimpleQueue()

    def put(self, work: Callable[[], object]) -> None:
        """Hand ``work`` over (from a finalizer, in any thread)."""
        self._work.put(work)

    def run(self) -> None:
        """Run what was handed over so far (call holding no lock of the transport's)."""
        while True:
            try:
                work = self._work.get_nowait()
            except Empty:  # all done (or taken by another thread running it)
                return
            work()
