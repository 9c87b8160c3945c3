"""A worker that cannot start for a user's mistake says so in one line and exits 1: the
mistake named (with the closest option for a typo), no traceback of Celery's start-up.
An unreachable database is retried as Celery retries any broker, then given up in two
lines. ``-l debug`` keeps the traceback."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from sqlalchemy.engine import make_url

from tests.acceptance.conftest import Acceptance
from tests.processes import START_LIMIT, wait_until
from tests.tcp_proxy import Proxy

APP = '''from celery import Celery
app = Celery("app", broker={broker!r})
app.conf.broker_transport_options = {options!r}
app.conf.broker_connection_retry_on_startup = True
app.conf.broker_connection_max_retries = 1
app.conf.update({conf!r})
'''
SECRET = "s3cret-never-shown"


@pytest.mark.parametrize(("broker", "options", "said"), [
    ("sqlinbox+sqlite:///{tmp}/q.db", {"visiblity_timeout": 5},
     "Error: unknown transport option 'visiblity_timeout'; did you mean "
     "'visibility_timeout'?"),
    ("sqlinbox+sqlite:///{tmp}/q.db", {"queues": {"celery": {"max_atempts": 3}}},
     "Error: unknown transport option \"queues['celery'].max_atempts\"; did you mean "
     "'max_attempts'?"),
    ("sqlinbox+sqlite:///{tmp}/q.db", {"polling_interval": 0},
     "Error: transport option polling_interval=0:"),
])
def test_a_worker_with_a_configuration_mistake_says_it_in_one_line(
        tmp_path: Path, broker: str, options: dict[str, object], said: str) -> None:
    (tmp_path / "app.py").write_text(APP.format(broker=broker.format(tmp=tmp_path),
                                                options=options, conf={}))
    done = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "app", "worker", "--pool", "solo"],
        cwd=tmp_path, capture_output=True, text=True, timeout=START_LIMIT,
        env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and errors[0].startswith(said), done.stderr


def dead_port() -> int:
    """A port of this host nothing listens on (one just freed by the system)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def start_worker(tmp_path: Path, broker: str, options: dict[str, object], *args: str,
                 conf: dict[str, object] | None = None, celery: tuple[str, ...] = ()
                 ) -> subprocess.CompletedProcess[str]:
    """A real ``celery worker`` of an app on ``broker`` (``conf``: more Celery settings;
    ``celery``: options of the ``celery`` command), run until it exits by itself."""
    (tmp_path / "app.py").write_text(APP.format(broker=broker, options=options, conf=conf or {}))
    return subprocess.run(
        [sys.executable, "-m", "celery", *celery, "-A", "app", "worker", "--pool", "solo",
         "--without-gossip", "--without-mingle", "--without-heartbeat", *args],
        cwd=tmp_path, capture_output=True, text=True, timeout=START_LIMIT,
        env={**os.environ, "PYTHONPATH": str(tmp_path)})


#: a broker URL nothing answers at, and what the driver says of it
UNREACHABLE: dict[str, tuple[Callable[[Path], str], str]] = {
    "postgresql": (lambda tmp: f"sqlinbox+postgresql://app:{SECRET}@127.0.0.1:{dead_port()}"
                               "/test", "Connection refused"),
    "mysql": (lambda tmp: f"sqlinbox+mysql+pymysql://app:{SECRET}@127.0.0.1:{dead_port()}"
                          "/test", "Connection refused"),
    # the servers here trust every password of a known PostgreSQL user: an unknown one
    "postgresql-unknown-user": (lambda tmp: f"sqlinbox+postgresql://nobody:{SECRET}@127.0.0.1"
                                            "/test", 'role "nobody" does not exist'),
    "postgresql-unknown-database": (
        lambda tmp: f"sqlinbox+postgresql://root:{SECRET}@127.0.0.1/no_such_db",
        'database "no_such_db" does not exist'),
    "mysql-wrong-password": (lambda tmp: f"sqlinbox+mysql+pymysql://root:{SECRET}@127.0.0.1"
                                         "/test", "Access denied for user 'root'"),
    "mysql-unknown-database": (lambda tmp: "sqlinbox+mysql+pymysql://root@127.0.0.1/no_such_db",
                               "Unknown database 'no_such_db'"),
    "sqlite-no-directory": (lambda tmp: f"sqlinbox+sqlite:///{tmp}/missing/q.db",
                            "unable to open database file"),
    "sqlite-under-a-file": (lambda tmp: f"sqlinbox+sqlite:///{tmp}/app.py/q.db",
                            "unable to open database file"),
}


