"""``sqlinbox failures`` and ``queues``' recent failures, run as a user runs them, on
results written by the app's result backend: listed latest first and per task, with or
without task names, a result table that is not there, a result that does not decode and
a result database that is down each said in one line, never a crash."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
from celery import Celery
from celery.app.task import Context
from sqlalchemy import text
from sqlalchemy.engine import Engine

from celery_ext.results import SqlInboxBackend
from tests.ops.apps import RESULTS_ENV, make_app
from tests.ops.conftest import Cli

Results = Callable[..., Celery]


@pytest.fixture
def with_results(ops_env: dict[str, str], broker_url: str, table_prefix: str) -> Results:
    """The app with its sqlinbox result backend (``given``: :data:`RESULTS_ENV`'s keys),
    the CLI's app the same."""

    def make(**given: object) -> Celery:
        ops_env[RESULTS_ENV] = json.dumps(given)
        return make_app(broker_url, table_prefix, ops_env[RESULTS_ENV])

    return make


def fail(app: Celery, task_id: str, name: str, exc: Exception, worker: str = "w1@h") -> None:
    try:
        raise exc
    except Exception as raised:
        app.backend.mark_as_failure(task_id, raised, request=Context(
            task=name, args=[], kwargs={}, hostname=worker))


def tasks_table(app: Celery) -> str:
    backend = app.backend
    assert isinstance(backend, SqlInboxBackend)
    return backend.store.dialect.quote(backend.store.sql.names[0])


def age(engine: Engine, app: Celery, task_id: str, seconds: float) -> None:
    with engine.begin() as conn:
        conn.execute(text(f"UPDATE {tasks_table(app)} SET date_done = date_done - :s "
                          "WHERE task_id = :t"), {"s": seconds, "t": task_id})


def test_failures_latest_first_and_per_task(cli: Cli, with_results: Results,
                                            engine: Engine) -> None:
    app = with_results(extended=True)
    app.backend.mark_as_done("ok-1", 3, request=Context(task="shop.pay", hostname="w1@h"))
    fail(app, "f-1", "shop.pay", ValueError("card declined"))
    fail(app, "f-2", "shop.ship", KeyError("parcel 7"), worker="w2@h")
    fail(app, "f-3", "shop.pay", RuntimeError("gateway\ndown"))
    fail(app, "f-old", "shop.pay", ValueError("yesterday"))
    for n, task_id in enumerate(["f-1", "f-2", "f-3"]):
        age(engine, app, task_id, 30 - 10 * n)
    age(engine, app, "f-old", 86400)

    out = cli("failures").stdout
    lines = out.splitlines()
    assert lines[0].split() == ["task", "id", "task", "failed", "at", "(UTC)", "exception",
                                "worker"]
    assert [line.split()[0] for line in lines[1:4]] == ["f-3", "f-2", "f-1"]
    assert "RuntimeError: gateway down" in lines[1] and lines[1].endswith("w1@h")
    assert "KeyError: parcel 7" in lines[2] and lines[2].endswith("w2@h")
    assert "f-old" not in out and "result_extended is off" not in out
    per_task = out[out.index("per task, last 1h:"):].splitlines()
    assert per_task[2].split()[:2] == ["shop.pay", "2"], out
    assert per_task[2].endswith("RuntimeError: gateway down")
    assert per_task[3].split()[:2] == ["shop.ship", "1"]

    found = json.loads(cli("failures", "--task", "shop.pay", "--since", "2d", "--limit", "2",
                           "--json").stdout)
    assert [f["task_id"] for f in found["failures"]] == ["f-3", "f-1"]
    assert found["failures"][1]["exception"] == "ValueError: card declined"
    assert found["tasks"] == [{"task": "shop.pay", "failures": 3,
                               "last_failure": found["failures"][0]["date_done"],
                               "last_exception": "RuntimeError: gateway down"}]
    assert found["since_seconds"] == 172800 and found["task_names_stored"] is True

    queues = cli("queues").stdout
    section = queues[queues.index("recent failures (last 1h, "):].splitlines()
    assert section[0].endswith("task_results):"), queues
    assert [line.split()[:2] for line in section[2:]] == [["shop.pay", "2"], ["shop.ship", "1"]]
    assert "recent failures" not in cli("queues", "--json").stdout


def test_without_result_extended_task_names_are_said_unknown(cli: Cli,
                                                             with_results: Results) -> None:
    app = with_results(extended=False)
    fail(app, "f-1", "shop.pay", ValueError("card declined"))
    fail(app, "f-2", "shop.pay", ValueError("a long one " * 30))
    out = cli("failures").stdout
    assert out.startswith("task names are not stored: result_extended is off"), out
    assert "f-1" in out and "ValueError: card declined" in out
    (long,) = [line for line in out.splitlines() if line.startswith("f-2")]
    assert "ValueError: a long one a long one" in long and long.endswith("…  -"), long
    queues = cli("queues").stdout
    assert "result_extended is off" in queues and "\n-  " in queues, queues
    found = json.loads(cli("failures", "--json").stdout)
    assert found["task_names_stored"] is False
    exceptions = {each["task_id"]: each["exception"] for each in found["failures"]}
    assert exceptions["f-2"] == "ValueError: " + ("a long one " * 30).strip()


def test_standalone_reads_the_transport_prefix_as_json(cli: Cli, with_results: Results) -> None:
    fail(with_results(extended=True), "f-1", "shop.pay", ValueError("card declined"))
    out = cli("failures", standalone=True).stdout
    assert "f-1" in out and "shop.pay" in out and "ValueError: card declined" in out, out
    assert "recent failures" not in cli("queues", standalone=True).stdout


def test_a_result_that_does_not_decode_is_shown_undecodable(
        cli: Cli, with_results: Results, engine: Engine) -> None:
    app = with_results(extended=True)
    fail(app, "f-1", "shop.pay", ValueError("card declined"))
    with engine.begin() as conn:
        conn.execute(text(f"UPDATE {tasks_table(app)} SET meta = :m"), {"m": b"\xff{not json"})
    out = cli("failures").stdout
    (row,) = [line for line in out.splitlines() if line.startswith("f-1")]
    assert "undecodable: " in row, out
    assert "undecodable: " in cli("queues").stdout


def test_a_result_table_that_is_not_there_is_one_line(cli: Cli, with_results: Results) -> None:
    with_results(extended=True)  # no result written: no table made
    queues = cli("queues")
    (line,) = [line for line in queues.stdout.splitlines() if "recent failures" in line]
    assert "task_results does not exist" in line, queues.stdout
    done = cli("failures", check=False)
    assert done.returncode == 1 and done.stdout == ""
    (error,) = done.stderr.splitlines()
    assert error.startswith("Error: the result table ") and "does not exist" in error, error


def test_a_result_database_that_is_down_is_one_line(cli: Cli, with_results: Results) -> None:
    """The broker's database answers, the result backend's (another one) does not."""
    with_results(url="sqlinbox+postgresql://root:s3cret@127.0.0.1:1/test")
    done = cli("failures", check=False)
    assert done.returncode == 1 and done.stdout == "", done.stderr
    (line,) = done.stderr.splitlines()
    assert line.startswith("Error: the database postgresql://root:***@127.0.0.1:1/"
                           "test failed: ") and "(--traceback for the details)" in line, line
    assert "s3cret" not in done.stderr
    assert "recent failures" not in cli("queues").stdout  # not the broker's database


def test_check_names_the_history_index_a_kept_table_lacks(
        cli: Cli, with_results: Results, engine: Engine) -> None:
    app = with_results(extended=True, create_tables=False)
    backend = app.backend
    assert isinstance(backend, SqlInboxBackend)
    sql = backend.store.sql
    with engine.begin() as conn:
        for statement in sql.ddl:
            conn.exec_driver_sql(statement)
        table = backend.store.dialect.quote(sql.names[0])
        on = f" ON {table}" if engine.dialect.name in ("mysql", "mariadb") else ""
        conn.exec_driver_sql(f"DROP INDEX {backend.store.dialect.quote(sql.history_index[0])}"
                             f"{on}")
    done = cli("check", check=False)
    assert done.returncode == 1, done.stdout
    assert f"PROBLEM (results) ({sql.names[0]}): no index {sql.history_index[0]}" in (
        done.stdout), done.stdout
    assert sql.history_index[1] + ";" in done.stdout
    with engine.begin() as conn:
        conn.exec_driver_sql(sql.history_index[1])
    assert cli("check").returncode == 0


@pytest.mark.parametrize("given", [["--limit", "9" * 30], ["--since", "9" * 400]])
def test_out_of_range_limits_and_windows_are_usage_errors(cli: Cli, with_results: Results,
                                                          given: list[str]) -> None:
    fail(with_results(extended=True), "f-1", "shop.pay", ValueError("card declined"))
    done = cli("failures", *given, "--json", check=False)
    assert done.returncode == 2 and done.stdout == "", (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr and "Invalid value" in done.stderr, done.stderr


def test_task_names_are_matched_exactly_and_as_stored(cli: Cli, with_results: Results) -> None:
    """A name differing in case only is another task (MariaDB's collation ignores case);
    a name longer than the column holds (MariaDB: 255) is found by its whole name."""
    app = with_results(extended=True)
    long = "shop." + "x" * 300
    fail(app, "f-lower", "shop.pay", ValueError("lower"))
    fail(app, "f-upper", "Shop.Pay", ValueError("upper"))
    fail(app, "f-long", long, ValueError("long"))
    found = json.loads(cli("failures", "--task", "shop.pay", "--json").stdout)
    assert [f["task_id"] for f in found["failures"]] == ["f-lower"], found
    assert [(t["task"], t["failures"]) for t in found["tasks"]] == [("shop.pay", 1)], found
    everything = json.loads(cli("failures", "--json").stdout)
    assert sorted((t["task"], t["failures"]) for t in everything["tasks"])[:2] == [
        ("Shop.Pay", 1), ("shop.pay", 1)], everything
    found = json.loads(cli("failures", "--task", long, "--json").stdout)
    assert [f["task_id"] for f in found["failures"]] == ["f-long"], found
    assert [t["failures"] for t in found["tasks"]] == [1], found
    assert found["tasks"][0]["last_exception"] == "ValueError: long"


def test_a_pickled_exception_of_a_class_not_importable_shows_its_class_and_message(
        cli: Cli, with_results: Results) -> None:
    """Celery stores such an exception (pickle cannot find its class) in a wrapper that
    names it: the wrapper's own name and its fields would hide it."""
    app = with_results(extended=True, serializer="pickle")
    gone = type("InvoiceMissing", (Exception,), {"__module__": "billing.errors"})
    fail(app, "f-1", "shop.pay", gone("order 7", 3))
    found = json.loads(cli("failures", "--json").stdout)
    assert found["failures"][0]["exception"] == "InvoiceMissing: order 7, 3", found
    assert "InvoiceMissing: order 7, 3" in cli("queues").stdout


def test_another_result_backend_is_named_without_its_password(cli: Cli,
                                                               with_results: Results) -> None:
    with_results(url="redis://:s3cret@127.0.0.1:6379/7")
    done = cli("failures", check=False)
    assert done.returncode == 2 and done.stdout == "", done.stderr
    assert "redis://:***@127.0.0.1:6379/7" in done.stderr and "s3cret" not in done.stderr
    queues = cli("queues")
    assert "recent failures" not in queues.stdout and "s3cret" not in queues.stderr
