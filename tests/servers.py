"""The database servers: whether one answers, and restarting one for real (the restart
acceptance test and the soak, ``bench/soak.py``).

Restarting takes the shared server away from everyone using it: only where nothing else
runs against it. Whatever happens, :func:`start_server` brings it back.
"""

from __future__ import annotations

import os
import subprocess

from sqlalchemy import create_engine, text

from tests.parts import SHARED_ENV
from tests.processes import wait_until

#: bounded waits for the server's own commands and for it to answer again
SERVER_LIMIT = 60.0
MARIADBD = "/usr/sbin/mariadbd"


def server_answers(url: str) -> str | None:
    """None when the server answers, else the error text."""
    from kombu_sqlinbox.broker import sqlalchemy_url

    engine = create_engine(sqlalchemy_url(url))
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
        return None
    except Exception as exc:  # any failure to connect means "not there"
        return str(exc).splitlines()[0]
    finally:
        engine.dispose()


def run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=SERVER_LIMIT)


def mariadbd_running() -> bool:
    return run("start-stop-daemon", "--status", "--exec", MARIADBD).returncode == 0


def start_server(database: str, url: str) -> None:
    """Start the server (``postgresql`` or ``mysql``) and wait until it answers."""
    if database == "postgresql":
        run("pg_ctlcluster", "15", "main", "start")
    else:
        run("start-stop-daemon", "--start", "--oknodo", "--background", "--exec", MARIADBD)
    wait_until(lambda: server_answers(url) is None, SERVER_LIMIT, f"{database} to answer",
               interval=0.5)


def restart_server(database: str, url: str) -> None:
    """Restart the server and wait until it answers again; refused while other parts of
    the suite run beside this one (``python -m tests.parts`` says so in the environment):
    a test that restarts a server belongs to an exclusive part."""
    if os.environ.get(SHARED_ENV):
        raise AssertionError(
            f"restarting {database} would fail the parts running beside this one: "
            f"a test that restarts a server belongs in tests.parts.EXCLUSIVE's part")
    if database == "postgresql":
        result = run("pg_ctlcluster", "15", "main", "restart")
        assert result.returncode == 0, result.stderr
    else:
        result = run("mariadb-admin", "-uroot", "shutdown")
        assert result.returncode == 0, result.stderr
        wait_until(lambda: not mariadbd_running(), SERVER_LIMIT, "mariadbd to exit")
    start_server(database, url)
