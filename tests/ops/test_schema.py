"""``ddl`` prints what creates every queue's table; ``check`` passes on exactly that
schema and fails, naming the problem, on a dropped index, a missing column, a wrong
column type and (MariaDB) routing tables that compare names ignoring trailing spaces."""

from __future__ import annotations

import pytest
from celery import Celery
from sqlalchemy import inspect, text
from sqlalchemy.engine import Engine

from kombu_sqlinbox.dialects import dialect_for
from kombu_sqlinbox.errors import DuplicateTask
from tests.integration.support import earlier_routing_ddl, quoted
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


def test_check_fails_on_a_missing_column_with_what_adds_it(
        cli: Cli, engine: Engine, table_prefix: str) -> None:
    """A queue table without a column a role needs (here ``attempt``) fails ``check``,
    which prints the ``ALTER TABLE`` that adds it."""
    with engine.begin() as conn:
        for statement in statements(cli("ddl", "jobs").stdout):
            conn.execute(text(statement.rstrip(";")))
        conn.execute(text(
            f"ALTER TABLE {quoted(engine, f'{table_prefix}jobs')} DROP COLUMN attempt"))
    failed = cli("check", check=False)
    assert failed.returncode == 1, failed.stdout
    (problem,) = [line for line in failed.stdout.splitlines() if line.startswith("PROBLEM")]
    assert problem.startswith(f"PROBLEM jobs ({table_prefix}jobs): table "
                              f"'{table_prefix}jobs': column 'attempt' (role attempt) is "
                              "missing"), failed.stdout
    assert "ADD COLUMN" in failed.stdout, failed.stdout


def test_check_fails_without_the_routing_tables(
        cli: Cli, engine: Engine, table_prefix: str) -> None:
    """With ``create_tables`` off, the routing tables are the service's to create like the
    queue tables: without them no worker can declare its remote-control queue."""
    off = {"create_tables": False}
    with engine.begin() as conn:
        for statement in statements(cli("ddl", "jobs", "fifo", "jobs.dead").stdout):
            conn.execute(text(statement.rstrip(";")))
    failed = cli("check", more=off, check=False)
    assert failed.returncode == 1, failed.stdout
    problem, paused, rates = [line for line in failed.stdout.splitlines()
                              if line.startswith("PROBLEM")]
    assert problem.startswith(f"PROBLEM (routing) ({table_prefix}queues): "), failed.stdout
    assert paused.startswith(f"PROBLEM (paused) ({table_prefix}paused_queues): "), paused
    assert rates.startswith(f"PROBLEM (rates) ({table_prefix}rate_budget): "), rates
    assert f"{table_prefix}bindings" in problem and f"{table_prefix}transient" in problem
    assert "CREATE TABLE IF NOT EXISTS" in failed.stdout  # what creates them

    with engine.begin() as conn:  # the whole printed DDL: the routing tables too
        for statement in statements(cli("ddl").stdout):
            conn.execute(text(statement.rstrip(";")))
    assert inspect(engine).has_table(f"{table_prefix}throughput")  # the counts' table too
    passed = cli("check", more=off)
    assert passed.stdout.strip().endswith("on 3 queues: 0 problem(s)"), passed.stdout

    bindings = quoted(engine, f"{table_prefix}bindings")
    with engine.begin() as conn:  # a routing table of another shape fails too
        conn.execute(text(f"DROP TABLE {bindings}"))
        conn.execute(text(f"CREATE TABLE {bindings} (exchange VARCHAR(100), queue "
                          "VARCHAR(100))"))
    failed = cli("check", check=False)
    assert failed.returncode == 1, failed.stdout
    assert f"PROBLEM (routing) ({table_prefix}bindings): " in failed.stdout, failed.stdout


def test_check_names_the_slots_table_only_where_a_queue_has_limits(
        cli: Cli, engine: Engine, table_prefix: str) -> None:
    """With ``create_tables`` off, the concurrency limits' slots are the service's to
    create, and ``check`` plans their statements, but only a queue with limits needs them."""
    with engine.begin() as conn:
        for statement in statements(cli("ddl").stdout):
            conn.execute(text(statement.rstrip(";")))
    limited = {"create_tables": False, "max_in_work": 4}
    assert cli("check", more=limited).stdout.strip().endswith("0 problem(s)")
    with engine.begin() as conn:
        conn.execute(text(f"DROP TABLE {quoted(engine, f'{table_prefix}limit_slots')}"))
    assert cli("check", more={"create_tables": False}).stdout.strip().endswith(
        "0 problem(s)")
    failed = cli("check", more=limited, check=False)
    assert failed.returncode == 1, failed.stdout
    (problem,) = [line for line in failed.stdout.splitlines() if line.startswith("PROBLEM")]
    assert problem.startswith(f"PROBLEM (limits) ({table_prefix}limit_slots): "), problem


#: the generated id of each database's printed DDL, and one without a generator
UNGENERATED = {
    "postgresql": ("BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY", "BIGINT PRIMARY KEY"),
    "mysql": ("BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY", "BIGINT NOT NULL PRIMARY KEY"),
    # not INTEGER: no alias of the rowid, so an id left out is NULL
    "sqlite": ("INTEGER PRIMARY KEY AUTOINCREMENT", "BIGINT PRIMARY KEY"),
}


