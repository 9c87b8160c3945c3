"""Shared fixtures: real databases, unique queues, clean tables.

Server URLs come from the environment (defaults are the local services):
``SQLINBOX_TEST_POSTGRES``, ``SQLINBOX_TEST_MYSQL``. Outside CI a database that
does not answer skips its tests with what to start; with ``CI=true`` it fails.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest
from sqlalchemy import create_engine, inspect, text
from sqlalchemy.engine import Engine

from tests.servers import server_answers

POSTGRES_URL = os.environ.get("SQLINBOX_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/test")
MYSQL_URL = os.environ.get("SQLINBOX_TEST_MYSQL", "mysql+pymysql://root@127.0.0.1:3306/test")
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

SERVERS = {
    "postgresql": (POSTGRES_URL, "start PostgreSQL (pg_ctlcluster 15 main start) or set "
                   "SQLINBOX_TEST_POSTGRES"),
    "mysql": (MYSQL_URL, "start MariaDB/MySQL (mariadbd) or set SQLINBOX_TEST_MYSQL"),
}
DATABASES = ("postgresql", "mysql", "sqlite")


_ANSWERS: dict[str, str | None] = {}


def require_server(name: str) -> str:
    url, hint = SERVERS[name]
    if name not in _ANSWERS:
        _ANSWERS[name] = server_answers(url)
    problem = _ANSWERS[name]
    if problem is not None:
        message = f"{name} at {url} does not answer ({problem}): {hint}"
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)
    return url


@pytest.fixture(params=DATABASES)
def database(request: pytest.FixtureRequest) -> str:
    """The name of each database in turn: the behaviour suite runs once per database."""
    return str(request.param)


@pytest.fixture
def db_url(database: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A plain SQLAlchemy URL of the database under test (SQLite: a fresh file)."""
    if database == "sqlite":
        return f"sqlite:///{tmp_path_factory.mktemp('sqlite')}/inbox.db"
    return require_server(database)


@pytest.fixture
def broker_url(db_url: str) -> str:
    return "sqlinbox+" + db_url


@pytest.fixture
def engine(db_url: str) -> Iterator[Engine]:
    from kombu_sqlinbox.broker import sqlalchemy_url

    made = create_engine(sqlalchemy_url(db_url))
    yield made
    made.dispose()


@pytest.fixture
def table_prefix(engine: Engine) -> Iterator[str]:
    """A prefix no other test uses; every table carrying it is dropped afterwards."""
    prefix = f"t{uuid.uuid4().hex[:8]}_"
    yield prefix
    drop_tables(engine, prefix)


def drop_tables(engine: Engine, prefix: str) -> None:
    with engine.begin() as conn:
        quote = conn.dialect.identifier_preparer.quote
        for name in inspect(conn).get_table_names():
            if name.startswith(prefix):
                conn.execute(text(f"DROP TABLE IF EXISTS {quote(name)}"))


@pytest.fixture(autouse=True)
def _close_brokers() -> Iterator[None]:
    """Each test starts and ends with no pooled connections left open in this process."""
    yield
    from kombu_sqlinbox.broker import close_all

    close_all()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--databases", default=",".join(DATABASES),
        help="comma-separated databases the behaviour suite runs on (tox runs one per env)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "databases(*names): run a test only on these databases (the others lack "
        "what it needs: a connection to break, advisory locks)")


def item_database(item: pytest.Item) -> str | None:
    """The database a collected test runs on: its ``database`` parameter, or the first
    half of a transactional ``service`` (database, pool) parameter."""
    callspec = getattr(item, "callspec", None)
    if callspec is None:
        return None
    service = callspec.params.get("service")
    return callspec.params.get("database") or (service[0] if service else None)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Keep the tests parametrised over the chosen databases (and every other test), less
    those whose ``databases`` marker leaves their database out (deselected, not skipped:
    the test has no meaning there)."""
    chosen = set(str(config.getoption("--databases")).split(","))
    kept, dropped = [], []
    for item in items:
        database = item_database(item)
        marker = item.get_closest_marker("databases")
        wanted = database is None or (
            database in chosen and (marker is None or database in marker.args))
        (kept if wanted else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
