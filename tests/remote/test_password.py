"""The database password of the broker URL is shown nowhere: not in what ``celery inspect``
answers (``stats`` is what Flower's worker page shows), not in the worker's log, not in
the ``sqlinbox`` commands' output, not in an error.

PostgreSQL, as a role of the test's own with a password (the server here trusts local
connections, so any password is accepted: what matters is what is shown).
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest
from kombu import Connection
from sqlalchemy import create_engine
from sqlalchemy.engine import make_url

from kombu_sqlinbox.errors import ConfigurationError
from kombu_sqlinbox.transport import Transport
from tests.databases import require_server
from tests.processes import wait_until
from tests.remote.conftest import COMMAND_LIMIT, EXAMPLE, HOST, Cluster, at_once

#: a password no output may contain (URL-quoted where it stands in a URL)
SECRET = f"Pw-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def role_url() -> Iterator[str]:
    """A plain PostgreSQL URL of a role of this test's own, with :data:`SECRET` as its
    password; the role and everything it owns are dropped afterwards."""
    server = make_url(require_server("postgresql"))
    role = f"pw_{uuid.uuid4().hex[:8]}"
    admin = create_engine(server, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.exec_driver_sql(f"CREATE ROLE {role} LOGIN PASSWORD '{SECRET}'")
        conn.exec_driver_sql(f"GRANT USAGE, CREATE ON SCHEMA public TO {role}")
    try:
        yield server.set(username=role, password=SECRET).render_as_string(hide_password=False)
    finally:
        from kombu_sqlinbox.brokers import close_all

        close_all()
        with admin.connect() as conn:
            conn.exec_driver_sql(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = "
                f"'{role}'")
            conn.exec_driver_sql(f"DROP OWNED BY {role}")
            conn.exec_driver_sql(f"DROP ROLE {role}")
        admin.dispose()


def assert_hidden(*outputs: str) -> None:
    for output in outputs:
        assert SECRET not in output, output


def test_the_connection_reports_its_url_without_the_password(role_url: str) -> None:
    """What Celery reads off the connection to show (``info()`` less its password field,
    which Celery leaves out, and ``as_uri()``) has no password, while the transport
    still connects with it."""
    conn = Connection("sqlinbox+" + role_url)
    assert_hidden(conn.info()["hostname"], conn.as_uri(), repr(conn))
    assert conn.as_uri(include_password=True) == "sqlinbox+" + role_url
    assert isinstance(conn.transport, Transport)
    assert conn.transport.url == role_url
    assert conn.clone().transport.url == role_url
    conn.ensure_connection(max_retries=1)
    conn.release()


def test_a_password_given_apart_from_the_url_is_connected_with() -> None:
    """Celery's ``broker_password`` setting comes as the connection's password field."""
    conn = Connection("sqlinbox+postgresql://app@db/jobs", password=SECRET)
    assert conn.transport.url == f"postgresql://app:{SECRET}@db/jobs"
    assert_hidden(conn.as_uri(), conn.info()["hostname"])


def test_an_url_is_shown_whole_but_for_its_password() -> None:
    """Only the password is masked: an ``@`` further on (a query value) is kept."""
    conn = Connection(f"sqlinbox+postgresql://app:{SECRET}@db:5432/app?application_name=ops@db")
    shown = make_url(conn.as_uri().removeprefix("sqlinbox+"))
    assert (shown.password, shown.host, shown.port, shown.database, dict(shown.query)) == (
        "**", "db", 5432, "app", {"application_name": "ops@db"})


def test_a_user_and_password_given_apart_from_the_url_are_connected_with() -> None:
    """Celery's ``broker_user`` and ``broker_password`` settings, for a URL with neither."""
    conn = Connection("sqlinbox+postgresql://db/jobs", userid="app", password=SECRET)
    assert conn.transport.url == f"postgresql://app:{SECRET}@db/jobs"
    assert_hidden(conn.as_uri(), conn.info()["hostname"])


