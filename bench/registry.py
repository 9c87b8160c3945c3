"""What plugs into the benchmark: figures (:class:`Cell`), the core scenarios, and sections.

A section is one table of ``bench/run.py`` (core, ordering, transactional,
outbox): a module with ``run(args) -> list[Row]`` and a :data:`Section` record naming
its arguments, table and targets. Within the core section, a measurement is one
function decorated with :func:`scenario`; the table shows any column that got a value.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .targets import Context, Target

#: one figure of a section: section, database (None: a message server), setup, figure,
#: value (what ratios use), text (what the table shows), details
Row = dict[str, Any]
BEGAN = time.monotonic()


@dataclass
class Cell:
    """One measured figure: the number ratios use, the text the table shows, raw details."""

    value: float | None
    text: str
    details: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def rate(cls, count: int, seconds: float, **details: Any) -> Cell:
        value = count / seconds if seconds > 0 else None
        text = f"{value:,.0f}" if value is not None else "n/a"
        return cls(value, text, {"count": count, "seconds": round(seconds, 4), **details})

    @classmethod
    def failed(cls, exc: BaseException) -> Cell:
        reason = f"{type(exc).__name__}: {gist(str(exc))}"
        return cls(None, "failed: " + (reason[:70] + "…" if len(reason) > 70 else reason))

    def row(self, section: str, database: str | None, setup: str, figure: str) -> Row:
        return {"section": section, "database": database, "setup": setup, "figure": figure,
                "value": self.value, "text": self.text, "details": self.details}


def gist(message: str) -> str:
    """The line of an error message or traceback that says what went wrong."""
    lines = [line.strip() for line in message.strip().splitlines()]
    # SQLAlchemy appends the statement and a link; a traceback ends with the exception
    lines = [line for line in lines if line and not line.startswith(("(Background", "[SQL:",
                                                                     "[parameters:"))]
    # "ValueError: ...", or SQLAlchemy's "(psycopg2.OperationalError) ..."
    exception = [line for line in lines
                 if re.match(r"^\(?[\w.]+(Error|Exception|Warning)\b", line)]
    return (exception or lines or [""])[-1]


def spread(samples: list[float], *, digits: int = 1, top: float = 0.99,
           **details: Any) -> Cell:
    """The median and a high percentile (``top``, default p99) of ``samples``: value the
    median, text "p50 / p99"."""
    if not samples:
        raise RuntimeError("no samples")
    ordered = sorted(samples)
    p50 = statistics.median(ordered)
    high = ordered[min(len(ordered) - 1, round(top * (len(ordered) - 1)))]
    return Cell(p50, f"{p50:.{digits}f} / {high:.{digits}f}",
                {"p50": p50, f"p{round(top * 100)}": high, "samples": len(ordered), **details})


def guarded(measure: Callable[[], Cell]) -> Cell:
    """One figure of a scenario that reports several: a failure spoils only its own cell."""
    try:
        return measure()
    except Exception as exc:
        return Cell.failed(exc)


def progress(message: str) -> None:
    """A line on stderr while the run goes on, stamped with seconds since it began."""
    print(f"[{time.monotonic() - BEGAN:6.1f}s] {message}", file=sys.stderr, flush=True)


def alternate(modes: dict[str, Callable[[], float]], rounds: int,
              text: Callable[[float], str]) -> dict[str, Cell]:
    """Each mode once per round, modes alternating, so load from elsewhere on the machine
    spreads over all of them; a mode's figure is the median of its rounds. A mode that
    fails is reported failed and not run again."""
    found: dict[str, list[float]] = {mode: [] for mode in modes}
    failed: dict[str, Cell] = {}
    for _ in range(rounds):
        for mode, measure in modes.items():
            if mode not in failed:
                try:
                    found[mode].append(measure())
                except Exception as exc:
                    failed[mode] = Cell.failed(exc)
    cells = {}
    for mode, values in found.items():
        if mode in failed or not values:
            cells[mode] = failed.get(mode) or Cell(None, "n/a")
        else:
            median = statistics.median(values)
            cells[mode] = Cell(median, text(median), {"rounds": values})
    return cells


def ratio(top: Cell | None, bottom: Cell | None) -> float | None:
    if top is None or bottom is None or not top.value or not bottom.value:
        return None
    return top.value / bottom.value


def goal(section: str, database: str | None, what: str, value: float | None,
         limit: float | None, *, at_most: bool = False) -> Row:
    """A target row (``limit`` None: a figure reported beside the targets, none to reach)."""
    met = None
    if value is not None and limit is not None:
        met = value <= limit if at_most else value >= limit
    wanted = "-" if limit is None else f"{'≤' if at_most else '≥'} {limit:g}"
    return {"section": section, "database": database, "target": what, "value": value,
            "goal": wanted, "met": met}


# -- the core section's scenarios --------------------------------------------------------
Runner = Callable[["Target", "Context"], dict[str, Cell]]


@dataclass(frozen=True)
class Scenario:
    name: str
    columns: dict[str, str]  # key -> table heading
    brokers: frozenset[str]
    run: Runner
    rank: int  # where its columns go in the table, left to right


SCENARIOS: dict[str, Scenario] = {}


def scenario(name: str, columns: dict[str, str], brokers: set[str],
             rank: int) -> Callable[[Runner], Runner]:
    """Register ``run(target, context) -> {column: Cell}`` for the given broker kinds."""

    def register(run: Runner) -> Runner:
        SCENARIOS[name] = Scenario(name, columns, frozenset(brokers), run, rank)
        return run

    return register


def columns() -> dict[str, str]:
    """Column key -> heading, in table order (a column two scenarios fill appears once)."""
    found: dict[str, str] = {}
    for entry in sorted(SCENARIOS.values(), key=lambda s: s.rank):
        for key, heading in entry.columns.items():
            found.setdefault(key, heading)
    return found


# -- sections -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Section:
    """One table of the benchmark and what it takes to fill it."""

    name: str
    title: str
    #: the section's own command-line options (shared ones live in ``bench/cli.py``)
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], list[Row]]
    #: the Markdown table (and its notes) of the rows ``run`` returned
    markdown: Callable[[list[Row], argparse.Namespace], str]
    #: the section's targets, computed from the rows (see :func:`goal`)
    targets: Callable[[list[Row]], list[Row]]
