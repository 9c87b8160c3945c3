"""The guide's demonstration: ``examples/refunds/run.py`` runs a real worker and adds up."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_refund_example_runs_and_refunds_each_order_once(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT),
                                                        os.environ.get("PYTHONPATH", "")])}
    env.pop("REFUNDS_DATABASE_URL", None)  # its own SQLite file
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "refunds" / "run.py")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    for line in ("(card calls: 1, paid: True)", "(card calls: 2, paid: True)",
                 "receipts recorded: 3", ": 0 request rows, 0 card calls", ": dropped",
                 "worker stopped (exit status 0)", "exactly once: yes"):
        assert line in out, out
