"""The databases' own command-line clients (``psql``, ``mariadb``, ``sqlite3``), run as
separate processes: what another service, a migration or an operator would use."""

from __future__ import annotations

import os
import subprocess

from sqlalchemy.engine import make_url

#: how long one client run may take
CLIENT_LIMIT = 60.0


def client_argv(db_url: str) -> tuple[list[str], dict[str, str]]:
    """The client of the database ``db_url`` names, reading SQL on stdin and printing rows
    as tab-separated lines without headers, stopping at the first error."""
    url = make_url(db_url)
    backend = url.get_backend_name()
    env = dict(os.environ)
    if backend == "postgresql":
        if url.password:
            env["PGPASSWORD"] = str(url.password)
        return ["psql", "-X", "-q", "-A", "-t", "-F", "\t", "-v", "ON_ERROR_STOP=1",
                "-h", str(url.host), "-p", str(url.port or 5432), "-U", str(url.username),
                "-d", str(url.database)], env
    if backend == "mysql":
        password = [f"-p{url.password}"] if url.password else []
        return ["mariadb", "--batch", "--skip-column-names", "-h", str(url.host),
                "-P", str(url.port or 3306), "-u", str(url.username), *password,
                str(url.database)], env
    assert backend == "sqlite", backend
    # a writer beside the workers waits for the write lock they take to claim, as the
    # transport's own connections do (busy timeout), instead of failing at once
    return ["sqlite3", "-bail", "-cmd", ".timeout 30000", "-separator", "\t",
            str(url.database)], env


def run_sql(db_url: str, sql: str) -> list[list[str]]:
    """Run ``sql`` with the database's own client; the rows it printed, split in columns."""
    argv, env = client_argv(db_url)
    done = subprocess.run(argv, input=sql, capture_output=True, text=True, env=env,
                          timeout=CLIENT_LIMIT, check=False)
    assert done.returncode == 0, f"{argv[0]} failed ({done.returncode}): {done.stderr}"
    return [line.split("\t") for line in done.stdout.splitlines() if line]
