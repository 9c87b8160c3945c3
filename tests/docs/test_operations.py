"""The Operations guide's example on every database: its Alembic migration creates the
queue tables (``check`` passes on them, the app publishes into them), and rolls back;
the guide shows the commands' real headings and every Prometheus metric name."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from sqlalchemy import inspect
from sqlalchemy.engine import Engine

from celery_ext.ops_render import METRICS, metric_name
from kombu_sqlinbox.tables import table_name_for_queue
from tests.processes import ROOT

from .support import DOCS, EXAMPLES

EXAMPLE = EXAMPLES / "operations"
GUIDE = (DOCS / "operations.rst").read_text()


def run(env: dict[str, str], *argv: str) -> str:
    """A command in the example's directory, as its reader runs it; its output."""
    done = subprocess.run([sys.executable, "-m", *argv], cwd=EXAMPLE, capture_output=True,
                          text=True, timeout=120,
                          env={**os.environ, **env, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, f"{argv}: {done.stdout}\n{done.stderr}"
    return done.stdout


def test_migration_applied_checked_used_and_rolled_back(
        db_url: str, table_prefix: str, engine: Engine) -> None:
    env = {"OPS_EXAMPLE_URL": db_url, "OPS_EXAMPLE_PREFIX": table_prefix}
    tables = [table_name_for_queue(queue, table_prefix) for queue in ("emails", "emails.dead")]
    run(env, "alembic", "-c", "alembic.ini", "upgrade", "head")
    found = inspect(engine)
    assert found.has_table(f"{table_prefix}rate_budget")  # with the routing tables
    for table in tables:
        assert found.has_table(table)
        assert f"{table}_claim" in {index["name"] for index in found.get_indexes(table)}
    checked = run(env, "celery", "-A", "proj", "sqlinbox", "check")
    assert re.fullmatch(r"checked \d+ statements on 2 queues: 0 problem\(s\)", checked.strip())

    run(env, "celery", "-A", "proj", "call", "proj.send_email", "--args", '["ada@example.com"]')
    shown = run(env, "celery", "-A", "proj", "sqlinbox", "queues")
    heading, emails, _ = shown.splitlines()
    assert heading in GUIDE
    assert re.match(r"emails +1 +0 +0 +- +0 +0 +0 +\d+\.\ds +0 \(emails.dead\) +-$", emails), shown

    run(env, "alembic", "-c", "alembic.ini", "downgrade", "base")
    found = inspect(engine)
    assert not any(found.has_table(table) for table in [*tables, f"{table_prefix}rate_budget"])


def test_guide_names_every_metric() -> None:
    shown = set(re.findall(r"sqlinbox_queue_[a-z_]+", GUIDE))
    assert shown == {metric_name(figure) for figure in METRICS}
