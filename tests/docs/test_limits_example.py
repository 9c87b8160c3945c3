"""The concurrency limits guide's example (docs/limits.rst, examples/limits): eighteen
reports of three tenants run by two real prefork workers; the ledger the tasks keep shows
at most two of a tenant at once (the enterprise tenant more), six in all, and every report
run once."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.ledger import most_at_once
from tests.processes import Processes, wait_until

from .support import EXAMPLES


def ledger(log: Path) -> list[list[str]]:
    return [line.split() for line in log.read_text().splitlines()] if log.exists() else []


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_two_workers_run_each_tenants_reports_within_its_limit(
        db_url: str, table_prefix: str, processes: Processes, tmp_path: Path) -> None:
    log = tmp_path / "reports.log"
    env = {**os.environ, "LIMITS_DATABASE_URL": db_url, "LIMITS_LOG": str(log),
           "LIMITS_TABLE_PREFIX": table_prefix, "PYTHONPATH": str(EXAMPLES / "limits")}
    sent = subprocess.run([sys.executable, "limits_app.py"], cwd=EXAMPLES / "limits",
                          env=env, capture_output=True, text=True, timeout=60)
    assert sent.returncode == 0, sent.stdout + sent.stderr
    workers = processes.workers("limits_app", ["w1", "w2"], env, concurrency=4)
    wait_until(lambda: len(ledger(log)) >= 18, 90, "eighteen reports", alive=workers)
    runs = ledger(log)
    assert sorted((tenant, int(n)) for tenant, n, *_ in runs) == sorted(
        (tenant, n) for tenant in ("acme", "globex", "enterprise-initech") for n in range(6))
    most = most_at_once((tenant, float(start), float(end)) for tenant, _, start, end in runs)
    assert most["acme"] <= 2 and most["globex"] <= 2, most
    assert max(most.values()) >= 2, most  # the workers did run reports side by side
    in_all = most_at_once(("all", float(start), float(end)) for _, _, start, end in runs)
    assert in_all["all"] <= 6, in_all
    for worker in workers:
        worker.terminate()
    for worker in workers:
        assert worker.wait(30) == 0
