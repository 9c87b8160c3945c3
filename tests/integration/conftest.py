"""Fixtures of the behaviour suite (the database fixtures live in tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kombu import Connection

import kombu_sqlinbox  # noqa: F401  (registers the sqlinbox alias)

Connect = Callable[..., Connection]


@pytest.fixture
def connect(broker_url: str, table_prefix: str) -> Iterator[Connect]:
    """Open kombu connections on the database under test, inside this test's table prefix.

    Keyword arguments are transport options. Connections with equal options share
    one per-process broker (one keeper); different options give different brokers.
    """
    opened: list[Connection] = []

    def open_connection(**options: Any) -> Connection:
        transport_options = {"table_prefix": table_prefix, "polling_interval": 0.05, **options}
        conn = Connection(broker_url, transport_options=transport_options)
        opened.append(conn)
        return conn

    yield open_connection
    for conn in reversed(opened):
        conn.release()
