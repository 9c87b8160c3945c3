"""``sqlinbox pause|resume|paused`` run as a user runs them, on every database: what they
print, what ``queues`` shows of a pause (text, JSON, Prometheus), what they refuse."""

from __future__ import annotations

import json
import socket

from tests.ops.conftest import Cli


def test_pause_shows_in_queues_and_resume_clears_it(cli: Cli) -> None:
    said = cli("pause", "jobs", "--reason", "incident 42", "--by", "alice").stdout
    assert said.startswith("paused jobs: since ") and "by alice: incident 42" in said, said
    assert "within 1s without one" in said
    again = cli("pause", "jobs", "--reason", "other").stdout
    assert again.startswith("jobs was paused already: since ") and "incident 42" in again

    text = cli("queues").stdout
    header, *lines = text.splitlines()
    assert header.split()[-1] == "state"
    jobs = next(line for line in lines if line.startswith("jobs "))
    assert jobs.split()[-1] == "PAUSED"
    assert next(line for line in lines if line.startswith("fifo ")).split()[-1] == "-"
    assert any(line.startswith("PAUSED jobs since ") and line.endswith("by alice: incident 42")
               for line in lines), text
    by_queue = {entry["queue"]: entry for entry in json.loads(cli("queues", "--json").stdout)}
    paused = by_queue["jobs"]["paused"]
    assert (paused["queue"], paused["by"], paused["reason"]) == ("jobs", "alice", "incident 42")
    assert by_queue["fifo"]["paused"] is None
    exposition = cli("queues", "--format", "prometheus", standalone=True).stdout
    assert {line.rsplit(" ", 1)[1] for line in exposition.splitlines()
            if line.startswith('sqlinbox_queue_paused{queue="jobs"')} == {"1"}
    listed = json.loads(cli("paused", "--json", standalone=True).stdout)
    assert [entry["queue"] for entry in listed] == ["jobs"]

    assert cli("resume", "jobs").stdout == "resumed jobs\n"
    assert cli("paused").stdout == ""
    assert json.loads(cli("queues", "--json").stdout)[0]["paused"] is None


def test_bad_queue_names_are_refused_with_the_closest(cli: Cli) -> None:
    typo = cli("pause", "jbos", check=False)
    assert typo.returncode == 2 and "'jbos' is not a queue" in typo.stderr, typo.stderr
    assert "did you mean 'jobs'?" in typo.stderr
    other_case = cli("pause", "Jobs", check=False)
    assert "did you mean 'jobs'?" in other_case.stderr, other_case.stderr
    assert cli("pause", "Jobs", "--force").returncode == 0  # a queue not declared yet
    not_paused = cli("resume", "jobs", check=False)
    assert not_paused.returncode == 1, not_paused
    assert not_paused.stderr == "Error: 'jobs' is not paused; did you mean 'Jobs'?\n"
    hostile = cli("pause", "a" * 256, "--force", check=False)
    assert hostile.returncode == 2 and "exceeds 255 characters" in hostile.stderr
    long_reason = cli("pause", "jobs", "--reason", "x" * 501, check=False)
    assert long_reason.returncode == 2 and "at most 500" in long_reason.stderr


def test_pause_on_a_database_that_is_down_says_so_in_one_line(cli: Cli) -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"postgresql://ops:s3cret@127.0.0.1:{port}/test"
    for command in (["pause", "jobs", "--force"], ["resume", "jobs"]):
        done = cli(*command, url=url, standalone=True, check=False)
        assert done.returncode == 1 and done.stdout == "", done
        [line] = done.stderr.splitlines()
        assert line.startswith(f"Error: the database postgresql://ops:***@127.0.0.1:{port}"
                               "/test failed: ") and "s3cret" not in line, line
