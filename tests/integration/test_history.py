"""Task history from the result table: the recent failures one by one and per task, the
history index (made with the tables, added to tables made before it), and the plans on a
big table: a listing reads a range of the index, never the whole table, and so does
``backend_cleanup``'s batch (the index on ``date_done``)."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator

import pytest
from celery import Celery
from celery.app.task import Context
from sqlalchemy import create_engine, inspect, make_url, text
from sqlalchemy.engine import Engine

from celery_ext.results import SqlInboxBackend
from kombu_sqlinbox.dialects.results import RESULT_TABLES
from kombu_sqlinbox.history import History, ResultsMissing, history_problems
from kombu_sqlinbox.results import ResultStore

from .support import quoted
from .test_results import MakeApp, app, make_app, tasks_table

__all__ = ["app", "make_app"]

#: rows of the big table: one in a hundred a failure, done over the last two days
BIG = 200_000
#: ten digits; six cross joins of them give a million numbers
DIGITS = " UNION ALL ".join(f"SELECT {d} AS d" for d in range(10))


def store_of(app: Celery) -> ResultStore:
    backend = app.backend
    assert isinstance(backend, SqlInboxBackend)
    return backend.store


def fail(app: Celery, task_id: str, name: str, exc: Exception, worker: str = "w1@h") -> None:
    request = Context(task=name, args=[], kwargs={}, hostname=worker)
    try:
        raise exc
    except Exception as raised:
        app.backend.mark_as_failure(task_id, raised, request=request)


def history_of(app: Celery) -> History:
    store = store_of(app)
    store.ensure()
    return History(store.database, store.sql)


def age(engine: Engine, table: str, task_id: str, seconds: float) -> None:
    """Make a result ``seconds`` older (date_done is the database's clock)."""
    with engine.begin() as conn:
        conn.execute(text(f"UPDATE {table} SET date_done = date_done - :s WHERE task_id = :t"),
                     {"s": seconds, "t": task_id})


def test_recent_failures_latest_first_per_task_and_in_the_window(
        make_app: MakeApp, engine: Engine, table_prefix: str) -> None:
    app = make_app(result_extended=True)
    app.backend.mark_as_done("ok-1", 1, request=Context(task="shop.pay", hostname="w1@h"))
    fail(app, "f-1", "shop.pay", ValueError("card declined"))
    fail(app, "f-2", "shop.ship", KeyError("parcel 7"), worker="w2@h")
    fail(app, "f-3", "shop.pay", RuntimeError("gateway\ndown"))
    fail(app, "f-old", "shop.pay", ValueError("last week"))
    table = tasks_table(engine, table_prefix)
    for n, task_id in enumerate(["f-1", "f-2", "f-3"]):  # distinct times, f-3 the latest
        age(engine, table, task_id, 30 - 10 * n)
    age(engine, table, "f-old", 7 * 86400)
    history = history_of(app)

    listed = history.failures(3600, 10)
    assert [f.task_id for f in listed] == ["f-3", "f-2", "f-1"]
    assert [(f.task_name, f.worker) for f in listed] == [
        ("shop.pay", "w1@h"), ("shop.ship", "w2@h"), ("shop.pay", "w1@h")]
    assert [f.task_id for f in history.failures(3600, 2)] == ["f-3", "f-2"]
    assert [f.task_id for f in history.failures(3600, 10, "shop.pay")] == ["f-3", "f-1"]
    assert [f.task_id for f in history.failures(30 * 86400, 10, "shop.pay")][-1] == "f-old"

    summary = history.summary(3600, 10)
    assert [(s.task_name, s.count) for s in summary] == [("shop.pay", 2), ("shop.ship", 1)]
    assert summary[0].last is not None and summary[0].last.task_id == "f-3"
    assert summary[0].last_done == listed[0].date_done
    assert app.backend.decode(summary[1].last.meta)["result"]["exc_type"] == "KeyError"


def test_without_result_extended_failures_have_no_task_name(app: Celery) -> None:
    fail(app, "f-1", "shop.pay", ValueError("card declined"))
    history = history_of(app)
    (listed,) = history.failures(3600, 10)
    assert (listed.task_id, listed.task_name, listed.worker) == ("f-1", None, None)
    (summary,) = history.summary(3600, 10)
    assert (summary.task_name, summary.count) == (None, 1)
    assert summary.last is not None and summary.last.task_id == "f-1"


def test_a_missing_result_table_is_said_so(app: Celery) -> None:
    store = store_of(app)
    history = History(store.database, store.sql)  # never ensured: no table made
    with pytest.raises(ResultsMissing, match=f"{store.sql.names[0]} does not exist"):
        history.failures(3600, 10)
    with pytest.raises(ResultsMissing):
        history.summary(3600, 10)


def indexes(engine: Engine, table: str) -> set[str]:
    return {str(index["name"]) for index in inspect(engine).get_indexes(table)}


def drop_history_index(engine: Engine, store: ResultStore) -> None:
    name = store.sql.history_index[0]
    table = store.sql.names[0]
    on = f" ON {quoted(engine, table)}" if engine.dialect.name in ("mysql", "mariadb") else ""
    with engine.begin() as conn:
        conn.execute(text(f"DROP INDEX {quoted(engine, name)}{on}"))
    assert name not in indexes(engine, table)


def test_tables_made_before_the_history_index_get_it(
        make_app: MakeApp, engine: Engine, table_prefix: str,
        caplog: pytest.LogCaptureFixture) -> None:
    first = store_of(make_app())
    first.ensure()
    name, table = first.sql.history_index[0], first.sql.names[0]
    assert name in indexes(engine, table)
    drop_history_index(engine, first)
    with first.database.engine.connect() as conn:
        assert history_problems(first.sql, True, conn) == []
        (problem,) = history_problems(first.sql, False, conn)
    assert problem[0] == table and first.sql.history_index[1] in problem[1]

    kept = make_app(options={"create_tables": False})
    with caplog.at_level(logging.WARNING, logger="kombu_sqlinbox.history"):
        store_of(kept).ensure()
    assert name not in indexes(engine, table)
    assert first.sql.history_index[1] in caplog.text

    store_of(make_app(options={"max_result_bytes": 10_000_000})).ensure()  # another store
    assert name in indexes(engine, table)


@pytest.fixture
def writer_url(database: str, db_url: str, table_prefix: str) -> Iterator[str]:
    """A user of this test's own that reads and writes this prefix's result tables (made
    before the history index) but may not change them, as a deployment's worker."""
    admin = create_engine(db_url, isolation_level="AUTOCOMMIT")
    user = f"rw_{uuid.uuid4().hex[:8]}"
    tables = [table_prefix + name for name in RESULT_TABLES]
    mysql = database == "mysql"
    who = f"'{user}'@'%%'" if mysql else user
    with admin.connect() as conn:
        conn.exec_driver_sql(f"CREATE USER {who}" if mysql else f"CREATE ROLE {user} LOGIN")
    store = store_of_url(db_url, table_prefix)
    store.ensure()
    drop_history_index(admin, store)
    with admin.connect() as conn:
        for table in tables:
            conn.exec_driver_sql(f"GRANT SELECT, INSERT, UPDATE, DELETE ON "
                                 f"{quoted(admin, table)} TO {who}")
    try:
        yield make_url(db_url).set(username=user).render_as_string(hide_password=False)
    finally:
        from kombu_sqlinbox import results

        results.close_all()
        with admin.connect() as conn:
            if not mysql:
                conn.exec_driver_sql("SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                                     f" WHERE usename = '{user}'")
                conn.exec_driver_sql(f"DROP OWNED BY {user}")
            conn.exec_driver_sql(f"DROP USER {who}" if mysql else f"DROP ROLE {user}")
        admin.dispose()


def test_a_task_table_kept_beside_a_missing_table_gets_the_history_index(
        make_app: MakeApp, engine: Engine) -> None:
    """Tables made before the chords' counters and the history index: the missing table
    is made, and the kept task table gets its index (MariaDB's CREATE TABLE IF NOT EXISTS
    carries it, and leaves a kept table as it is)."""
    first = store_of(make_app())
    first.ensure()
    drop_history_index(engine, first)
    with engine.begin() as conn:
        conn.execute(text(f"DROP TABLE {quoted(engine, first.sql.names[2])}"))
    store_of(make_app(options={"max_result_bytes": 10_000_000})).ensure()  # another store
    assert first.sql.history_index[0] in indexes(engine, first.sql.names[0])
    assert inspect(engine).has_table(first.sql.names[2])


def store_of_url(db_url: str, prefix: str) -> ResultStore:
    from kombu_sqlinbox.results import store_for

    return store_for("sqlinbox+" + db_url, prefix)


@pytest.mark.parametrize("database", ["postgresql", "mysql"], indirect=True)
def test_a_worker_that_may_not_add_the_history_index_still_stores_results(
        make_app: MakeApp, writer_url: str, engine: Engine,
        caplog: pytest.LogCaptureFixture) -> None:
    """Upgrading a deployment whose workers' user may write results but not create
    indexes: the index is logged as missing (its statement given), results are kept."""
    app = make_app(url="sqlinbox+" + writer_url)
    with caplog.at_level(logging.WARNING, logger="kombu_sqlinbox.history"):
        app.backend.mark_as_done("t-1", 42)
    assert app.AsyncResult("t-1").get(timeout=5) == 42
    store = store_of(app)
    assert store.sql.history_index[1] in caplog.text, caplog.text
    assert store.sql.history_index[0] not in indexes(engine, store.sql.names[0])


def big_insert(database: str, table: str) -> str:
    """One INSERT ... SELECT of :data:`BIG` results: one in a hundred a failure, done
    over the last two days; the rest successes."""
    if database == "mysql":
        n = " + ".join(f"d{k}.d * {10 ** k}" for k in range(6))
        numbers = ", ".join(f"({DIGITS}) AS d{k}" for k in range(6)) + f" LIMIT {BIG}"
        task_id, name, now, meta = (f"CONCAT('t-', {n})", f"CONCAT('task.', ({n}) % 50)",
                                    "UNIX_TIMESTAMP()", "'x'")
        return (f"INSERT INTO {table} (task_id, task_name, date_done, meta, status) "
                f"SELECT {task_id}, {name}, {now} - ({n}) * 7919 % 172800, {meta}, "
                f"CASE WHEN ({n}) % 100 = 0 THEN 'FAILURE' ELSE 'SUCCESS' END "
                f"FROM {numbers}")
    if database == "postgresql":
        numbers, now, meta = (f"generate_series(1, {BIG}) AS s(n)", "EXTRACT(EPOCH FROM now())",
                              "'x'::bytea")
    else:
        numbers = (f"(WITH RECURSIVE s(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM s "
                   f"WHERE n < {BIG}) SELECT n FROM s)")
        now, meta = "CAST(strftime('%s', 'now') AS REAL)", "CAST('x' AS BLOB)"
    return (f"INSERT INTO {table} (task_id, task_name, date_done, meta, status) "
            f"SELECT 't-' || n, 'task.' || (n % 50), {now} - n * 7919 % 172800, {meta}, "
            f"CASE WHEN n % 100 = 0 THEN 'FAILURE' ELSE 'SUCCESS' END FROM {numbers}")


@pytest.mark.parametrize("database", ["postgresql", "mysql", "sqlite"], indirect=True)
def test_failure_listing_reads_the_history_index_on_a_big_table(
        app: Celery, engine: Engine, database: str) -> None:
    store = store_of(app)
    store.ensure()
    table = quoted(engine, store.sql.names[0])
    with engine.begin() as conn:
        conn.execute(text(big_insert(database, table)))
    with engine.begin() as conn:
        conn.execute(text({"postgresql": f"ANALYZE {table}", "mysql": f"ANALYZE TABLE {table}",
                           "sqlite": "ANALYZE"}[database]))
        assert conn.execute(text(f"SELECT COUNT(*) FROM {table}")).scalar_one() == BIG
    dialect, index = store.dialect, store.sql.history_index[0]
    params = {"since": 3600.0, "limit": 20, "task_name": "task.0"}
    for statement in (store.sql.failures, store.sql.task_failures):
        with engine.connect() as conn:
            plan = "\n".join(dialect.plan_lines(conn, dialect.explained(statement), params))
        assert dialect.plan_problem(plan, index) is None, plan
    with engine.connect() as conn:
        plan = "\n".join(dialect.plan_lines(conn, dialect.explained(store.sql.failures_at),
                                            {"last": 0.0}))
    assert index in plan and "Seq Scan" not in plan and "type=ALL" not in plan, plan
    expire = store.sql.expire[0]  # backend_cleanup's batch: by the index on date_done
    with engine.connect() as conn:
        plan = "\n".join(dialect.plan_lines(conn, dialect.explained(expire),
                                            {"expires": 3600.0, "limit": 1000}))
    assert dialect.plan_problem(plan, store.sql.names[0] + "_done") is None, plan
    assert "Hash" not in plan, plan  # PostgreSQL: no hash of the whole table per batch
    history = History(store.database, store.sql)
    listed = history.failures(3600, 20)
    assert listed and all(f.task_name for f in listed)
    assert [f.date_done for f in listed] == sorted((f.date_done for f in listed), reverse=True)
