"""Fixtures every suite shares: the database under test, unique tables, the processes a
test starts.

A test runs on each database when it uses ``database`` (directly or through ``db_url``,
``engine``...), or on those it names with ``pytest.mark.parametrize("database", ...)``;
the ``databases`` marker and the ``--databases`` option narrow that. Server URLs and
when a server that does not answer skips or fails a test: :mod:`tests.databases`.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine
from sqlalchemy.engine import Engine

from tests.databases import CONTROLS, DATABASES, database_url, drop_tables
from tests.processes import Processes

FAILED = pytest.StashKey[bool]()

#: pytester runs sample projects; the project's own fixtures (sqlinbox_clock...) serve its
#: tests as they serve a service's
pytest_plugins = ["pytester", "celery_ext.testing"]


@pytest.fixture(params=DATABASES)
def database(request: pytest.FixtureRequest) -> str:
    """The name of each database in turn: the behaviour suite runs once per database."""
    return str(request.param)


@pytest.fixture
def db_url(database: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A plain SQLAlchemy URL of the database under test (SQLite: a fresh file)."""
    return database_url(database, tmp_path_factory.mktemp("sqlite"))


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
    drop_tables(engine, prefix)


@pytest.fixture(autouse=True)
def _close_brokers() -> Iterator[None]:
    """Each test starts and ends with no pooled connections left open in this process."""
    yield
    from kombu_sqlinbox.broker import close_all

    close_all()


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
        help="comma-separated databases the tests run on (tox runs one per env), and the "
             "kombu brokers kombu-level tests also run on as a control")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "databases(*names): run a test only on these databases (the others lack "
        "what it needs: a connection to break, advisory locks)")


def item_database(item: pytest.Item) -> str | None:
    """The database a collected test runs on: its ``database`` parameter, if any."""
    callspec = getattr(item, "callspec", None)
    return None if callspec is None else callspec.params.get("database")


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
