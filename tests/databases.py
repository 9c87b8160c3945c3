"""The databases the tests run on: their names, the URL a test uses for each, and tables
to drop.

Server URLs come from the environment (defaults are the local services):
``SQLINBOX_TEST_POSTGRES``, ``SQLINBOX_TEST_MYSQL``. Outside CI a server that does not
answer skips its tests with what to start; with ``CI=true`` it fails them.

A PostgreSQL URL naming no driver takes psycopg 3 when it is installed (as in the test
extras; psycopg2 otherwise): the suite reads PostgreSQL through psycopg 3. What a driver
returns (a BYTEA, a JSON column, a timestamp) and what a server's mode lets through
differ, so tests marked ``drivers`` also run on the :data:`VARIANTS`: psycopg2, and
MariaDB sessions in a non-strict ``sql_mode``.
"""

from __future__ import annotations

import contextlib
import os
import re
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sqlalchemy import Connection, TextClause, create_engine, inspect, text
from sqlalchemy.engine import Engine, make_url

from kombu_sqlinbox.broker import Broker
from kombu_sqlinbox.tables import TableSpec
from tests.servers import server_answers

POSTGRES_URL = os.environ.get("SQLINBOX_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/test")
MYSQL_URL = os.environ.get("SQLINBOX_TEST_MYSQL", "mysql+pymysql://root@127.0.0.1:3306/test")
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

SERVERS = {
    "postgresql": (POSTGRES_URL, "start PostgreSQL (pg_ctlcluster 15 main start) or set "
                   "SQLINBOX_TEST_POSTGRES"),
    "mysql": (MYSQL_URL, "start MariaDB/MySQL (mariadbd) or set SQLINBOX_TEST_MYSQL"),
}
#: every database, in the order a test parametrised over them runs
DATABASES = ("postgresql", "mysql", "sqlite")
#: a database reached otherwise, as ``<database>-<what differs>``: a test marked
#: ``drivers`` runs on these too (``--databases`` names them to run them)
VARIANTS = ("postgresql-psycopg2", "mysql-nonstrict")
#: what a MariaDB/MySQL server that is not strict runs its sessions in (no STRICT_*:
#: a value a column cannot hold is truncated or converted with a warning, not refused);
#: set per session, never on the shared server
NONSTRICT_SQL_MODE = "NO_ENGINE_SUBSTITUTION"
#: kombu's own brokers, the control a kombu-level test also runs on (same test bodies)
CONTROL_URLS = {
    "redis": os.environ.get("SQLINBOX_TEST_REDIS", "redis://127.0.0.1:6379/7"),
    "rabbitmq": os.environ.get("SQLINBOX_TEST_AMQP", "amqp://guest:guest@127.0.0.1:5672//"),
}
CONTROLS = tuple(CONTROL_URLS)

_ANSWERS: dict[str, str | None] = {}


def require_server(name: str) -> str:
    """The URL of the server ``name`` once it answers (asked once per session); when it does
    not, skip the test saying what to start, or fail it in CI."""
    url, hint = SERVERS[name]
    return _require(name, url, server_answers, hint)


def require_control(name: str) -> str:
    """The broker URL of the control ``name`` once it answers, as :func:`require_server`."""
    return _require(name, CONTROL_URLS[name], broker_answers, "start it")


def broker_answers(url: str) -> str | None:
    """None when the kombu broker answers, else the error text."""
    from kombu import Connection

    try:
        with Connection(url, connect_timeout=2) as conn:
            conn.ensure_connection(max_retries=1)
        return None
    except Exception as exc:  # any failure to connect means "not there"
        return str(exc).splitlines()[0]


def _require(name: str, url: str, answers: Callable[[str], str | None], hint: str) -> str:
    if name not in _ANSWERS:
        _ANSWERS[name] = answers(url)
    problem = _ANSWERS[name]
    if problem is not None:
        message = f"{name} at {url} does not answer ({problem}): {hint}"
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)
    return url


def database_of(name: str) -> str:
    """The database of a name of :data:`DATABASES` or :data:`VARIANTS`."""
    return name.partition("-")[0]


