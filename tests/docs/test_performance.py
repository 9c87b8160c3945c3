"""The performance guide's commands are ones ``bench/run.py`` takes, and ``bench/results``
holds what its README says: every kept round loads, with the documented fields, and
``bench/run.py --json`` writes a run in that format."""

from __future__ import annotations

import argparse
import datetime
import json
import re
import shlex
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.processes import ROOT

from .support import DOCS

RESULTS = ROOT / "bench" / "results"
GUIDE = DOCS / "performance.rst"
#: the fields every results file has (bench/results/README.rst)
FIELDS = {"date": str, "round": str, "section": str, "machine": str, "notes": str,
          "tables": list}
#: the guide's sections that each give the command of their table
MEASURED = ("Publish", "Consume", "Latency", "Celery end to end", "FIFO groups",
            "Consumer processes on one server", "Long transactions elsewhere in the database",
            "Remote control", "Many publishers")


def guide_commands() -> list[tuple[str, list[str]]]:
    """Each ``python bench/...`` command of the guide, a code block's line or an inline
    literal, with the section it is in, as argv from the script on (comments dropped)."""
    found, section, lines = [], "", GUIDE.read_text().splitlines()
    for line, under in zip(lines, [*lines[1:], ""], strict=True):
        if under and set(under) == {"-"} and len(under) >= len(line) > 0:
            section = line
        command = re.match(r"^\s+(?:\.venv/bin/)?python3? (bench/\w+\.py.*)$", line)
        if command:
            found.append((section, shlex.split(command[1].split("#")[0])))
        found += [(section, shlex.split(inline))
                  for inline in re.findall(r"``python (bench/\w+\.py[^`]*)``", line)]
    return found


def parse(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> argparse.Namespace:
    """Parse ``bench/<script>.py <flags>`` as the script would, without running anything."""
    monkeypatch.setattr(sys, "path", list(sys.path))  # bench/run.py sets sys.path[0]
    from bench import run
    from bench.cli import parser

    script, *flags = argv
    name = Path(script).stem
    sections = run.SECTIONS if name == "run" else [
        s for s in run.SECTIONS if s.name == name]
    assert sections, f"{script} is neither bench/run.py nor one of its sections"
    return parser(sections, "").parse_args(flags)


def test_every_command_of_the_performance_guide_parses(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    commands = guide_commands()
    sections = {section for section, _ in commands}
    assert set(MEASURED) <= sections, f"a section without its command: {sections}"
    for _, argv in commands:
        if "--help" in argv:
            with pytest.raises(SystemExit) as shown:
                parse(argv, monkeypatch)
            assert shown.value.code == 0 and "usage:" in capsys.readouterr().out, argv
            continue
        try:
            parse(argv, monkeypatch)
        except SystemExit:
            pytest.fail(f"{shlex.join(argv)}: {capsys.readouterr().err}")


def check_record(path: Path) -> dict[str, Any]:
    """A results file as the README describes it; returns it."""
    record = json.loads(path.read_text())
    for field, kind in FIELDS.items():
        assert isinstance(record.get(field), kind), (path.name, field)
    assert record["command"] is None or isinstance(record["command"], str), path.name
    assert record["machine"] and record["section"], path.name
    assert path.name.startswith(datetime.date.fromisoformat(record["date"]).isoformat())
    assert record["tables"], f"{path.name} keeps no table"
    for table in record["tables"]:
        assert isinstance(table["title"], str), path.name
        assert table["columns"] and all(isinstance(c, str) for c in table["columns"])
        assert table["rows"], (path.name, table["title"])
        for row in table["rows"]:
            assert len(row) == len(table["columns"]) and all(
                isinstance(cell, str) for cell in row), (path.name, table["title"], row)
    for mark in re.findall(r"\[table (\d+)\]", record["notes"]):
        assert 1 <= int(mark) <= len(record["tables"]), (path.name, mark)
    for rows in record.get("figures", {}).values():
        for row in rows:
            assert {"database", "setup", "figure", "value", "text", "details"} <= set(row)
    return record


def test_every_results_file_loads_with_the_documented_fields() -> None:
    readme = (RESULTS / "README.rst").read_text()
    for field in (*FIELDS, "command", "arguments", "figures", "targets"):
        assert f"``{field}``" in readme, field
    files = sorted(RESULTS.glob("*.json"))
    assert len(files) >= 20
    for path in files:
        check_record(path)
    # the guide's history points here, and each file it names exists
    named = set(re.findall(r"bench/results/([\w.+-]+\.json)", GUIDE.read_text()))
    assert named and all((RESULTS / name).is_file() for name in named), named


def test_run_writes_its_json_in_the_results_format(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """``--json DIRECTORY`` writes ``<date>-<sections>.json`` there: the printed tables as
    columns and rows, the command, the machine, and every figure."""
    from bench.registry import Cell
    from bench.report import write_json

    monkeypatch.setattr(sys, "argv", ["bench/run.py", "--sections", "remote"])
    args = parse(["bench/run.py", "--sections", "remote", "--json", str(tmp_path)],
                 monkeypatch)
    row = Cell(4.2, "4.2 / 5.2").row("remote", None, "redis", "ping")
    printed = {"remote": "| database | broker | ping |\n|---|---|---:|\n| - | redis | 4.2 |"
                         "\n\nTwo workers on one queue."}
    written = write_json(tmp_path, args, printed, {"remote": [row]}, [])
    assert written.name == f"{datetime.date.today().isoformat()}-remote.json"
    record = check_record(written)
    assert record["tables"] == [{"title": "remote", "columns": ["database", "broker", "ping"],
                                 "rows": [["-", "redis", "4.2"]]}]
    assert record["command"] == "python bench/run.py --sections remote"
    assert record["notes"] == "remote: Two workers on one queue."
    assert record["figures"]["remote"][0]["value"] == 4.2


def test_a_machine_without_the_proc_files_is_described_all_the_same(tmp_path: Path) -> None:
    """Figures kept from a machine without /proc (not Linux) say "?" for what it lacks."""
    from bench.report import proc_field

    assert proc_field(str(tmp_path / "meminfo"), "MemTotal") == "?"  # no such file
    assert proc_field(str(tmp_path), "MemTotal") == "?"  # a directory: unreadable
    (tmp_path / "cpuinfo").write_text("vendor_id\t: x\nmodel name\t: Some CPU\n")
    assert proc_field(str(tmp_path / "cpuinfo"), "model name") == "Some CPU"
