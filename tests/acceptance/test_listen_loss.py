"""The database ends a worker's LISTEN session (``pg_terminate_backend``, a failover, an
idle-session timeout): the worker connects a new one by itself, tasks go on, and
nothing is logged as an error (log-based alerts fire on errors and tracebacks).
``tests/integration/test_listen_loss.py`` drives the path that logged one."""

from __future__ import annotations

import pytest
from sqlalchemy import bindparam, text
from sqlalchemy.engine import make_url

from bench.chaos_faults import group_ports
from kombu_sqlinbox.dialects.postgresql import LISTEN_APPLICATION
from tests.acceptance.conftest import Acceptance
from tests.processes import Proc, wait_until

#: the worker's idle wait: it sits in ``select`` on the LISTEN socket when that dies
POLLING = 2.0
ROUNDS = 2


def listen_sessions(acceptance: Acceptance, worker: Proc, idle_for: float = 0.0) -> list[int]:
    """The backend pids of the worker's LISTEN sessions, as an operator finds them (told from
    other workers' on the same database by their client ports); only those without a
    statement for ``idle_for`` seconds (the worker waits on them)."""
    ports = sorted(group_ports(worker.popen.pid))
    if not ports:
        return []
    with acceptance.engine.connect() as conn:
        return list(conn.execute(text(
            "SELECT pid FROM pg_stat_activity WHERE application_name = :name "
            "AND state = 'idle' AND state_change < now() - make_interval(secs => :idle) "
            "AND client_port IN :ports"
        ).bindparams(bindparam("ports", expanding=True)),
            {"name": LISTEN_APPLICATION, "idle": idle_for, "ports": ports}).scalars())


@pytest.mark.databases("postgresql")
@pytest.mark.parametrize("driver", ["psycopg", "psycopg2"])
def test_a_terminated_listen_session_is_replaced_quietly(
        acceptance: Acceptance, db_url: str, driver: str) -> None:
    acceptance.configure(polling_interval=POLLING)
    url = make_url(db_url).set(drivername=f"postgresql+{driver}")
    worker = acceptance.worker(
        "prefork", 2, broker_url="sqlinbox+" + url.render_as_string(hide_password=False))
    for n in range(ROUNDS):
        (pid,) = wait_until(lambda: listen_sessions(acceptance, worker, POLLING / 2), 30,
                            "the worker to wait on its LISTEN session", alive=[worker])
        with acceptance.engine.connect() as conn:
            assert conn.execute(text("SELECT pg_terminate_backend(:pid)"),
                                {"pid": pid}).scalar_one()
        wait_until(lambda pid=pid: listen_sessions(acceptance, worker) not in ([], [pid]), 30,
                   "a new LISTEN session", alive=[worker])
        acceptance.send("acc.run", [f"after{n}"])
        wait_until(lambda n=n: acceptance.runs.done()[f"after{n}"], 30,
                   "a task sent after the session ended", alive=[worker])
    log = worker.output()
    assert "ERROR" not in log and "Traceback" not in log, worker.tail()
    assert worker.stop() == 0, worker.tail()
