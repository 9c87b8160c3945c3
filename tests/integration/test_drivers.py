"""The driver matrix itself: each database and variant a test marked ``drivers`` runs on
reaches its database the way its id says (tests/databases.py), in the tests' own
connections and in the transport's."""

from __future__ import annotations

import pytest
from sqlalchemy import text
from sqlalchemy.engine import Engine

from tests.conftest import item_database

from .conftest import Connect
from .support import broker_of

pytestmark = pytest.mark.drivers

DRIVERS = {"postgresql": "psycopg", "postgresql-psycopg2": "psycopg2", "mysql": "pymysql",
           "mysql-nonstrict": "pymysql", "sqlite": "pysqlite"}


def test_each_variant_reaches_its_database_as_its_id_says(
        request: pytest.FixtureRequest, database: str, engine: Engine,
        connect: Connect) -> None:
    variant = item_database(request.node)
    assert variant is not None
    broker = broker_of(connect())
    assert (engine.driver, broker.engine.driver) == (DRIVERS[variant], DRIVERS[variant])
    if database == "mysql":  # what the server's mode lets through: the tests' sessions
        with engine.connect() as conn:
            mode = conn.execute(text("SELECT @@SESSION.sql_mode")).scalar_one()
        assert ("STRICT_TRANS_TABLES" in mode) == (variant == "mysql"), mode
