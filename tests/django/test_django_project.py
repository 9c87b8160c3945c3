"""The sample Django site (examples/django_project) runs its own tests, by pytester in a
pytest of their own, on SQLite and on PostgreSQL: orders and their tasks commit or roll
back with ``transaction.atomic()``, the outbox's send waits for ``on_commit``, and the
migrations create and drop the inbox's and outbox's tables."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest
from sqlalchemy import create_engine, inspect, text
from sqlalchemy.engine import make_url

from tests.databases import require_server
from tests.docs.support import EXAMPLES
from tests.processes import ROOT, Processes, wait_until

SITE = EXAMPLES / "django_project"


@pytest.fixture
def site_database(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """The site's database: a new SQLite file, or a new database on the PostgreSQL or
    MariaDB server (Django's own tables must not meet another test's). MariaDB's is
    reached as most Django sites reach it without mysqlclient: PyMySQL installed as
    MySQLdb (the site's settings do it)."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'site.sqlite3'}"
        return
    server = make_url(require_server(request.param))
    name = f"site_{uuid.uuid4().hex[:10]}"
    quote = '"' if request.param == "postgresql" else "`"
    admin = create_engine(server, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f"CREATE DATABASE {quote}{name}{quote}"))
    yield server.set(drivername=request.param, database=name).render_as_string(
        hide_password=False)
    with admin.connect() as conn:
        if request.param == "mysql":  # the sessions a killed worker left are ended first
            for (pid,) in conn.execute(text(
                    "SELECT id FROM information_schema.processlist WHERE db = :name"),
                    {"name": name}).all():
                conn.execute(text(f"KILL {int(pid)}"))
            conn.execute(text(f"DROP DATABASE `{name}`"))
        else:
            conn.execute(text(f'DROP DATABASE "{name}" WITH (FORCE)'))
    admin.dispose()


@pytest.mark.parametrize("site_database", ["sqlite", "postgresql", "mysql"], indirect=True)
def test_the_site_tests_pass(site_database: str, pytester: pytest.Pytester,
                             monkeypatch: pytest.MonkeyPatch) -> None:
    shutil.copytree(SITE, pytester.path, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("*.sqlite3", "__pycache__"))
    monkeypatch.setenv("SHOP_DATABASE", site_database)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=27)


@pytest.mark.parametrize("site_database", ["sqlite", "postgresql", "mysql"], indirect=True)
def test_a_worker_runs_on_what_migrate_created(
        site_database: str, tmp_path: Path, processes: Processes) -> None:
    """The site runs with ``create_tables: False``: after ``manage.py migrate``, a real
    worker starts (its remote-control queue needs the routing tables), answers a ping,
    runs a task sent through the app and, with its embedded database scheduler, a
    periodic task added as the admin adds one; nothing creates a table after
    ``migrate``: the database's tables are the same before and after the worker ran."""
    site = tmp_path / "site"
    shutil.copytree(SITE, site, ignore=shutil.ignore_patterns("*.sqlite3", "__pycache__"))
    env = {"SHOP_DATABASE": site_database, "DJANGO_SETTINGS_MODULE": "shopsite.settings",
           "PYTHONPATH": os.pathsep.join((str(site), str(ROOT)))}
    run = partial(subprocess.run, cwd=site, env={**os.environ, **env}, capture_output=True,
                  text=True, timeout=120)
    migrated = run([sys.executable, "manage.py", "migrate"])
    assert migrated.returncode == 0, migrated.stdout + migrated.stderr
    migrated_tables = tables(site_database)
    made = {"sqlinbox_celery", "sqlinbox_queues", "sqlinbox_bindings", "shop_outbox",
            "sqlinbox_schedules", "sqlinbox_schedule_ticks"}
    assert made <= migrated_tables, migrated_tables
    scheduled = run([sys.executable, "-c", SCHEDULE])
    assert scheduled.returncode == 0, scheduled.stdout + scheduled.stderr

    worker = processes.worker("shopsite", env=env, pool="solo", args=[
        "-B", "--scheduler", "celery_ext.beat:DatabaseScheduler"])
    asked = run([sys.executable, "-c", ASK])
    assert asked.returncode == 0, asked.stdout + asked.stderr
    assert asked.stdout.split() == ["create_tables=False", "pong", "ran"], asked.stdout
    wait_until(lambda: "reserved stock for order 7" in worker.output(), 30,
               "the worker to log the task's result", alive=[worker])
    wait_until(lambda: "reserved stock for order 99" in worker.output(), 30,
               "the worker to run the periodic task", alive=[worker])
    worker.stop()
    assert tables(site_database) == migrated_tables


def tables(site_database: str) -> set[str]:
    """The tables of the site's database, read through the drivers the suite reads with
    (the site's own URL names none: Django picks its backend from the scheme)."""
    url = make_url(site_database)
    drivers = {"postgresql": "postgresql+psycopg", "mysql": "mysql+pymysql"}
    engine = create_engine(url.set(drivername=drivers.get(url.drivername, url.drivername)))
    try:
        with engine.connect() as conn:
            return set(inspect(conn).get_table_names())
    finally:
        engine.dispose()


#: a periodic task added through the admin's schedules
SCHEDULE = """
import django

django.setup()
from celery_ext.django.admin import schedules

schedules().add("stock-check", "orders.tasks.reserve_stock", 1.0, args=[99])
"""

#: what a client of the site asks a worker: a ping, then a task (its result in the log)
ASK = """
import socket

import shopsite
from orders.tasks import reserve_stock

options = shopsite.celery_app.conf.broker_transport_options
print(f"create_tables={options['create_tables']}")

replies = shopsite.celery_app.control.ping([f"w1@{socket.gethostname()}"], timeout=10)
print("pong" if replies and "pong" in str(replies) else f"no pong: {replies!r}")
reserve_stock.delay(7)
print("ran")
"""


def test_the_site_takes_a_percent_encoded_password_as_its_password() -> None:
    """``SHOP_DATABASE`` is a URL: a password with ``@`` or ``/`` comes percent-encoded,
    and Django (and the broker URL made from ``DATABASES``) must get it decoded."""
    from tests.docs.support import load_example

    settings = load_example("django_project/shopsite/settings.py")
    entry = settings.database("postgresql://shop%20app:p%40ss%2Fw%3Ard@db:5432/shop")
    assert (entry["USER"], entry["PASSWORD"]) == ("shop app", "p@ss/w:rd")
    broker = make_url(settings.celery_ext.django.broker_url(entry).removeprefix("sqlinbox+"))
    assert (broker.username, broker.password) == ("shop app", "p@ss/w:rd")
