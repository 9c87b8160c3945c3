"""The commands as a user's shell starts them, once per database: ``celery -A proj
sqlinbox`` (the group found through Celery's ``celery.commands`` entry point) and the
``sqlinbox`` console script, each a real process. The other operations tests run the
same groups in their own process (:mod:`tests.ops.runner`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.ops.conftest import CLI_LIMIT, SQLINBOX, Seeded, standalone_options
from tests.processes import ROOT


def test_both_entry_points_read_the_queues_in_a_process_of_their_own(
        ops_env: dict[str, str], seeded: Seeded, db_url: str, table_prefix: str) -> None:
    env = {**os.environ, **ops_env, "PYTHONPATH": str(ROOT)}
    for argv in ([sys.executable, "-m", "celery", "-A", "tests.ops.apps", "sqlinbox",
                  "queues", "--json"],
                 [SQLINBOX, "--url", db_url, "--transport-options",
                  standalone_options(table_prefix), "queues", "--json"]):
        done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=CLI_LIMIT)
        assert done.returncode == 0, (argv, done.stderr)
        found = {entry["queue"]: entry["ready"] for entry in json.loads(done.stdout)}
        assert found == {queue: figures["ready"]
                         for queue, figures in seeded.expected.items()}, argv
