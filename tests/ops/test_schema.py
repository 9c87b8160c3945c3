"""``ddl`` prints what creates every queue's table; ``check`` passes on exactly that
schema and fails, naming the problem, on a dropped index and on a wrong column type."""

from __future__ import annotations

from sqlalchemy import text
from sqlalchemy.engine import Engine

from tests.integration.support import quoted
from tests.ops.conftest import Cli


def statements(ddl: str) -> list[str]:
    """The statements of ``ddl``'s output, its comment lines left out."""
    kept = "\n".join(line for line in ddl.splitlines() if not line.startswith("--"))
    return [part.strip() for part in kept.split(";\n") if part.strip().rstrip(";")]


def test_check_passes_on_the_printed_ddl_and_catches_drift(
        cli: Cli, engine: Engine, database: str, table_prefix: str) -> None:
    # nothing created yet: the transport would create every table as printed
    assert cli("check").stdout == "checked 0 statements on 3 queues: 0 problem(s)\n"
    printed = cli("ddl").stdout
    assert printed.count("-- queue ") == 3  # jobs, fifo and their dead-letter queue
    with engine.begin() as conn:
        for statement in statements(printed):
            conn.execute(text(statement.rstrip(";")))
    passed = cli("check", standalone=True)
    assert passed.stdout.strip().endswith("on 3 queues: 0 problem(s)"), passed.stdout

    jobs = quoted(engine, f"{table_prefix}jobs")
    index = quoted(engine, f"{table_prefix}jobs_claim")
    with engine.begin() as conn:
        conn.execute(text(f"DROP INDEX {index} ON {jobs}" if database == "mysql"
                          else f"DROP INDEX {index}"))
    failed = cli("check", check=False)
    assert failed.returncode == 1, failed.stdout
    (problem,) = [line for line in failed.stdout.splitlines() if line.startswith("PROBLEM")]
    assert problem.startswith(f"PROBLEM jobs ({table_prefix}jobs): the claim")
    assert f"{table_prefix}jobs_claim" in problem

    fifo = quoted(engine, f"{table_prefix}fifo_jobs")
    with engine.begin() as conn:
        if database == "postgresql":
            conn.execute(text(f"ALTER TABLE {fifo} ALTER COLUMN attempt TYPE TEXT"))
        elif database == "mysql":
            conn.execute(text(f"ALTER TABLE {fifo} MODIFY COLUMN attempt VARCHAR(20)"))
        else:  # SQLite cannot change a column's type: the table is made again
            conn.execute(text(f"DROP TABLE {fifo}"))
            conn.execute(text(
                f"CREATE TABLE {fifo} (id INTEGER PRIMARY KEY AUTOINCREMENT, payload BLOB, "
                "headers TEXT, grp TEXT, priority INTEGER, available_at REAL, "
                "locked_until REAL, attempt TEXT)"))
    failed = cli("check", check=False)
    assert failed.returncode == 1
    problems = [line for line in failed.stdout.splitlines() if line.startswith("PROBLEM")]
    assert len(problems) == 2, failed.stdout
    assert problems[1].startswith(
        f"PROBLEM fifo ({table_prefix}fifo_jobs): table '{table_prefix}fifo_jobs': "
        "column 'attempt' (role attempt) has type"), problems[1]
