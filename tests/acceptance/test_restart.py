"""The database server restarts while a worker runs 300 tasks: every task is done and the
worker goes on by itself. Duplicates are allowed (an ack can be lost with the connection)
and reported.

This restarts the shared PostgreSQL / MariaDB server: it must not run while other tests
use them (CI runs everything one after the other). The server is always left running.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from tests.acceptance.conftest import Acceptance
from tests.processes import wait_until
from tests.servers import restart_server, server_answers, start_server

TASKS = 300
RESTART_AFTER = 50


@pytest.fixture
def server(database: str, db_url: str, table_prefix: str) -> Iterator[str]:
    """The server under test; started again afterwards if a test left it down (set up after
    ``table_prefix`` so it is up again before that drops the test's tables)."""
    yield db_url
    if server_answers(db_url) is not None:
        start_server(database, db_url)


@pytest.mark.slow
@pytest.mark.parametrize("database", ["postgresql", "mysql"])
def test_worker_survives_a_database_restart(acceptance: Acceptance, server: str,
                                            database: str) -> None:
    acceptance.configure(visibility_timeout=5)
    worker = acceptance.worker("prefork", 2)
    keys = [f"t{n}" for n in range(TASKS)]
    acceptance.send("acc.run", keys, kwargs={"seconds": 0.03})
    wait_until(lambda: len(acceptance.runs.done()) >= RESTART_AFTER, 60,
               f"{RESTART_AFTER} tasks before the restart", alive=[worker])

    began = time.monotonic()
    restart_server(database, server)
    restarted = time.monotonic()
    done_at_restart = len(acceptance.runs.done())
    acceptance.engine.dispose()  # the test's own pooled connections died with the server
    wait_until(lambda: len(acceptance.runs.done()) >= TASKS, 180,
               f"all {TASKS} tasks after the restart", alive=[worker], interval=0.5)
    finished = time.monotonic()
    assert "Connection to broker lost" in worker.output(), "the restart missed the worker"
    assert worker.stop() == 0, worker.tail()

    done = acceptance.runs.done()
    assert not set(keys) - set(done), "tasks lost across the restart"
    twice = sorted(key for key, n in acceptance.runs.starts().items() if n > 1)
    print(f"{database}: restart took {restarted - began:.1f}s with {done_at_restart} done; "
          f"all done {finished - restarted:.1f}s later; ran twice: {len(twice)} {twice[:20]}")
    assert acceptance.rows() == 0
