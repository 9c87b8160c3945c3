"""Scenarios plug in here: each fills named table columns for the brokers it applies to.

A later issue adds a measurement by writing one function and decorating it with
:func:`scenario`; ``run.py`` discovers it through :data:`SCENARIOS` and the
report shows any column that received a value.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .targets import Context, Target


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


def gist(message: str) -> str:
    """The line of an error message or traceback that says what went wrong."""
    lines = [line.strip() for line in message.strip().splitlines()]
    # SQLAlchemy appends the statement and a link; a traceback ends with the exception
    lines = [line for line in lines if line and not line.startswith(("(Background", "[SQL:",
                                                                     "[parameters:"))]
    exception = [line for line in lines if re.match(r"^[\w.]+(Error|Exception|Warning)\b", line)]
    return (exception or lines or [""])[-1]


def guarded(measure: Callable[[], Cell]) -> Cell:
    """One figure of a scenario that reports several: a failure spoils only its own cell."""
    try:
        return measure()
    except Exception as exc:
        return Cell.failed(exc)


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
