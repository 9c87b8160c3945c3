"""Each ``celery sqlinbox`` command run as a user runs it (under ``celery -A`` or as the
standalone ``sqlinbox`` script, in the test's process: :mod:`tests.ops.runner`), on
every database, against real rows in every state; the figures are checked against the
rows."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import pytest
from sqlalchemy import inspect, text
from sqlalchemy.engine import Engine

from kombu_sqlinbox.codec import DEATH_HEADER
from tests.integration.support import quoted, rows
from tests.ops.conftest import CLI_LIMIT, Cli, Seeded
from tests.ops.runner import invoke
from tests.processes import ROOT, wait_until

FIGURES = ("ready", "delayed", "in_work", "blocked", "blocked_groups", "lapsed")


def figures(cli: Cli, *args: str, standalone: bool = False) -> dict[str, dict[str, object]]:
    found = json.loads(cli("queues", "--json", *args, standalone=standalone).stdout)
    return {entry["queue"]: entry for entry in found}


def row_count(engine: Engine, table: str) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text(f"SELECT COUNT(*) FROM {quoted(engine, table)}")).scalar_one())


def test_queues_counts_every_state(cli: Cli, seeded: Seeded, engine: Engine) -> None:
    by_queue = figures(cli)
    for queue, expected in seeded.expected.items():
        found = by_queue[queue]
        assert {figure: found[figure] for figure in FIGURES} == expected, queue
        # every row is in exactly one state
        assert row_count(engine, str(found["table"])) == sum(
            expected[state] for state in ("ready", "delayed", "in_work", "blocked"))
    for queue in ("jobs", "fifo"):
        assert (by_queue[queue]["dead_letter_queue"], by_queue[queue]["dead_letters"]) == (
            "jobs.dead", 4)
        # claimed during this test, extended or not since: younger than the lease
        assert 0 <= float(by_queue[queue]["oldest_lease_age"]) < 30  # type: ignore[arg-type]
    assert by_queue["jobs.dead"]["dead_letters"] is None
    assert by_queue["jobs.dead"]["oldest_lease_age"] is None
    assert 0 <= float(by_queue["jobs"]["oldest_ready_age"]) < 120  # type: ignore[arg-type]


def test_queues_as_prometheus_and_watched(cli: Cli, seeded: Seeded,
                                          table_prefix: str) -> None:
    exposition = cli("queues", "--format", "prometheus", standalone=True).stdout
    samples = dict(line.rsplit(" ", 1) for line in exposition.splitlines()
                   if not line.startswith("#"))
    jobs = f'queue="jobs",table="{table_prefix}jobs"'
    assert samples[f"sqlinbox_queue_ready{{{jobs}}}"] == "4"
    assert samples[f"sqlinbox_queue_delayed{{{jobs}}}"] == "2"
    assert samples[f"sqlinbox_queue_in_work{{{jobs}}}"] == "2"
    assert samples[f"sqlinbox_queue_lapsed{{{jobs}}}"] == "1"
    assert samples[f'sqlinbox_queue_dead_letters{{{jobs},dead_letter_queue="jobs.dead"}}'] == "4"
    fifo = f'queue="fifo",table="{table_prefix}fifo_jobs"'
    assert samples[f"sqlinbox_queue_blocked{{{fifo}}}"] == "2"
    assert samples[f"sqlinbox_queue_blocked_groups{{{fifo}}}"] == "1"
    assert float(samples[f"sqlinbox_queue_oldest_lease_age_seconds{{{fifo}}}"]) < 30
    assert "# TYPE sqlinbox_queue_oldest_ready_age_seconds gauge" in exposition
    watched = cli("queues", "--watch", "0.1", "--times", "2").stdout
    assert len(re.findall(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC$", watched, re.M)) == 2
    assert len(re.findall(r"^jobs +4 +2 +2 ", watched, re.M)) == 2, watched


@pytest.mark.drivers
def test_dead_letters_listed_shown_requeued_purged(cli: Cli, seeded: Seeded, engine: Engine,
                                                   table_prefix: str) -> None:
    listed = json.loads(cli("dead", "list", "--json").stdout)
    assert [dead["task"] for dead in listed] == seeded.dead_tasks
    assert {(dead["queue"], dead["attempts"]) for dead in listed} == {("jobs", 1)}
    assert all("rejected" in dead["reason"] for dead in listed)

    def chosen(*filters: str) -> list[str]:
        found = json.loads(cli("dead", "list", "--json", *filters, standalone=True).stdout)
        return [dead["task_id"] for dead in found]

    ids = [dead["task_id"] for dead in listed]
    assert chosen("--task", "ops.fail") == [ids[1]]
    assert chosen("--task", "ops.a*", "--reason", "REJECTED") == [ids[0], ids[2], ids[3]]
    assert chosen("--queue", "fifo") == []
    assert chosen("--older-than", "3600") == []
    assert chosen("--newer-than", "3600") == ids

    shown = cli("dead", "show", str(listed[0]["id"])).stdout
    assert "args=[1, 2] kwargs={}" in shown
    assert '"reason": "rejected without requeue by the consumer"' in shown
    assert DEATH_HEADER in shown
    bad = cli("dead", "show", str(listed[3]["id"])).stdout
    assert "not decoded (the body is not JSON" in bad

    jobs = f"{table_prefix}jobs"
    jobs_before = {row["id"] for row in rows(engine, jobs)}
    moved = cli("dead", "requeue", "--task", "ops.a*", "--keep-attempts", "--batch", "1",
                standalone=True)
    assert moved.stdout.strip() == "requeued: 3"
    back = [row for row in rows(engine, jobs) if row["id"] not in jobs_before]
    envelopes = [json.loads(row["headers"]) for row in back]
    assert [envelope["headers"]["id"] for envelope in envelopes] == [ids[0], ids[2], ids[3]]
    assert all(DEATH_HEADER not in envelope["headers"] for envelope in envelopes)
    assert [row["attempt"] for row in back] == [1, 1, 1]
    assert [dead["task_id"] for dead in json.loads(cli("dead", "list", "--json").stdout)] == [
        ids[1]]

    refused = cli("dead", "purge", stdin="n\n", check=False)
    assert refused.returncode == 1 and "Aborted" in refused.stderr
    assert len(json.loads(cli("dead", "list", "--json").stdout)) == 1
    assert cli("dead", "purge", "--yes").stdout.strip() == "purged: 1"
    after = figures(cli)
    assert (after["jobs.dead"]["ready"], after["jobs"]["ready"]) == (0, 4 + 3)

    # rows written by other code carry no death record: listed with why, never requeued
    # nor purged (they are not dead letters), and a command that chose them says so
    dead_table = str(after["jobs.dead"]["table"])
    with engine.begin() as conn:
        conn.execute(text(f"INSERT INTO {quoted(engine, dead_table)} (payload, headers) "
                          "VALUES (:payload, 'not json')"), {"payload": b"x"})
        conn.execute(text(f"INSERT INTO {quoted(engine, dead_table)} (payload, headers) "
                          "VALUES (:payload, :headers)"),
                     {"payload": b"{}", "headers": json.dumps({"headers": {"task": "ops.add"}})})
    odd, plain = json.loads(cli("dead", "list", "--json").stdout)
    assert odd["queue"] is None and odd["reason"].startswith("cannot decode stored message")
    assert (plain["queue"], plain["task"]) == (None, "ops.add")
    assert plain["reason"] == "no death record: not a dead letter"
    assert cli("dead", "show", str(odd["id"])).stdout.startswith(
        f"dead letter {odd['id']} in jobs.dead\nundecodable: cannot decode stored message")
    for command in (["requeue"], ["purge", "--yes"], ["purge", "--reason", "cannot", "--yes"]):
        refused = cli("dead", *command, check=False)
        assert refused.returncode == 1, (command, refused.stdout, refused.stderr)
        assert f"left {2 if len(command) < 3 else 1} row(s) of jobs.dead without a death " \
            "record" in refused.stderr, refused.stderr
    assert [dead["id"] for dead in json.loads(cli("dead", "list", "--json").stdout)] == [
        odd["id"], plain["id"]]


def test_dead_commands_refuse_a_queue_that_is_not_a_dead_letter_queue(
        cli: Cli, seeded: Seeded, engine: Engine, table_prefix: str) -> None:
    jobs = f"{table_prefix}jobs"

    def live() -> list[tuple[int, bytes]]:  # (leases are extended meanwhile)
        return [(row["id"], bytes(row["payload"])) for row in rows(engine, jobs)]

    before = live()
    for command in (["purge", "-D", "jobs", "--task", "ops.*", "--yes"],
                    ["requeue", "-D", "jobs"], ["list", "-D", "jobs"], ["show", "1", "-D", "jobs"],
                    ["purge", "-D", "jobs.dead", "-D", "nowhere", "--yes"]):
        refused = cli("dead", *command, check=False)
        assert refused.returncode == 2, (command, refused.stdout, refused.stderr)
        assert "is not a dead-letter queue (these are: jobs.dead)" in refused.stderr, (
            command, refused.stderr)
    assert live() == before
    assert len(json.loads(cli("dead", "list", "-D", "jobs.dead", "--json").stdout)) == 4


def test_filters_that_choose_nothing_say_what_there_is_and_exit_1(
        cli: Cli, seeded: Seeded) -> None:
    # an operator's typo in a task glob or a queue name: nothing done, and said
    for command in (["requeue", "--task", "ops.ad"], ["requeue", "-Q", "jbos"],
                    ["purge", "--task", "ops.ad"], ["purge", "--reason", "timeout", "--yes"]):
        done = cli("dead", *command, check=False)
        assert done.returncode == 1, (command, done.stdout, done.stderr)
        assert "no dead letter matches the filters given: nothing done; jobs.dead holds 4 " \
            "dead letter(s) of queue(s) jobs, task(s) ops.add, ops.fail" in done.stderr, (
                command, done.stderr)
        assert "Traceback" not in done.stderr and "[y/N]" not in done.stdout, done.stdout
    assert len(json.loads(cli("dead", "list", "--json").stdout)) == 4


@contextmanager
def inserts_held(database: str, engine: Engine, table: str) -> Iterator[None]:
    """No other session writes into ``table`` until the block ends (a writer's transaction
    under way finishes first)."""
    if database == "sqlite":
        holder = sqlite3.connect(str(engine.url.database), isolation_level=None,
                                 timeout=CLI_LIMIT)
        holder.execute("BEGIN IMMEDIATE")  # the database's write lock
        try:
            yield
        finally:
            holder.execute("ROLLBACK")
            holder.close()
    elif database == "postgresql":
        with engine.begin() as conn:
            conn.execute(text(f"LOCK TABLE {quoted(engine, table)} IN SHARE MODE"))
            yield
    else:
        with engine.connect() as conn:
            conn.execute(text(f"LOCK TABLES {quoted(engine, table)} READ"))
            try:
                yield
            finally:
                conn.execute(text("UNLOCK TABLES"))


def test_an_interrupted_requeue_says_how_many_moved(
        ops_env: dict[str, str], seeded: Seeded, engine: Engine, database: str) -> None:
    """Ctrl-C in the middle of a long requeue: the batches committed so far are counted on
    stdout, the rest stay dead letters, none is in both places, and the exit is 130. The
    requeue is held mid-way (its queue's table locked) when the signal is sent, so it
    cannot finish first; and the command starts with Ctrl-C's default action whatever
    the test's own (a shell's background job ignores it, and so would Python)."""
    dead, jobs = (seeded.broker.table(queue).spec.table for queue in ("jobs.dead", "jobs"))
    columns = ", ".join(column["name"] for column in inspect(engine).get_columns(dead)
                        if column["name"] != "id")
    with engine.begin() as conn:
        for _ in range(12):  # 4,096 copies of the ops.fail letter: more than it moves
            conn.execute(text(f"INSERT INTO {quoted(engine, dead)} ({columns}) "
                              f"SELECT {columns} FROM {quoted(engine, dead)}"))
    before = {table: row_count(engine, table) for table in (dead, jobs)}
    argv = [sys.executable, "-m", "celery", "-A", "tests.ops.apps", "sqlinbox", "dead",
            "requeue", "--task", "ops.fail", "--batch", "1"]
    with subprocess.Popen(argv, cwd=ROOT, env={**os.environ, **ops_env, "PYTHONPATH": str(ROOT)},
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          preexec_fn=partial(signal.signal, signal.SIGINT, signal.SIG_DFL)
                          ) as run:
        # six batches committed: the count said is at most one behind (a batch mid-commit)
        # the command's start-up and six batches: a minute was not enough on MariaDB while
        # the suite's other parts ran (the test takes 13 s alone)
        wait_until(lambda: row_count(engine, jobs) >= before[jobs] + 6 or run.poll() is not None,
                   180, "the requeue's first batches")
        with inserts_held(database, engine, jobs):
            assert run.poll() is None, run.communicate()  # mid-way, and held there
            run.send_signal(signal.SIGINT)
        out, err = run.communicate(timeout=60)
    assert run.returncode == 130, (out, err)
    said = int(re.fullmatch(r"requeued: (\d+)\n", out).group(1))  # type: ignore[union-attr]
    moved = row_count(engine, jobs) - before[jobs]
    assert said >= 5 and moved - said in (0, 1), (said, moved, err)  # a batch mid-commit
    assert "left where they are" in err and "Traceback" not in err, err
    assert row_count(engine, dead) == before[dead] - moved


NO_DEAD_LETTER_QUEUE = '''import os
from celery import Celery
app = Celery("plain", broker=os.environ["PLAIN_BROKER"])
app.conf.broker_transport_options = {"table_prefix": os.environ["PLAIN_PREFIX"]}
'''
#: every dead command, as an operator types it
DEAD_COMMANDS = (["list"], ["list", "--json"], ["show", "1"], ["requeue"], ["purge"],
                 ["purge", "--yes"], ["list", "-D", "jobs.dead"])


def without_dead_letter_queue(tmp_path: Path, broker: str, prefix: str, *args: str
                              ) -> subprocess.CompletedProcess[str]:
    """``celery -A plain sqlinbox dead ARGS`` of an app whose options configure no
    dead-letter queue (in this process: :mod:`tests.ops.runner`)."""
    (tmp_path / "plain.py").write_text(NO_DEAD_LETTER_QUEUE)
    return invoke(["celery", "-A", "plain", "sqlinbox", "dead", *args],
                  {"PLAIN_BROKER": broker, "PLAIN_PREFIX": prefix}, stdin="y\n",
                  path=[tmp_path], fresh=["plain"])


@pytest.mark.parametrize("command", DEAD_COMMANDS, ids=" ".join)
def test_dead_commands_without_a_dead_letter_queue_say_so_in_one_line(
        tmp_path: Path, broker_url: str, table_prefix: str, command: list[str]) -> None:
    """Not an empty table and exit 0, as if there were none: there is nowhere to look."""
    done = without_dead_letter_queue(tmp_path, broker_url, table_prefix, *command)
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert done.stdout == "", done.stdout  # no table, no prompt
    said = ("Error: no dead-letter queue is configured: set dead_letter_queue in the transport "
            "options (for every queue, or for one under queues={'name': {...}})")
    assert done.stderr.splitlines() == [said], done.stderr
    assert said in (ROOT / "docs" / "operations.rst").read_text()  # as the guide shows it


@pytest.mark.parametrize("command", DEAD_COMMANDS, ids=" ".join)
def test_dead_commands_on_a_database_that_is_down_say_so_in_one_line(
        tmp_path: Path, command: list[str]) -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    broker = f"sqlinbox+postgresql://app:s3cret@127.0.0.1:{port}/test"
    done = without_dead_letter_queue(tmp_path, broker, "plain_", *command)
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert done.stdout == "" and "s3cret" not in done.stderr, done.stderr
    [line] = done.stderr.splitlines()
    assert line.startswith(f"Error: the database postgresql://app:***@127.0.0.1:{port}/test "
                           "failed: ") and "Connection refused" in line, line
    assert line.endswith("(--traceback for the details)"), line
