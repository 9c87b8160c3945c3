"""The operations commands on every driver and server mode: what they read (a BYTEA
payload, a headers column, a time) is what each driver returns, so each variant of the
driver matrix runs them. They run in the test's process (click's runner, the app given
as Celery gives it) to keep the matrix short; tests/ops/test_cli.py runs each command
as a user types it, and tests/ops/test_entry_point.py in a process of its own."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from celery import Celery
from click.testing import CliRunner

from celery_ext.ops_cli import sqlinbox
from tests.ops.conftest import Seeded
from tests.ops.test_cli import FIGURES

pytestmark = pytest.mark.drivers


def test_figures_and_dead_letters_read_alike_on_every_driver(
        app: Celery, seeded: Seeded) -> None:
    def run(*args: str) -> str:
        done = CliRunner().invoke(sqlinbox, args, obj=SimpleNamespace(app=app),
                                  catch_exceptions=False)
        assert done.exit_code == 0, done.output
        return done.output

    def figures() -> dict[str, dict[str, object]]:
        return {entry["queue"]: entry for entry in json.loads(run("queues", "--json"))}

    found = figures()
    for queue, expected in seeded.expected.items():
        assert {figure: found[queue][figure] for figure in FIGURES} == expected, queue
    assert 0 <= float(found["jobs"]["oldest_lease_age"]) < 30  # type: ignore[arg-type]
    assert 0 <= float(found["jobs"]["oldest_ready_age"]) < 120  # type: ignore[arg-type]

    listed = json.loads(run("dead", "list", "--json"))
    assert [dead["task"] for dead in listed] == seeded.dead_tasks
    assert {(dead["queue"], dead["attempts"]) for dead in listed} == {("jobs", 1)}
    ids = [dead["task_id"] for dead in listed]
    newer = json.loads(run("dead", "list", "--json", "--newer-than", "3600"))
    assert [dead["task_id"] for dead in newer] == ids
    assert "args=[1, 2] kwargs={}" in run("dead", "show", str(listed[0]["id"]))
    assert run("dead", "requeue", "--task", "ops.fail").strip() == "requeued: 1"
    assert run("dead", "purge", "--task", "ops.a*", "--yes").strip() == "purged: 3"
    after = figures()
    assert (after["jobs.dead"]["ready"], after["jobs"]["ready"]) == (0, 4 + 1)
