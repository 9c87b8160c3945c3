"""Fixtures every suite shares: the database under test, unique tables, the processes a
test starts.

A test runs on each database when it uses ``database`` (directly or through ``db_url``,
``engine``...), or on those it names with ``pytest.mark.parametrize("database", ...)``;
the ``databases`` marker and the ``--databases`` option narrow that. A test marked
``drivers`` (it reads what a driver returns) also runs on each driver variant
(``postgresql-psycopg2``, ``mysql-nonstrict``), when ``--databases`` names them: its
``database`` is then the variant's database, and ``db_url`` the variant's URL. Server
URLs and when a server that does not answer skips or fails a test:
:mod:`tests.databases`.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine
from sqlalchemy.engine import Engine

from tests.databases import (
    CONTROLS,
    DATABASES,
    VARIANTS,
    database_of,
    database_url,
    drop_tables,
)
from tests.processes import Processes

FAILED = pytest.StashKey[bool]()

#: pytester runs sample projects; the project's own fixtures (sqlinbox_clock...) serve its
#: tests as they serve a service's
pytest_plugins = ["pytester", "celery_ext.testing"]


@pytest.hookimpl(tryfirst=True)
def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A test marked ``drivers`` runs on every database and variant: the marker becomes
    a parametrisation of ``database`` before the fixture's own applies (a test that
    parametrises ``database`` itself names its variants)."""
    if metafunc.definition.get_closest_marker("drivers") is None or any(
            "database" in parametrized(mark)
            for mark in metafunc.definition.iter_markers("parametrize")):
        return
    if "database" in metafunc.fixturenames:
        metafunc.definition.add_marker(pytest.mark.parametrize(
            "database", (*DATABASES, *VARIANTS), indirect=True))


def parametrized(mark: pytest.Mark) -> list[str]:
    """The argument names a ``parametrize`` mark gives values to."""
    names = mark.args[0] if mark.args else mark.kwargs["argnames"]
    return [name.strip() for name in names.split(",")] if isinstance(names, str) \
        else list(names)


@pytest.fixture(params=DATABASES)
def database(request: pytest.FixtureRequest) -> str:
    """The name of each database in turn (a variant's database on a variant): the
    behaviour suite runs once per database."""
    return database_of(str(request.param))


@pytest.fixture
def db_url(request: pytest.FixtureRequest, database: str,
           tmp_path_factory: pytest.TempPathFactory) -> str:
    """A plain SQLAlchemy URL of the database (or variant) under test (SQLite: a fresh
    file)."""
    return database_url(item_database(request.node) or database,
                        tmp_path_factory.mktemp("sqlite"))


@pytest.fixture
def broker_url(db_url: str) -> str:
    return "sqlinbox+" + db_url


@pytest.fixture
def sqlinbox_url(broker_url: str) -> str:
    """The plugin's inbox (its ``sqlinbox_clock`` above all) on the database under test."""
    return broker_url


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
    from kombu_sqlinbox.brokers import close_all

    close_all()  # no thread of a broker writes to the tables as they are dropped
    drop_tables(engine, prefix)


@pytest.fixture(autouse=True)
def _close_brokers() -> Iterator[None]:
    """Each test starts and ends with no pooled connections left open in this process (the
    brokers' and the result stores')."""
    yield
    from kombu_sqlinbox import results
    from kombu_sqlinbox.brokers import close_all

    close_all()
    results.close_all()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> object:
    report = yield
    if report.failed:
        item.stash[FAILED] = True
    return report


@pytest.fixture(scope="session")
def failed() -> Callable[[pytest.Item], bool]:
    """Whether a test has failed so far (setup, call or teardown): a fixture prints the
    output of the processes it started only for a failed test."""
    return lambda item: item.stash.get(FAILED, False)


@pytest.fixture
def processes(request: pytest.FixtureRequest, tmp_path: Path,
              failed: Callable[[pytest.Item], bool]) -> Iterator[Processes]:
    """The processes this test starts (logs under its ``tmp_path``): killed when it ends,
    their output printed when it failed."""
    made = Processes(tmp_path)
    yield made
    assert isinstance(request.node, pytest.Item)
    made.close(failed(request.node))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--databases", default=",".join((*DATABASES, *CONTROLS)),
        help="comma-separated databases the tests run on (tox runs one per env), the "
             "kombu brokers kombu-level tests also run on as a control, and driver "
             f"variants the tests marked 'drivers' also run on ({', '.join(VARIANTS)})")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "databases(*names): run a test only on these databases (the others lack "
        "what it needs: a connection to break, advisory locks)")
    config.addinivalue_line(
        "markers", "drivers: the test reads what a driver returns or a server's mode lets "
        "through; it also runs on the driver variants (tests.databases.VARIANTS)")


def item_database(item: pytest.Item | pytest.Node) -> str | None:
    """The database (or variant) a collected test runs on: its ``database`` parameter, if
    any."""
    callspec = getattr(item, "callspec", None)
    return None if callspec is None else callspec.params.get("database")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Keep the tests parametrised over the chosen databases and variants (and every other
    test), less those whose ``databases`` marker leaves their database out (deselected,
    not skipped: the test has no meaning there)."""
    chosen = set(str(config.getoption("--databases")).split(","))
    kept, dropped = [], []
    for item in items:
        database = item_database(item)
        marker = item.get_closest_marker("databases")
        wanted = database is None or (
            database in chosen and (marker is None or database_of(database) in marker.args))
        (kept if wanted else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
