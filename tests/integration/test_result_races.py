"""The result backend's pruning and groups while other processes use the same rows: a
``backend_cleanup`` in a process of its own racing a ``forget()``, processes restoring and
deleting one saved group."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from celery import Celery
from sqlalchemy import text
from sqlalchemy.engine import Engine

from tests.processes import Processes, wait_until

from .support import quoted

#: a process pruning the result tables (``result_expires`` one hour, small batches)
PRUNER = """
import sys
from celery import Celery
url, prefix, batch = sys.argv[1], sys.argv[2], int(sys.argv[3])
app = Celery("prune", broker="memory://", backend="sqlinbox+" + url)
app.conf.update(result_expires=3600, result_backend_transport_options={
    "table_prefix": prefix, "cleanup_batch": batch})
app.backend.cleanup()
print("pruned")
"""


def lock_waits(engine: Engine, table: str) -> Callable[[], bool]:
    """Whether a statement on ``table`` waits for a row lock (another session's)."""
    if engine.dialect.name == "postgresql":
        query = text("SELECT COUNT(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                     "AND position(:table in query) > 0 AND pid <> pg_backend_pid()")
    else:
        query = text("SELECT COUNT(*) FROM information_schema.innodb_trx "
                     "WHERE trx_state = 'LOCK WAIT' AND INSTR(trx_query, :table) > 0")

    def waiting() -> bool:
        with engine.connect() as conn:
            return bool(conn.execute(query, {"table": table}).scalar_one())

    return waiting


@pytest.mark.databases("postgresql", "mysql")
def test_a_prune_racing_a_forget_still_deletes_everything_that_expired(
        db_url: str, engine: Engine, table_prefix: str, processes: Processes,
        tmp_path: Path) -> None:
    """A ``forget()`` of an expired result, committed while ``backend_cleanup``'s first
    batch waits for its row, leaves that batch one row short: the prune goes on with
    the next batches, not taking the short batch for the last."""
    app = Celery("races", broker="memory://", backend="sqlinbox+" + db_url,
                 set_as_current=False)
    app.conf.update(result_backend_transport_options={"table_prefix": table_prefix})
    try:
        for n in range(30):
            app.backend.mark_as_done(f"old-{n:02}", n)
        tasks = quoted(engine, table_prefix + "task_results")
        with engine.begin() as conn:  # expired an hour ago, old-00 the oldest
            conn.execute(text(f"UPDATE {tasks} SET date_done = date_done - 7200 - "
                              "CAST(SUBSTR(task_id, 5) AS INTEGER)"
                              if engine.dialect.name == "postgresql" else
                              f"UPDATE {tasks} SET date_done = date_done - 7200 - "
                              "CAST(SUBSTR(task_id, 5) AS UNSIGNED)"))
        forget = engine.connect()
        transaction = forget.begin()  # the forget of old-29 (the oldest), not committed yet
        forget.execute(text(f"DELETE FROM {tasks} WHERE task_id = 'old-29'"))
        pruner = processes.spawn("pruner", [sys.executable, "-c", PRUNER, db_url,
                                            table_prefix, "10"])
        wait_until(lock_waits(engine, table_prefix + "task_results"), 30,
                   "the prune to wait for the forgotten row", alive=[pruner])
        transaction.commit()
        forget.close()
        assert pruner.wait(60) == 0, pruner.tail()
        with engine.connect() as conn:
            left = conn.execute(text(f"SELECT COUNT(*) FROM {tasks}")).scalar_one()
        assert left == 0, f"{left} expired results left after the prune"
    finally:
        app.close()