def database_url(name: str, tmp: Path, file: str = "inbox.db") -> str:
    """The plain SQLAlchemy URL a test uses for the database ``name`` (or a variant): the
    shared server, or for SQLite a file ``file`` in the test's directory ``tmp``. A
    variant's URL says what differs, so every process the test starts (a worker, the
    operations commands) reaches the database the same way."""
    if name == "sqlite":
        return f"sqlite:///{tmp}/{file}"
    url = require_server(database_of(name))
    if name in DATABASES:
        return url
    if name == "postgresql-psycopg2":
        variant = make_url(url).set(drivername="postgresql+psycopg2")
    elif name == "mysql-nonstrict":  # PyMySQL runs init_command first on each connection
        variant = make_url(url).update_query_dict(
            {"init_command": f"SET SESSION sql_mode = '{NONSTRICT_SQL_MODE}'"})
    else:
        raise ValueError(f"no database or variant {name!r}")
    return variant.render_as_string(hide_password=False)


def drop_tables(engine: Engine, prefix: str) -> None:
    """Drop every table whose name starts with ``prefix``."""
    with engine.begin() as conn:
        quote = conn.dialect.identifier_preparer.quote
        for name in inspect(conn).get_table_names():
            if name.startswith(prefix):
                conn.execute(text(f"DROP TABLE IF EXISTS {quote(name)}"))


@contextlib.contextmanager
def snapshot_held(engine: Engine, database: str) -> Iterator[None]:
    """A session idle in a transaction that has read (on PostgreSQL also taken an xid), for
    as long as the block runs: what keeps vacuum (InnoDB purge) from removing rows deleted
    meanwhile. ``engine`` must be in autocommit mode: the transaction is begun by hand."""
    with engine.connect() as conn:
        if database == "postgresql":
            conn.exec_driver_sql("BEGIN ISOLATION LEVEL REPEATABLE READ")
            conn.exec_driver_sql("SELECT txid_current(), count(*) FROM pg_class").all()
        else:
            conn.exec_driver_sql("START TRANSACTION WITH CONSISTENT SNAPSHOT")
            conn.exec_driver_sql("SELECT COUNT(*) FROM information_schema.tables").all()
        try:
            yield
        finally:
            conn.exec_driver_sql("ROLLBACK")


def pages_read(conn: Connection, database: str, broker: Broker, spec: TableSpec,
               statement: TextClause, floor: float) -> tuple[int, str]:
    """Buffers (PostgreSQL) or pages (MariaDB) ``statement`` reads with ``floor``, from the
    database's own account of running it (rolled back), and its plan, which must take
    the rows from the claim index."""
    prefix = "EXPLAIN (ANALYZE, BUFFERS)" if database == "postgresql" else "ANALYZE FORMAT=JSON"
    analysed = text(f"{prefix} {statement.text.removeprefix('EXPLAIN ')}").bindparams(
        *statement._bindparams.values())
    params = {"limit": 8, "lease": 30, "floor": floor, "candidates": 16, "skip": ["elsewhere"]}
    plan = "\n".join(str(row[0]) for row in conn.execute(analysed, params))
    conn.rollback()
    assert broker.dialect.index_name(spec).strip('"`') in plan, plan
    if database == "postgresql":  # the top node's buffers hold its children's
        hit = re.search(r"Buffers: shared hit=(\d+)(?: read=(\d+))?", plan)
        assert hit is not None, plan
        return int(hit[1]) + int(hit[2] or 0), plan
    return sum(int(n) for n in re.findall(r'"pages_accessed": (\d+)', plan)), plan


@contextlib.contextmanager
def fresh_database(kind: str, tmp: Path) -> Iterator[str]:
    """An SQLAlchemy URL of an empty database of its own on the server, dropped afterwards
    (SQLite: a new file in ``tmp``), for a test whose processes use default table names."""
    if kind == "sqlite":
        yield database_url(kind, tmp, "fresh.db")
        return
    server = make_url(require_server(kind))
    if kind == "postgresql":
        server = server.set(drivername="postgresql+psycopg")
    name = f"sqlinbox_fresh_{uuid.uuid4().hex[:8]}"
    admin = create_engine(server, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.exec_driver_sql(f"CREATE DATABASE {name}")
    try:
        yield server.set(database=name).render_as_string(hide_password=False)
    finally:
        force = " WITH (FORCE)" if kind == "postgresql" else ""
        with admin.connect() as conn:
            conn.exec_driver_sql(f"DROP DATABASE IF EXISTS {name}{force}")
        admin.dispose()
