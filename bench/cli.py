"""The command line every entry point shares: ``bench/run.py`` with all sections, and each
section module run alone (``python bench/ordering.py``) with its own."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

from .registry import Cell, Row, Section, progress
from .report import targets_table, write_json
from .targets import DATABASES


def choices(allowed: Sequence[str]) -> Callable[[str], list[str]]:
    """An argparse type: a comma-separated list of names out of ``allowed``."""

    def parse(value: str) -> list[str]:
        chosen = [v.strip() for v in value.split(",") if v.strip()]
        unknown = [v for v in chosen if v not in allowed]
        if unknown:
            raise argparse.ArgumentTypeError(
                f"unknown {', '.join(unknown)}; choose from {', '.join(allowed)}")
        return chosen

    return parse


def parser(sections: list[Section], description: str) -> argparse.ArgumentParser:
    names = [s.name for s in sections]
    made = argparse.ArgumentParser(description=description)
    made.add_argument("--quick", nargs="?", const=names, default=[], type=choices(names),
                      metavar="SECTIONS",
                      help="smaller sizes: for every section, or for those listed")
    made.add_argument("--databases", default=list(DATABASES), type=choices(DATABASES),
                      help=f"comma-separated (default all: {','.join(DATABASES)})")
    if len(sections) > 1:
        made.add_argument("--sections", default=names, type=choices(names),
                          help=f"sections to run (default all: {','.join(names)})")
    made.add_argument("--json", type=Path,
                      help="also write the tables and every figure as JSON to this file, "
                           "or to a dated file in this directory (bench/results/)")
    made.add_argument("--pg-driver", default="psycopg2", choices=("psycopg2", "psycopg"),
                      help="PostgreSQL driver of the sqlinbox and sqla brokers (the raw "
                           "driver loop is psycopg2's either way)")
    for section in sections:
        section.add_arguments(made)
    return made


def main(sections: list[Section], argv: list[str], description: str) -> int:
    """Run the chosen sections one after another; print a Markdown table per section and the
    targets of all. Exit status 1 if a section failed as a whole."""
    args = parser(sections, description).parse_args(argv)
    chosen = [s for s in sections if s.name in getattr(args, "sections", [s.name])]
    began = time.monotonic()
    found: dict[str, list[Row]] = {}
    failed: dict[str, Cell] = {}
    own = {s.name: argparse.Namespace(**{**vars(args), "quick": s.name in args.quick})
           for s in chosen}
    for section in chosen:
        progress(f"section {section.name}{' (quick)' if own[section.name].quick else ''}")
        try:
            found[section.name] = section.run(own[section.name])
        except Exception as exc:  # the other sections still run
            failed[section.name] = Cell.failed(exc)
            found[section.name] = [failed[section.name].row(section.name, None, "all", "")]
    quick = [s.name for s in chosen if own[s.name].quick]
    print(f"\n{len(chosen)} section(s) in {time.monotonic() - began:.0f} s"
          f"{'; quick: ' + ', '.join(quick) if quick else ''}. Other work on this "
          "machine makes the figures noisy.\n")
    targets: list[Row] = []
    printed: dict[str, str] = {}
    for section in chosen:
        if section.name in failed:
            printed[section.name] = failed[section.name].text
        else:
            printed[section.name] = section.markdown(found[section.name], own[section.name])
            targets += section.targets(found[section.name])
        print(f"## {section.title}\n\n{printed[section.name]}\n")
    if targets:
        print(f"## Targets\n\n{targets_table(targets)}\n")
    if args.json:
        progress(f"wrote {write_json(args.json, args, printed, found, targets)}")
    return 1 if failed else 0


def command(main: Callable[[list[str]], int], interrupted: str) -> NoReturn:
    """Run a script's ``main(argv)``: its result is the exit status; Ctrl-C (or a SIGTERM
    the script turned into one) prints ``interrupted`` and exits 130."""
    try:
        sys.exit(main(sys.argv[1:]))
    except KeyboardInterrupt:
        print(f"interrupted: {interrupted}", file=sys.stderr)
        sys.exit(130)


def run_alone(section: Section) -> None:
    """``python bench/<section>.py``: this section only."""
    sys.exit(main([section], sys.argv[1:], section.title))
