"""Markdown tables of any section's rows, the targets table, and the JSON record (the
format of ``bench/results``: its README.rst)."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
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


def write_json(path: Path, args: argparse.Namespace, printed: dict[str, str],
               sections: dict[str, list[Row]], targets: list[Row]) -> Path:
    """The run's record: what ``bench/results`` keeps of a round (date, command, machine,
    each section's tables as printed) and every figure with its raw details. A directory
    ``path`` gets a file named ``<date>-<sections>.json`` in it."""
    date = datetime.date.today().isoformat()
    if path.is_dir():
        path = path / f"{date}-{'+'.join(printed)}.json"
    tables, notes = [], []
    for title, text in printed.items():
        found, said = parse_markdown(text)
        tables += [{"title": title, **made} for made in found]
        notes += [f"{title}: {said}"] if said else []
    record: dict[str, Any] = {
        "date": date, "round": "", "section": ",".join(printed),
        "command": " ".join(["python", "bench/run.py", *sys.argv[1:]]), "machine": machine(),
        "notes": "\n\n".join(notes), "tables": tables,
        "arguments": vars(args), "figures": sections, "targets": targets}
    path.write_text(json.dumps(record, indent=1, ensure_ascii=False, default=str) + "\n")
    return path


def parse_markdown(text: str) -> tuple[list[dict[str, Any]], str]:
    """The Markdown tables of a section's printout as columns and rows, and its other
    lines."""
    tables: list[dict[str, Any]] = []
    rest: list[str] = []
    lines: list[list[str]] = []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            lines.append([cell.strip() for cell in line.strip().strip("|").split("|")])
            continue
        if lines:
            tables.append({"columns": lines[0], "rows": lines[2:]})
            lines = []
        if line.strip():
            rest.append(line.strip())
    return tables, " ".join(rest)


def proc_field(file: str, name: str) -> str:
    """A ``name: value`` line's value in a /proc file; "?" where there is none (not Linux,
    or a file the kernel does not offer)."""
    try:
        with open(file) as lines:
            return next((line.split(":", 1)[1].strip() for line in lines
                         if line.startswith(name)), "?")
    except OSError:
        return "?"


def machine() -> str:
    """What the figures depend on: CPUs, memory, the load at the end of the run, Python."""
    memory = proc_field("/proc/meminfo", "MemTotal").split()[0]
    gib = f"{int(memory) / 2**20:.0f} GiB" if memory.isdigit() else "? GiB"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (f"{os.cpu_count()} CPUs {proc_field('/proc/cpuinfo', 'model name')}, {gib}; load "
            f"average {load:.1f} at the end; Python {platform.python_version()}")