def test_a_connection_without_an_url_is_shown_and_refused_when_it_connects() -> None:
    conn = Connection(hostname="db", transport="sqlinbox")
    assert repr(conn).startswith("<Connection: sqlinbox+db at ")
    with pytest.raises(ConfigurationError, match="needs an SQLAlchemy URL"):
        conn.ensure_connection(max_retries=1)


@pytest.mark.parametrize("url", [f"postgresql://app:{SECRET}@db:notaport/jobs",
                                 f"post gres://app:{SECRET}@db/jobs",
                                 # written without percent-encoding: '/' and '@' in it
                                 f"postgresql://app:{SECRET}/x@db:notaport/jobs",
                                 f"postgresql://app:x@{SECRET}@db:notaport/jobs"],
                         ids=["port", "scheme", "slash", "at"])
def test_an_url_that_is_not_sqlalchemy_is_refused_without_its_password(url: str) -> None:
    conn = Connection("sqlinbox+" + url)
    with pytest.raises(ConfigurationError, match="not an SQLAlchemy URL") as raised:
        conn.ensure_connection(max_retries=1)
    assert_hidden(str(raised.value), conn.as_uri())


@pytest.mark.slow
def test_inspect_logs_commands_and_errors_show_no_password(
        role_url: str, tmp_path: Path) -> None:
    cluster = Cluster("postgresql", "sqlinbox+" + role_url, f"r{uuid.uuid4().hex[:8]}_",
                      tmp_path)
    cluster.names = [f"a@{HOST}"]
    failed = True
    try:
        cluster.workers = cluster.start_workers(["a"])
        stats, report, conf = at_once([partial(cluster.inspect, command)
                                       for command in ("stats", "report", "conf")])
        broker = stats[cluster.names[0]]["broker"]
        assert broker["transport"] == "sqlinbox", broker
        assert make_url(broker["hostname"]).username == make_url(role_url).username, broker
        assert_hidden(repr(stats), repr(report), repr(conf))

        task_id = cluster.send("add", 1, 2)
        queues = cluster.celery("sqlinbox", "queues")
        check = cluster.celery("sqlinbox", "check", check=False)
        assert_hidden(queues.stdout, queues.stderr, check.stdout, check.stderr)
        assert task_id

        # errors: a database that does not exist, from the command line and a worker
        missing = role_url.replace("/test", "/no_such_database")
        command = subprocess.run(
            [sys.executable, "-m", "celery", "-A", "monitor_app", "sqlinbox", "--url",
             missing, "queues"], cwd=EXAMPLE, capture_output=True, text=True,
            timeout=COMMAND_LIMIT, env={**os.environ, **cluster.env,
                                        "MONITOR_BROKER": "sqlinbox+" + missing})
        assert command.returncode != 0
        assert_hidden(command.stdout, command.stderr)
        stranded = cluster.spawn("stranded", "worker", "-l", "info", "-n", "stranded@%h",
                                 "--without-gossip", "--without-mingle",
                                 MONITOR_BROKER="sqlinbox+" + missing)
        wait_until(lambda: "Cannot connect to" in stranded.output(), COMMAND_LIMIT,
                   "the worker to report it cannot connect")
        stranded.kill()
        assert_hidden(stranded.output())

        cluster.workers[0].stop()
        assert_hidden(cluster.workers[0].output())
        failed = False
    finally:
        cluster.close(failed)


#: a password with every character a URL gives a meaning to (quoted in the URL); no
#: non-ASCII letter: PyMySQL's authentication does not match MariaDB's hash of one
SPECIAL = f"{SECRET}@:/?#%; ["


