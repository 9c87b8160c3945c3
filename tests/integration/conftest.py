"""Fixtures of the behaviour suite (the database fixtures live in tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kombu import Connection
from sqlalchemy.engine import make_url

import kombu_sqlinbox  # noqa: F401  (registers the sqlinbox alias)
from kombu_sqlinbox.database import Database
from tests.tcp_proxy import Proxy

Connect = Callable[..., Connection]


def connections(broker_url: str, table_prefix: str) -> Iterator[Connect]:
    """Open kombu connections to ``broker_url`` inside ``table_prefix`` until the test
    ends, then release them (keyword arguments are transport options)."""
    opened: list[Connection] = []

    def open_connection(**options: Any) -> Connection:
        transport_options = {"table_prefix": table_prefix, "polling_interval": 0.05, **options}
        conn = Connection(broker_url, transport_options=transport_options)
        opened.append(conn)
        return conn

    yield open_connection
    for conn in reversed(opened):
        conn.release()


@pytest.fixture
def connect(broker_url: str, table_prefix: str) -> Iterator[Connect]:
    """Open kombu connections on the database under test, inside this test's table prefix.

    Keyword arguments are transport options. Connections with equal options share
    one per-process broker (one keeper); different options give different brokers.
    """
    yield from connections(broker_url, table_prefix)


@pytest.fixture
def proxy(db_url: str) -> Iterator[Proxy]:
    """A TCP proxy in front of the server under test, to break connections on purpose."""
    target = make_url(db_url)
    made = Proxy(str(target.host), int(target.port or 0))
    yield made
    made.close()


@pytest.fixture
def driver_url(db_url: str, driver: str) -> str:
    """The PostgreSQL URL through ``driver`` (a test parametrized over :data:`.support.DRIVERS`)."""
    return make_url(db_url).set(drivername=f"postgresql+{driver}").render_as_string(
        hide_password=False)


@pytest.fixture
def pooled(driver_url: str) -> Iterator[Database]:
    """A database of one pooled connection through ``driver``: every run takes the same one."""
    database = Database.open(driver_url, pool_size=1, max_overflow=0)
    yield database
    database.dispose()
