"""``celery sqlinbox schedules``: adding, listing, pausing, resuming and removing schedules
as a user does (under ``celery -A`` and standalone, in the test's process:
:mod:`tests.ops.runner`); and the schedule tables printed by ``ddl`` and planned by
``check`` on every database."""

from __future__ import annotations

import json

import pytest
from sqlalchemy import text
from sqlalchemy.engine import Engine

from tests.integration.support import quoted
from tests.ops.conftest import Cli
from tests.ops.runner import invoke

from .test_schema import statements

#: the commands' own behaviour is the same on every database (the statements under them
#: run on each in tests/integration/test_beat.py and in the check below)
ONE_DATABASE = pytest.mark.parametrize("database", ["sqlite"], indirect=True)


@ONE_DATABASE
def test_schedules_are_added_listed_paused_resumed_and_removed(cli: Cli) -> None:
    added = cli("schedules", "add", "ping", "ops.add", "every:30", "--args", "[1, 2]",
                "--misfire", "catch_up").stdout
    assert added.splitlines()[1].split()[:5] == ["ping", "ops.add", "every:30", "enabled",
                                                 "catch_up"], added
    again = cli("schedules", "add", "ping", "ops.add", "every:5", check=False)
    assert again.returncode == 2 and "a schedule 'ping' exists: pass --replace" in again.stderr
    cli("schedules", "add", "report", "ops.add", "crontab:0 3", "--paused", "--queue", "jobs")
    (ping, report) = json.loads(cli("schedules", "list", "--json", standalone=True).stdout)
    assert (ping["name"], ping["args"], ping["enabled"], ping["total_run_count"]) == (
        "ping", [1, 2], True, 0)
    assert (report["schedule"], report["enabled"], report["options"]) == (
        "crontab:0 3 * * *", False, {"queue": "jobs"})
    assert cli("schedules", "pause", "ping").stdout.strip() == "ping: paused"
    assert cli("schedules", "resume", "report").stdout.strip() == "report: resumed"
    listed = cli("schedules", "list").stdout.splitlines()
    assert "paused" in listed[1].split() and "enabled" in listed[2].split(), listed
    assert cli("schedules", "remove", "ping").stdout.strip() == "ping: removed"
    gone = cli("schedules", "remove", "ping", check=False)
    assert gone.returncode == 1 and "no schedule 'ping'" in gone.stderr


@ONE_DATABASE
def test_a_bad_schedule_or_argument_is_a_usage_error(cli: Cli) -> None:
    for name, args, said in (
            ("bad", ["hourly"], "give every:SECONDS"),
            ("bad", ["every:5", "--kwargs", "[1]"], "a JSON dict is needed"),
            ("bad", ["every:inf"], "'every:inf': cannot convert float infinity"),
            ("bad", ["crontab:-5"], "'crontab:-5': negative numbers not supported"),
            ("bad", ["crontab:0 3 * * * *"], "a crontab has at most 5 fields"),
            ("bad", ["every:5", "--grace", "inf"], "0 seconds or more (and finite), not inf"),
            ("x" * 300, ["every:5"], "a schedule's name is 1 to 255 characters")):
        done = cli("schedules", "add", name, "ops.add", *args, check=False)
        assert done.returncode == 2 and said in done.stderr, (args, done.stderr)
    nowhere = invoke(["sqlinbox", "schedules", "list"])
    assert nowhere.returncode == 2 and "pass --url URL, or -A proj" in nowhere.stderr
    down = cli("schedules", "list", url="postgresql://app:secret@127.0.0.1:1/app",
               standalone=True, check=False)
    assert down.returncode == 1, down.stderr
    (line,) = down.stderr.strip().splitlines()
    assert line.startswith("Error: the database postgresql://app:***@127.0.0.1:1/app failed:")


def test_ddl_prints_the_schedule_tables_and_check_plans_their_statements(
        cli: Cli, engine: Engine, table_prefix: str) -> None:
    printed = cli("ddl").stdout
    assert "-- schedule tables (celery beat -S celery_ext.beat:DatabaseScheduler)" in printed
    with engine.begin() as conn:
        for statement in statements(printed):
            conn.execute(text(statement.rstrip(";")))
    passed = cli("check")
    assert passed.stdout.strip().endswith("0 problem(s)"), passed.stdout
    ticks = quoted(engine, f"{table_prefix}schedule_ticks")
    with engine.begin() as conn:
        conn.execute(text(f"DROP TABLE {ticks}"))
        conn.execute(text(f"CREATE TABLE {ticks} (name VARCHAR(100))"))
    failed = cli("check", check=False)
    assert failed.returncode == 1, failed.stdout
    (problem,) = [line for line in failed.stdout.splitlines() if line.startswith("PROBLEM")]
    assert problem.startswith(
        f"PROBLEM (schedules) ({table_prefix}schedule_ticks): the statement "), problem
