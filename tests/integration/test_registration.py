"""How a Celery app selects the transport: the alias, or broker_transport with a plain URL."""

from __future__ import annotations

import pytest
from celery import Celery
from kombu import Connection
from sqlalchemy.engine import make_url

from kombu_sqlinbox.errors import ConfigurationError
from kombu_sqlinbox.transport import Transport

from .support import get_within, publish


def test_the_sqlinbox_alias_selects_the_transport(broker_url: str, table_prefix: str) -> None:
    app = Celery("alias", broker=broker_url,
                 broker_transport_options={"table_prefix": table_prefix})
    with app.connection_for_write() as conn:
        assert isinstance(conn.transport, Transport)
        publish(conn, "jobs", {"n": 1})
        assert get_within(conn, "jobs").payload == {"n": 1}


def test_broker_transport_with_a_plain_sqlalchemy_url(db_url: str, table_prefix: str) -> None:
    # kombu reads "scheme+driver://" as "transport+url", so a plain URL names no driver:
    # the transport then takes whichever supported driver is installed
    app = Celery("plain", broker=db_url.replace("+pymysql", ""))
    app.conf.broker_transport = "kombu_sqlinbox.transport:Transport"
    app.conf.broker_transport_options = {"table_prefix": table_prefix}
    with app.connection_for_write() as conn:
        assert isinstance(conn.transport, Transport)
        publish(conn, "jobs", {"n": 2})
        assert get_within(conn, "jobs").payload == {"n": 2}


def test_an_unknown_transport_option_is_an_error_naming_it(broker_url: str) -> None:
    with pytest.raises(ConfigurationError, match="visibilty_timeout"):
        Connection(broker_url, transport_options={"visibilty_timeout": 5}).connect()


def test_a_url_that_is_not_sqlalchemy_is_refused_clearly() -> None:
    with pytest.raises(ConfigurationError, match="SQLAlchemy URL"):
        Connection("sqlinbox://", transport_options={}).connect()


@pytest.mark.databases("postgresql")
@pytest.mark.parametrize("scheme", ["postgres", "postgres+psycopg2", "POSTGRES",
                                    "PostgreSQL+Psycopg2"])
def test_the_postgres_spelling_reaches_postgresql(db_url: str, table_prefix: str,
                                                  scheme: str) -> None:
    # Heroku and many other hosts give DATABASE_URL as postgres://; a URL's scheme is
    # case-insensitive
    url = make_url(db_url).set(drivername=scheme).render_as_string(hide_password=False)
    app = Celery("heroku", broker=f"sqlinbox+{url}",
                 broker_transport_options={"table_prefix": table_prefix})
    with app.connection_for_write() as conn:
        assert conn.default_channel.broker.engine.dialect.name == "postgresql"
        publish(conn, "jobs", {"n": 3})
        assert get_within(conn, "jobs").payload == {"n": 3}