@pytest.mark.parametrize("kind", UNREACHABLE)
def test_a_worker_whose_database_is_unreachable_retries_then_says_it_in_two_lines(
        tmp_path: Path, kind: str) -> None:
    url, reason = UNREACHABLE[kind]
    broker = url(tmp_path)
    shown = broker.replace(SECRET, "**")
    done = start_worker(tmp_path, broker, {}, "-l", "info")
    out = done.stderr + done.stdout
    assert done.returncode == 1, out
    assert "Traceback" not in out and SECRET not in out, out
    # Celery's retries stay (broker_connection_max_retries = 1): the driver's reason, one line
    retried = [line for line in out.splitlines() if "consumer: Cannot connect to" in line]
    assert len(retried) == 1 and all(f"{shown}: " in line and reason in line
                                     for line in retried), out
    assert "Trying again in 2.00 seconds... (1/1)" in out, out
    # then two lines: what is wrong (the URL with its password masked), what to do
    last, advice = done.stderr.rstrip().splitlines()[-2:]  # the log; the banner: stdout
    assert (f"CRITICAL/MainProcess] cannot connect to the broker database {shown}: "
            in last and reason in last), out
    assert advice.startswith("Check that the database server is running" if "sqlite" not in kind
                             else "Check that the file's directory exists"), out
    assert advice.endswith("(-l debug shows the traceback)"), out


@pytest.mark.parametrize("level", ["warning", "ERROR"])
def test_a_worker_logging_above_info_stops_in_the_same_two_lines(tmp_path: Path,
                                                                level: str) -> None:
    url, reason = UNREACHABLE["postgresql"]
    done = start_worker(tmp_path, url(tmp_path), {}, "-l", level)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    last, advice = done.stderr.rstrip().splitlines()[-2:]
    assert "cannot connect to the broker database" in last and reason in last, done.stderr
    assert advice.endswith("(-l debug shows the traceback)"), done.stderr


@pytest.mark.parametrize("kind", ["postgresql", "sqlite-no-directory"])
def test_a_worker_logging_at_debug_shows_the_traceback(tmp_path: Path, kind: str) -> None:
    url, reason = UNREACHABLE[kind]
    done = start_worker(tmp_path, url(tmp_path), {}, "-l", "debug")
    out = done.stderr + done.stdout
    assert done.returncode == 1, out
    assert "Unrecoverable error" in out and "Traceback (most recent call last)" in out, out
    assert "DatabaseUnreachable" in out and reason in out and SECRET not in out, out


#: a URL of each kind of database (none need answer: the engine is refused before)
ANY_DATABASE = {
    "postgresql": lambda tmp: f"sqlinbox+postgresql://app:{SECRET}@127.0.0.1:{dead_port()}/test",
    "mysql": lambda tmp: f"sqlinbox+mysql+pymysql://app:{SECRET}@127.0.0.1:{dead_port()}/test",
    "sqlite": lambda tmp: f"sqlinbox+sqlite:///{tmp}/q.db",
}


@pytest.mark.parametrize("kind", ANY_DATABASE)
def test_a_misspelled_engine_option_stops_the_worker_in_one_line(tmp_path: Path,
                                                                  kind: str) -> None:
    """Found before the worker starts (create_engine connects to nothing), not when it
    first connects."""
    done = start_worker(tmp_path, ANY_DATABASE[kind](tmp_path),
                        {"engine_options": {"pool_pre_pingg": True}}, "-l", "info")
    assert_stopped_in_one_line(done, "Error: unknown transport option \"engine_options["
                               "'pool_pre_pingg']\"; did you mean 'pool_pre_ping'?")
    assert "TypeError" not in done.stderr


def test_an_engine_option_of_the_wrong_kind_stops_the_worker_in_one_line(
        tmp_path: Path) -> None:
    """A value ``create_engine()`` cannot use (a pool class by its name) is the user's
    mistake, not a bug: SQLAlchemy's AttributeError was an 80-line traceback."""
    done = start_worker(tmp_path, f"sqlinbox+sqlite:///{tmp_path}/q.db",
                        {"engine_options": {"poolclass": "NullPool"}}, "-l", "info")
    assert_stopped_in_one_line(done, "Error: transport option engine_options: create_engine() "
                               "refused it (AttributeError: ")