@pytest.fixture
def mariadb_user() -> Iterator[tuple[str, str]]:
    """A MariaDB user of this test's own whose password is :data:`SPECIAL` (MariaDB here
    checks passwords: a wrong or missing one is refused), and its URL without the
    password; dropped afterwards."""
    server = make_url(require_server("mysql"))
    user = f"pw_{uuid.uuid4().hex[:8]}"
    admin = create_engine(server, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.exec_driver_sql(f"CREATE USER '{user}'@'%%' IDENTIFIED BY %s", (SPECIAL,))
        conn.exec_driver_sql(f"GRANT ALL ON `{server.database}`.* TO '{user}'@'%%'")
    try:
        yield user, server.set(username=user).render_as_string(hide_password=False)
    finally:
        from kombu_sqlinbox.brokers import close_all

        close_all()
        with admin.connect() as conn:
            conn.exec_driver_sql(f"DROP USER '{user}'@'%%'")
        admin.dispose()


def with_password(url: str) -> str:
    return make_url(url).set(password=SPECIAL).render_as_string(hide_password=False)


def sqlinbox_command(broker: str, *args: str, password: str | None = None,
                     ) -> subprocess.CompletedProcess[str]:
    """``celery -A tests.ops.apps sqlinbox ARGS`` on ``broker`` (``broker_password`` set
    to ``password``), as an operator runs it."""
    from tests.ops.apps import BROKER_ENV, PASSWORD_ENV, PREFIX_ENV
    from tests.processes import ROOT

    env = {**os.environ, BROKER_ENV: broker, PREFIX_ENV: f"t{uuid.uuid4().hex[:8]}_",
           "PYTHONPATH": str(ROOT)}
    if password is not None:
        env[PASSWORD_ENV] = password
    return subprocess.run([sys.executable, "-m", "celery", "-A", "tests.ops.apps",
                           "sqlinbox", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=COMMAND_LIMIT)


def test_a_password_with_url_characters_reaches_the_database(
        mariadb_user: tuple[str, str]) -> None:
    """Quoted in the URL, or given as ``broker_password`` (with ``broker_user``): the
    server accepts it."""
    user, url = mariadb_user
    for conn in (Connection("sqlinbox+" + with_password(url)),
                 Connection("sqlinbox+" + url, password=SPECIAL),
                 Connection("sqlinbox+" + url.replace(f"{user}@", ""), userid=user,
                            password=SPECIAL)):
        conn.ensure_connection(max_retries=1)
        broker = conn.default_channel.broker
        assert broker.run(lambda db: db.exec_driver_sql("SELECT CURRENT_USER()").scalar(),
                          read_only=True).startswith(f"{user}@")
        with conn.SimpleQueue(f"pw_{uuid.uuid4().hex[:8]}") as queue:
            queue.put({"n": 1})
            assert queue.get(timeout=10).payload == {"n": 1}
            queue.queue.delete()
        assert_hidden(conn.as_uri(), repr(conn))
        conn.release()


def test_the_sqlinbox_commands_connect_with_broker_password(
        mariadb_user: tuple[str, str]) -> None:
    """``celery -A proj sqlinbox`` connects as the worker does: with Celery's
    ``broker_password`` where the URL has none."""
    _, url = mariadb_user
    done = sqlinbox_command("sqlinbox+" + url, "queues", password=SPECIAL)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("queue "), done.stdout


def test_the_sqlinbox_commands_take_the_first_of_failover_urls(
        mariadb_user: tuple[str, str]) -> None:
    """A broker URL with failover URLs (``;``-separated, each with its password): the
    commands work on the first, as the worker starts on it, and show no password."""
    _, url = mariadb_user
    first = with_password(url)
    standby = with_password(url.replace("127.0.0.1", "localhost"))
    done = sqlinbox_command(f"sqlinbox+{first};sqlinbox+{standby}", "queues")
    assert_hidden(done.stdout, done.stderr)
    assert done.returncode == 0, done.stderr


def test_the_engine_is_given_the_password_as_written(role_url: str) -> None:
    """PostgreSQL here trusts local connections: what reaches the driver is read off the
    engine. A non-ASCII letter too (psycopg passes it on as UTF-8)."""
    password = SPECIAL + "ä"
    for conn in (Connection("sqlinbox+" + make_url(role_url).set(password=password)
                            .render_as_string(hide_password=False)),
                 Connection("sqlinbox+" + role_url.replace(f":{SECRET}@", "@"),
                            password=password)):
        conn.ensure_connection(max_retries=1)
        assert conn.default_channel.broker.engine.url.password == password
        assert_hidden(conn.as_uri(), repr(conn))
        conn.release()