def test_check_fails_on_an_id_the_database_does_not_generate(
        cli: Cli, engine: Engine, database: str, table_prefix: str) -> None:
    """The transport publishes without an id: a table whose id has no generator fails
    every publish (or, on SQLite, stores rows whose id is NULL)."""
    generated, plain = UNGENERATED[database]
    printed = cli("ddl", "jobs").stdout
    assert generated in printed, printed
    with engine.begin() as conn:
        for statement in statements(printed.replace(generated, plain)):
            conn.execute(text(statement.rstrip(";")))
    failed = cli("check", check=False)
    assert failed.returncode == 1, failed.stdout
    (problem,) = [line for line in failed.stdout.splitlines() if line.startswith("PROBLEM")]
    assert problem.startswith(
        f"PROBLEM jobs ({table_prefix}jobs): table '{table_prefix}jobs': column 'id' (role id) "
        "is not generated by the database"), failed.stdout


@pytest.mark.parametrize("database", ["mysql"], indirect=True)
def test_check_finds_routing_tables_comparing_names_without_trailing_spaces(
        cli: Cli, engine: Engine, table_prefix: str) -> None:
    """Routing tables made before names were binary strings: ``check`` says so and gives
    the ALTER that migrates them, which keeps every row and makes names compare exactly."""
    routing = dialect_for(engine).routing_statements(table_prefix)
    with engine.begin() as conn:
        for statement in earlier_routing_ddl(routing.ddl):
            conn.execute(text(statement))
        conn.execute(text(f"INSERT INTO {quoted(engine, routing.names[1])} VALUES "
                          "('ünï', 'alice', 'alice', 'direct', 'alice')"))
    failed = cli("check", check=False)
    assert failed.returncode == 1, failed.stdout
    problems = [line for line in failed.stdout.splitlines() if line.startswith("PROBLEM")]
    assert [line.split(":")[0] for line in problems] == [
        f"PROBLEM (routing) ({name})" for name in (*routing.names, routing.names[2])]
    assert "ignore trailing spaces" in problems[0], failed.stdout
    assert "headers holds at most 64 KiB" in problems[3], failed.stdout
    # an earlier version reads binary names as bytes: it would route nothing through them
    assert "once no process of an earlier version uses them" in problems[0], failed.stdout
    alters = [line for line in failed.stdout.splitlines() if line.startswith("ALTER TABLE")]
    assert len(alters) == 4, failed.stdout
    with engine.begin() as conn:
        for statement in alters:
            conn.execute(text(statement.rstrip(";")))
    passed = cli("check")
    assert passed.stdout.endswith(": 0 problem(s)\n"), passed.stdout
    with engine.connect() as conn:
        kept = conn.execute(text(
            f"SELECT CONVERT(exchange USING utf8mb4), queue FROM "
            f"{quoted(engine, routing.names[1])} WHERE queue = 'alice '")).all()
        assert kept == []
        kept = conn.execute(text(
            f"SELECT CONVERT(exchange USING utf8mb4) FROM "
            f"{quoted(engine, routing.names[1])} WHERE queue = 'alice'")).all()
    assert kept == [("ünï",)]


#: ids a database generates although reflection shows no default (and no AUTO_INCREMENT)
SEQUENCE_DEFAULTS = {
    # MariaDB: SQLAlchemy reflects ``DEFAULT nextval(`db`.`seq`)`` as no default at all
    "mysql": ("BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY",
              "BIGINT NOT NULL PRIMARY KEY DEFAULT NEXT VALUE FOR {sequence}"),
    "postgresql": ("BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY",
                   "BIGINT PRIMARY KEY DEFAULT nextval('{sequence}')"),
}


@pytest.mark.databases(*SEQUENCE_DEFAULTS)  # SQLite has no sequences
def test_check_passes_an_id_a_sequence_generates(
        cli: Cli, engine: Engine, database: str, table_prefix: str) -> None:
    """An id whose default takes the next value of a sequence is generated: no problem."""
    generated, from_sequence = SEQUENCE_DEFAULTS[database]
    sequence = f"{table_prefix}ids"
    printed = cli("ddl", "jobs").stdout
    with engine.begin() as conn:
        conn.execute(text(f"CREATE SEQUENCE {sequence}"))
        for statement in statements(printed.replace(
                generated, from_sequence.format(sequence=sequence))):
            conn.execute(text(statement.rstrip(";")))
    try:
        passed = cli("check", check=False)
        assert passed.returncode == 0, passed.stdout
        assert passed.stdout.strip().endswith("0 problem(s)"), passed.stdout
    finally:
        with engine.begin() as conn:
            conn.execute(text(f"DROP TABLE {quoted(engine, f'{table_prefix}jobs')}"))
            conn.execute(text(f"DROP SEQUENCE {sequence}"))


