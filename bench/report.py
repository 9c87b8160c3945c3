"""Markdown tables of any section's rows, the targets table, and the JSON record."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from .registry import Row


def table(rows: list[Row], figures: dict[str, str], setup: str = "setup") -> str:
    """One Markdown table: a line per (database, setup) in the order the rows come, a column
    per figure that has a value (``figures``: figure -> heading, in column order)."""
    used = [key for key in figures if any(r["figure"] == key for r in rows)]
    texts = {(r["database"], r["setup"], r["figure"]): r["text"] for r in rows}
    lines = ["| database | " + " | ".join([setup, *(figures[key] for key in used)]) + " |",
             "|---|---|" + "---:|" * len(used)]
    for database, name in dict.fromkeys((r["database"], r["setup"]) for r in rows):
        cells = [texts.get((database, name, key), "-") for key in used]
        lines.append(f"| {database or '-'} | {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def grid(headings: Sequence[str], lines: Iterable[Sequence[object]], left: int = 1) -> str:
    """A Markdown table of ready-made cells: the first ``left`` columns aligned left, the
    others right (figures)."""
    made = ["| " + " | ".join(headings) + " |",
            "|" + "---|" * left + "---:|" * (len(headings) - left)]
    made += ["| " + " | ".join(str(cell) for cell in line) + " |" for line in lines]
    return "\n".join(made)


def targets_table(targets: list[Row]) -> str:
    lines = ["| section | database | figure | value | target | met |",
             "|---|---|---|---:|---:|---|"]
    for t in targets:
        value = "n/a" if t["value"] is None else f"{t['value']:.2f}"
        met = {True: "yes", False: "no", None: "-"}[t["met"]]
        lines.append(f"| {t['section']} | {t['database'] or '-'} | {t['target']} | {value} | "
                     f"{t['goal']} | {met} |")
    return "\n".join(lines)


def write_json(path: Path, args: argparse.Namespace, sections: dict[str, list[Row]],
               targets: list[Row]) -> None:
    record: dict[str, Any] = {"arguments": vars(args), "sections": sections,
                              "targets": targets}
    path.write_text(json.dumps(record, indent=2, default=str))
