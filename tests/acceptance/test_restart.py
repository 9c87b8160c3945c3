"""The database server restarts while a worker runs 300 tasks: every task is done and the
worker goes on by itself. Duplicates are allowed (an ack can be lost with the connection)
and reported. A pause issued while the server restarts fails until it is back, then
holds every worker. MariaDB's transient work, on connections kept in autocommit, goes on
after a restart.

This restarts the shared PostgreSQL / MariaDB server: it must not run while other tests
use them (CI runs everything one after the other). The server is always left running.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
from kombu import Connection as KombuConnection
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError

from kombu_sqlinbox.errors import DatabaseUnreachable
from kombu_sqlinbox.operations import Operations
from kombu_sqlinbox.options import parse_options
from tests.acceptance.conftest import Acceptance, check_exactly_once
from tests.integration.support import broker_of
from tests.integration.test_transient_alone import bodies, reply_queue, send, transient_rows
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


#: the tasks published while the queue is paused, and how long none may start
HELD = [f"p{n}" for n in range(20)]
WATCH = 3.0


@pytest.mark.parametrize("database", ["postgresql", "mysql"])
def test_a_pause_issued_while_the_database_restarts_holds_once_it_lands(
        acceptance: Acceptance, server: str, database: str) -> None:
    """The pause is tried again and again while the server goes down and comes back: each
    try that fails says so and changes nothing; the one that lands holds the worker
    (which reconnects by itself) until resume, and then each task runs once."""
    acceptance.configure(visibility_timeout=5, pause_check_interval=1.0)
    worker = acceptance.worker("prefork", 2)
    acceptance.send("acc.run", ["before"])
    wait_until(lambda: acceptance.runs.done()["before"], 30, "a task before the restart",
               alive=[worker])
    ops = Operations(acceptance.broker_url, parse_options(acceptance.options), ["celery"])
    restarting = threading.Thread(target=restart_server, args=(database, server))
    failed = 0
    try:
        restarting.start()
        wait_until(lambda: server_answers(server) is not None, 60, "the server to go down",
                   interval=0.02)
        deadline = time.monotonic() + 120
        while True:
            try:
                ops.pause("celery", reason="restart")
                break
            except (DBAPIError, DatabaseUnreachable):
                failed += 1  # the server is away: nothing was written
                assert time.monotonic() < deadline, "the pause never landed"
                time.sleep(0.05)  # a retry loop's pace, not a synchronisation
        restarting.join(120)
        assert not restarting.is_alive(), "the server did not come back"
        assert failed, "the pause landed before the server went down"
        acceptance.engine.dispose()  # the test's own pooled connections died with it
        acceptance.send("acc.run", HELD)
        time.sleep(WATCH)  # watched well past the worker's reconnection and check interval
        assert [r for r in acceptance.runs.records() if r["key"] in HELD] == []
        assert ops.resume("celery")
    finally:
        ops.close()
    wait_until(lambda: set(acceptance.runs.done()) >= set(HELD), 90, "the held tasks",
               alive=[worker], interval=0.5)
    check_exactly_once(acceptance.runs.starts(), ["before", *HELD])
    assert worker.stop() == 0, worker.tail()
    print(f"{database}: {failed} pause tries failed while the server restarted")


@pytest.mark.slow
@pytest.mark.parametrize("database", ["mysql"])
def test_transient_work_alone_goes_on_after_a_database_restart(
        server: str, broker_url: str, table_prefix: str, engine: Engine) -> None:
    """MariaDB restarted under a broker whose connections kept in autocommit are all dead:
    a transient queue's declare, a publish and claims each land once afterwards."""
    conn = KombuConnection(broker_url, transport_options={"table_prefix": table_prefix})
    try:
        queue = reply_queue(conn)
        for n in range(3):
            send(conn, {"warm": n})
        assert len(bodies(queue)) == 3
        send(conn, {"n": 0})
        restart_server("mysql", server)
        engine.dispose()  # this test's own connections died with the server too
        send(conn, {"n": 1})
        fresh = reply_queue(conn, "fresh")
        send(conn, {"n": 2}, "fresh")
        assert bodies(queue) == [{"n": 0}, {"n": 1}]
        assert bodies(fresh) == [{"n": 2}]
        assert transient_rows(engine, broker_of(conn)) == 0
    finally:
        conn.release()
