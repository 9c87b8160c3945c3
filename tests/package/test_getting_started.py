"""A newcomer's path, README to getting started to a first task on PostgreSQL with an app
of their own, on the wheel the guide's install commands built: each command is read from
the guide, so the test fails where the guide and the behaviour part."""

from __future__ import annotations

import re
from functools import partial
from pathlib import Path

import pytest

from tests.databases import fresh_database
from tests.package.conftest import GUIDE, Installed
from tests.package.guide import code_blocks, commands
from tests.processes import START_LIMIT, wait_until, worker_ready

#: where the guide's app finds its database; the test's own database stands in
GUIDE_DATABASE = "app@db/app"
#: a run of the demo, or one task sent and its result read (the guide's own timeout is less)
LIMIT = 90.0


def shown(output: str) -> list[str]:
    """Output lines without what differs between runs: temporary paths, pids, timings."""
    output = re.sub(r"/tmp/\S+", "<tmp>", output)
    output = re.sub(r"\d+\.\d+", "<n>", re.sub(r"\(pid \d+\)", "(pid <n>)", output))
    return output.strip().splitlines()


@pytest.mark.slow
def test_the_demo_runs_from_the_wheel_as_the_guide_shows(installed: Installed) -> None:
    (block,) = code_blocks(GUIDE, "Run the demo", "console")
    (demo,) = commands(block)
    done = installed.run(demo.line, cwd=installed.clone, timeout=LIMIT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert shown(done.stdout) == shown(demo.output)


@pytest.mark.slow
def test_a_first_task_on_postgresql_runs_as_the_guide_says(installed: Installed,
                                                           tmp_path: Path) -> None:
    source = code_blocks(GUIDE, "Your own app", "python")[0]
    (block,) = code_blocks(GUIDE, "Your own app", "console")
    worker, send = commands(block)
    assert GUIDE_DATABASE in source
    with fresh_database("postgresql", tmp_path) as url:
        app = tmp_path / "proj"
        app.mkdir()
        (app / "proj.py").write_text(source.replace(GUIDE_DATABASE, url.split("://", 1)[1]))
        proc = installed.start("celery", worker.line, cwd=app, log=tmp_path / "worker.log")
        try:
            wait_until(partial(worker_ready, proc), START_LIMIT, "the worker", alive=[proc])
            done = installed.run(send.line, cwd=app, timeout=LIMIT)
        finally:
            status = proc.stop()
        assert (done.stdout, done.returncode) == (send.output, 0), done.stderr + proc.tail()
        assert status == 0, proc.tail()