#: a bounded column for each role that takes text, as a migration might have made it
BOUNDED = {
    "postgresql": [("payload", "ALTER TABLE {t} ALTER COLUMN payload TYPE VARCHAR(200) "
                               "USING encode(payload, 'escape')"),
                   ("headers", "ALTER TABLE {t} ALTER COLUMN headers TYPE VARCHAR(200)")],
    "mysql": [("headers", "ALTER TABLE {t} MODIFY COLUMN headers VARCHAR(200)"),
              ("headers", "ALTER TABLE {t} MODIFY COLUMN headers TEXT")],
}


@pytest.mark.parametrize("database", ["postgresql", "mysql"], indirect=True)
def test_check_fails_on_a_text_column_too_short_for_a_message(
        cli: Cli, engine: Engine, database: str, table_prefix: str) -> None:
    """A payload or headers column whose type bounds its length (VARCHAR(200), MySQL's
    64 KiB TEXT) takes a small message and refuses a larger one: ``check`` names it before
    the first large publish fails. SQLite enforces no length: a declared one is no problem."""
    printed = cli("ddl", "jobs").stdout
    jobs = quoted(engine, f"{table_prefix}jobs")
    for role, alter in BOUNDED[database]:
        with engine.begin() as conn:
            conn.execute(text(f"DROP TABLE IF EXISTS {jobs}"))
            for statement in statements(printed):
                conn.execute(text(statement.rstrip(";")))
            conn.execute(text(alter.format(t=jobs)))
        failed = cli("check", check=False)
        assert failed.returncode == 1, (alter, failed.stdout)
        (problem,) = [line for line in failed.stdout.splitlines()
                      if line.startswith("PROBLEM")]
        assert problem.startswith(
            f"PROBLEM jobs ({table_prefix}jobs): table '{table_prefix}jobs': column "
            f"'{role}' (role {role}) has type "), (alter, problem)
        assert "holds at most" in problem, problem


def test_ddl_prints_the_result_tables_and_check_plans_their_statements(
        cli: Cli, engine: Engine, db_url: str, table_prefix: str) -> None:
    """The result backend's tables are in ``ddl``'s output: created from it, a backend
    that does not create tables (``create_tables`` off) stores and reads results, and
    ``check`` plans its statements there as it does the routing tables': a table of
    another shape is a problem naming it."""
    printed = cli("ddl").stdout
    assert "-- result tables (result_backend = 'sqlinbox+...')" in printed
    with engine.begin() as conn:
        for statement in statements(printed):
            conn.execute(text(statement.rstrip(";")))
    app = Celery("results", broker="memory://", backend="sqlinbox+" + db_url,
                 set_as_current=False)
    app.conf.result_backend_transport_options = {"table_prefix": table_prefix,
                                                 "create_tables": False}
    try:
        app.backend.mark_as_done("from-ddl", [1, 2])
        assert app.AsyncResult("from-ddl").get(timeout=5) == [1, 2]
    finally:
        app.close()
    passed = cli("check")
    assert passed.stdout.strip().endswith("on 3 queues: 0 problem(s)"), passed.stdout
    groups = quoted(engine, f"{table_prefix}group_results")
    with engine.begin() as conn:
        conn.execute(text(f"DROP TABLE {groups}"))
        conn.execute(text(f"CREATE TABLE {groups} (group_id VARCHAR(100))"))
    failed = cli("check", check=False)
    assert failed.returncode == 1, failed.stdout
    (problem,) = [line for line in failed.stdout.splitlines() if line.startswith("PROBLEM")]
    assert problem.startswith(
        f"PROBLEM (results) ({table_prefix}group_results): the statement "), problem


def test_ddl_prints_the_unique_keys_ddl_as_comments_that_a_migration_may_run(
        cli: Cli, app: Celery, engine: Engine, table_prefix: str) -> None:
    """Each queue's unique-key column and index follow its table, commented out: the
    transport adds them on the first keyed send where it creates tables; a service whose
    migrations make the tables runs them there, and keyed sends work without
    ``create_tables`` (timed ones too: their table is printed with the others)."""
    printed = cli("ddl").stdout
    assert printed.count("-- unique keys") == 3, printed  # jobs, fifo, jobs.dead
    unique = [line.removeprefix("-- ") for line in printed.splitlines()
              if line.startswith(("-- ALTER", "-- CREATE"))]
    with engine.begin() as conn:
        for statement in [*statements(printed), *statements("\n".join(unique))]:
            conn.execute(text(statement.rstrip(";")))
    app.conf.broker_transport_options = {**app.conf.broker_transport_options,
                                         "create_tables": False}
    first = app.send_task("ops.add", (1, 2), queue="jobs", unique_key="k")
    with pytest.raises(DuplicateTask) as raised:
        app.send_task("ops.add", (1, 2), queue="jobs", unique_key="k")
    assert raised.value.task_id == first.id
    timed = app.send_task("ops.add", (1, 2), queue="jobs", unique_key="k", unique_scope=60)
    with pytest.raises(DuplicateTask, match=timed.id):  # its table printed too
        app.send_task("ops.add", (1, 2), queue="jobs", unique_key="k", unique_scope=60)
