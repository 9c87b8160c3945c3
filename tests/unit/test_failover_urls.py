"""Broker URLs as kombu hands them over. kombu's failover parses an alternate URL itself
and looks its whole scheme up as a transport name: every ``sqlinbox+<dialect>[+<driver>]``
scheme resolves to the transport, which puts the parsed URL back together (and refuses,
at start-up, what the failover could not pass on); a URL naming no driver takes an
installed one."""

from __future__ import annotations

import sys

import pytest
from kombu import Connection
from kombu.transport import resolve_transport

import kombu_sqlinbox  # noqa: F401  (registers the aliases)
from kombu_sqlinbox.dialects import url_schemes
from kombu_sqlinbox.errors import ConfigurationError
from kombu_sqlinbox.transport import Transport


@pytest.mark.parametrize("scheme", ["postgresql", "postgresql+psycopg", "postgresql+psycopg2",
                                    "postgres", "postgres+psycopg2", "mysql+pymysql",
                                    "mariadb+pymysql", "sqlite+pysqlite"])
def test_every_dialect_and_driver_scheme_names_the_transport(scheme: str) -> None:
    assert scheme in url_schemes()
    assert resolve_transport(f"sqlinbox+{scheme}") is Transport


@pytest.mark.parametrize("alternate, url", [
    ("sqlinbox+postgresql+psycopg://app:p%40ss@db-b:5439/jobs",
     "postgresql+psycopg://app:p%40ss@db-b:5439/jobs"),
    ("sqlinbox+mysql+pymysql://root@127.0.0.1/test", "mysql+pymysql://root@127.0.0.1/test"),
    ("sqlinbox+sqlite:////var/lib/app/jobs.db", "sqlite:////var/lib/app/jobs.db"),
    ("sqlinbox+postgresql://db-b", "postgresql://db-b"),
])
def test_a_switched_to_alternate_gives_back_its_sqlalchemy_url(alternate: str, url: str) -> None:
    conn = Connection(f"sqlinbox+postgresql://db-a/jobs;{alternate}")
    assert conn.transport.url == "postgresql://db-a/jobs"
    conn.switch(conn.alt[1])
    assert isinstance(conn.transport, Transport)
    assert conn.transport.url == url


def test_a_dialect_sqlalchemy_does_not_ship_has_its_bare_scheme(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from kombu_sqlinbox import dialects

    monkeypatch.setitem(dialects._REGISTRY, "nosuchdb", dialects.SQLiteDialect)
    assert "nosuchdb" in url_schemes()


@pytest.mark.parametrize("broker", [
    "sqlinbox+postgresql://db-a/jobs;sqlinbox+postgresql://db-b/jobs?sslmode=require",
    "sqlinbox+postgresql://db-a/jobs?connect_timeout=3;sqlinbox+postgresql://db-b/jobs",
    # kombu would take this one for its own SSL settings and drop it
    "sqlinbox+postgresql://db-a/jobs;sqlinbox+postgresql://db-b/jobs?ssl_ca=/etc/ca.pem",
])
def test_failover_urls_with_a_query_string_are_refused_at_start_up(broker: str) -> None:
    """kombu's failover passes an alternate's query string on as its own connection
    arguments: the switch would fail (or lose the setting) only when the first database
    fails, so the transport refuses the URLs when it is made, before any connection."""
    conn = Connection(broker)
    with pytest.raises(ConfigurationError, match=r"query string.*engine_options"):
        conn.transport  # noqa: B018  (made on first use)


def test_a_single_url_keeps_its_query_string() -> None:
    conn = Connection("sqlinbox+postgresql://db-a/jobs?sslmode=require")
    assert conn.transport.url == "postgresql://db-a/jobs?sslmode=require"


def test_a_bare_mysql_url_takes_pymysql_where_it_stands_in_for_mysqldb(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``pymysql.install_as_MySQLdb()`` (Django sites without mysqlclient): the URL takes
    PyMySQL under its own name, the driver the transport's publish path is tuned for."""
    import pymysql

    from kombu_sqlinbox.urls import sqlalchemy_url

    monkeypatch.setitem(sys.modules, "MySQLdb", pymysql)
    assert sqlalchemy_url("mysql://root@db/app").drivername == "mysql+pymysql"