def assert_stopped_in_one_line(done: subprocess.CompletedProcess[str], *said: str) -> None:
    """The worker exited 1 before it started (no banner), the mistake in one line holding
    each of ``said``, no traceback, no password."""
    out = done.stderr + done.stdout
    assert done.returncode == 1, out
    assert "Traceback" not in out and SECRET not in out, out
    assert done.stdout == "", out  # Celery's banner: nothing started
    errors = [line for line in done.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and all(part in errors[0] for part in said), out
    assert done.stderr.rstrip().endswith(errors[0]), out


#: broker URLs wrong in themselves (no server need answer), and what the line says
WRONG_URLS: dict[str, tuple[str, tuple[str, ...]]] = {
    "driver-not-installed": (
        f"sqlinbox+postgresql+pg8000://app:{SECRET}@127.0.0.1/test",
        ("names the driver 'pg8000', which is not installed", "pip install pg8000")),
    "mysqlclient-not-installed": (
        f"sqlinbox+mysql+mysqldb://app:{SECRET}@127.0.0.1/test",
        ("names the driver 'mysqldb', which is not installed", "pip install mysqlclient")),
    "sqlite-in-memory": (
        "sqlinbox+sqlite://",
        ("'sqlite://' names an SQLite database in memory",
         "use a file: sqlinbox+sqlite:///jobs.db")),
    "sqlite-memory-named": (
        "sqlinbox+sqlite:///:memory:",
        ("'sqlite:///:memory:' names an SQLite database in memory",
         "use a file")),
    "failover-second": (
        f"sqlinbox+postgresql://app:{SECRET}@127.0.0.1/test;sqlinbox+sqlite://",
        ("'sqlite://' names an SQLite database in memory",)),
    "not-a-url": (
        f"sqlinbox+postgresql//app:{SECRET}@127.0.0.1/test",
        ("broker URL 'sqlinbox+postgresql//app:***@127.0.0.1/test' is not an SQLAlchemy "
         "URL", "write e.g. sqlinbox+postgresql://user@host/db")),
    "one-slash": (
        f"sqlinbox+postgresql:/app:{SECRET}@127.0.0.1/test",
        ("broker URL 'sqlinbox+postgresql:***@127.0.0.1/test' is not an SQLAlchemy URL",)),
    "no-scheme": (
        "sqlinbox+jobs.db",
        ("broker URL 'sqlinbox+jobs.db' is not an SQLAlchemy URL",)),
    "unknown-database": (
        f"sqlinbox+postgressql://app:{SECRET}@127.0.0.1/test",
        ("no kombu-sqlinbox dialect for database 'postgressql'; did you mean "
         "'postgresql'?",)),
}


@pytest.mark.parametrize("kind", WRONG_URLS)
def test_a_worker_with_a_wrong_broker_url_says_it_in_one_line(tmp_path: Path,
                                                              kind: str) -> None:
    broker, said = WRONG_URLS[kind]
    assert_stopped_in_one_line(start_worker(tmp_path, broker, {}, "-l", "info"), *said)


@pytest.mark.parametrize("given", ["-b", "broker_read_url"])
def test_a_wrong_url_given_on_the_command_line_or_for_reading_is_found_too(
        tmp_path: Path, given: str) -> None:
    """``celery -b URL`` (Celery reads it from the environment) and
    ``broker_read_url`` stand in for the app's ``broker_url``."""
    broker, said = WRONG_URLS["sqlite-in-memory"]
    good = f"sqlinbox+sqlite:///{tmp_path}/q.db"
    done = (start_worker(tmp_path, good, {}, "-l", "info", celery=("-b", broker))
            if given == "-b" else
            start_worker(tmp_path, good, {}, "-l", "info", conf={"broker_read_url": broker}))
    assert_stopped_in_one_line(done, *said)


@pytest.mark.parametrize(("broker", "options", "said"), [
    ("sqlite://", {}, "'sqlite://' names an SQLite database in memory"),
    ("sqlite:///{tmp}/q.db", {"engine_options": {"pool_pre_pingg": True}},
     "did you mean 'pool_pre_ping'?"),
], ids=["url", "engine-option"])
def test_a_transport_named_by_its_class_is_checked_too(
        tmp_path: Path, broker: str, options: dict[str, object], said: str) -> None:
    """The getting-started guide's other way: a plain SQLAlchemy URL, and the transport
    named by ``broker_transport``."""
    done = start_worker(tmp_path, broker.format(tmp=tmp_path), options, "-l", "info",
                        conf={"broker_transport": "kombu_sqlinbox.transport:Transport"})
    assert_stopped_in_one_line(done, said)


def test_a_configuration_mistake_at_debug_shows_its_traceback(tmp_path: Path) -> None:
    done = start_worker(tmp_path, WRONG_URLS["not-a-url"][0], {}, "-l", "DEBUG")
    assert done.returncode == 1, done.stderr
    assert "Traceback (most recent call last)" in done.stderr, done.stderr
    assert "ConfigurationError" in done.stderr and SECRET not in done.stderr, done.stderr
    assert done.stderr.rstrip().splitlines()[-1].startswith("Error: broker URL"), done.stderr


@pytest.mark.parametrize("conf", [
    {}, {"worker_pool_putlocks": True}, {"worker_prefetch_multiplier": 0},
], ids=["default", "putlocks", "no-prefetch-limit"])
@pytest.mark.parametrize(("options", "said"), [
    ({"visiblity_timeout": 5},
     "Error: unknown transport option 'visiblity_timeout'; did you mean 'visibility_timeout'?"),
    ({"engine_options": {"pool_pre_pingg": True}},
     "Error: unknown transport option \"engine_options['pool_pre_pingg']\"; did you mean "
     "'pool_pre_ping'?"),
], ids=["option", "engine-option"])
def test_a_configuration_mistake_is_found_before_the_worker_starts_whatever_its_settings(
        tmp_path: Path, conf: dict[str, object], options: dict[str, object], said: str
) -> None:
    """The check runs whatever the worker's settings (the pool-wait hook reads the options
    only for some), and under ``celery -q`` (no banner, which also reads them)."""
    done = start_worker(tmp_path, f"sqlinbox+sqlite:///{tmp_path}/q.db", options, "-l", "info",
                        conf=conf, celery=("-q",))
    assert_stopped_in_one_line(done, said)


@pytest.mark.parametrize("kind", ["postgresql", "sqlite-no-directory"])
def test_a_worker_told_not_to_retry_says_why_in_two_lines(tmp_path: Path, kind: str) -> None:
    """Celery's own line says only that retrying is disabled, not what failed."""
    url, reason = UNREACHABLE[kind]
    broker = url(tmp_path)
    done = start_worker(tmp_path, broker, {}, "-l", "info",
                        conf={"broker_connection_retry_on_startup": False})
    out = done.stderr + done.stdout
    assert done.returncode == 1, out
    assert "Traceback" not in out and SECRET not in out and "Trying again" not in out, out
    last, advice = done.stderr.rstrip().splitlines()[-2:]
    assert (f"CRITICAL/MainProcess] cannot connect to the broker database "
            f"{broker.replace(SECRET, '**')}: " in last and reason in last), out
    assert "broker_connection_retry_on_startup is False" in advice, out
    assert advice.endswith("(-l debug shows the traceback)"), out


@pytest.mark.slow
@pytest.mark.databases("postgresql", "mysql")  # a database file has no connection to break
def test_a_database_lost_while_the_worker_runs_is_reconnected_as_before(
        acceptance: Acceptance, db_url: str) -> None:
    """The one-line stop is for a worker that never connected: one that loses its
    database goes on retrying, each attempt logged as Celery logs it, and runs tasks
    again once the database is back."""
    target = make_url(db_url)
    proxy = Proxy(str(target.host), int(target.port or 0))
    try:
        worker = acceptance.worker("solo", name="w1", broker_url="sqlinbox+" + proxy.url(db_url))
        with proxy.refuse():
            wait_until(lambda: "consumer: Cannot connect to" in worker.output(), 60,
                       "a failed reconnect", alive=[worker])
        acceptance.send("acc.run", ["after"])
        wait_until(lambda: acceptance.runs.done()["after"], 60,
                   "a task once the database is back", alive=[worker])
        out = worker.output()
        assert "Connection to broker lost" in out and "Trying again in" in out, out
        assert "cannot connect to the broker database" not in out, out
        assert "-l debug shows the traceback" not in out, out
        assert worker.stop() == 0, worker.tail()
    finally:
        proxy.close()


@pytest.mark.databases("postgresql", "mysql")
def test_a_worker_whose_first_failover_url_is_down_runs_on_the_next(
        acceptance: Acceptance, db_url: str) -> None:
    down = make_url(db_url).set(port=dead_port()).render_as_string(hide_password=False)
    worker = acceptance.worker("solo", name="w1",
                               broker_url=f"sqlinbox+{down};{acceptance.broker_url}")
    acceptance.send("acc.run", ["failover"])
    wait_until(lambda: acceptance.runs.done()["failover"], 60, "the task to run",
               alive=[worker])
    out = worker.output()
    assert "Will retry using next failover." in out, out
    assert worker.stop() == 0, worker.tail()
