"""Consumer processes a measurement spawns, and the one channel they report through.

Children are started with ``spawn`` so none inherits the parent's pooled
connections or its lease-keeper thread.
"""

from __future__ import annotations

import multiprocessing
import queue as stdlib_queue
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kombu_sqlinbox.dialects.base import Dialect

from .registry import gist

SPAWN = multiprocessing.get_context("spawn")


def timed_claims() -> list[tuple[float, float]]:
    """From now on in this process, every claim statement's end (``time.time()``) and
    seconds go to the list returned (the caller empties it as it reads): the dialect's
    claim, and its claim that completes the rows acked before it in the same statement
    (the transport folds acks into the next claim where the dialect has that form). The
    timing wraps the dialect's methods here, in the bench: the transport carries no
    instrumentation."""
    timings: list[tuple[float, float]] = []

    def timed(method: Callable[..., Any]) -> Callable[..., Any]:
        def run(self: Dialect, *args: Any, **kwargs: Any) -> Any:
            began = time.perf_counter()
            try:
                return method(self, *args, **kwargs)
            finally:
                timings.append((time.time(), time.perf_counter() - began))

        return run

    Dialect.claim = timed(Dialect.claim)  # type: ignore[method-assign]
    Dialect.complete_and_claim = timed(  # type: ignore[method-assign]
        Dialect.complete_and_claim)
    return timings


@dataclass
class Link:
    """A child's side: its index, the report queue, the common start signal and counter."""

    index: int
    reports: Any
    start: Any
    counter: Any

    def report(self, kind: str, value: Any = None) -> None:
        self.reports.put((kind, self.index, value))

    def ready(self, cap: float) -> None:
        """Say so, then wait (at most ``cap`` s) until the parent starts every child at once."""
        self.report("ready")
        self.start.wait(cap)

    def add(self, count: int = 1) -> None:
        with self.counter.get_lock():
            self.counter.value += count


def _main(entry: Callable[..., None], link: Link, args: tuple[Any, ...]) -> None:
    """Runs in the child: a failure reaches the parent as an ``error`` report."""
    try:
        entry(link, *args)
    except Exception:
        link.report("error", traceback.format_exc(limit=4))


class Children:
    """``count`` spawned processes running ``entry(link, *args)``; reaped on exit.

    ``entry`` must be a module-level function (it is pickled by name).
    """

    def __init__(self, count: int, entry: Callable[..., None], *args: Any) -> None:
        self.reports: Any = SPAWN.Queue()
        self.start = SPAWN.Event()
        self.counter = SPAWN.Value("i", 0)
        self.entry, self.args = entry, args
        self.processes = [self._process(i) for i in range(count)]

    def _process(self, index: int) -> Any:
        return SPAWN.Process(target=_main, args=(
            self.entry, Link(index, self.reports, self.start, self.counter), self.args))

    def replace(self, index: int) -> None:
        """``kill -9`` of child ``index``, as a crash would end it, and a new one in its
        place (with the same index)."""
        old = self.processes[index]
        old.kill()
        old.join(10)
        self.processes[index] = self._process(index)
        self.processes[index].start()

    def __enter__(self) -> Children:
        for process in self.processes:
            process.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.start.set()  # a child still waiting for the start signal goes on, and ends
        for process in self.processes:
            process.join(10)
            if process.is_alive():
                process.terminate()
                process.join(5)

    def next(self, deadline: float) -> tuple[str, int, Any]:
        """The next report; a child's error or the deadline raises."""
        try:
            kind, index, value = self.reports.get(timeout=max(0.01, deadline - time.monotonic()))
        except stdlib_queue.Empty:
            raise TimeoutError("consumer processes did not report in time") from None
        if kind == "error":
            raise RuntimeError(f"consumer {index} failed: {gist(value)}")
        return kind, index, value

    def wait_ready(self, deadline: float) -> None:
        """Every child has said ``ready``."""
        for _ in self.processes:
            kind, index, _ = self.next(deadline)
            if kind != "ready":
                raise RuntimeError(f"consumer {index} reported {kind!r} before it was ready")

    def any_exited(self) -> bool:
        return any(not process.is_alive() for process in self.processes)
