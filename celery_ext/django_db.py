"""Django's database connections as SQLAlchemy sees them: the URL of a ``DATABASES``
entry, and an SQLAlchemy Connection over Django's own DBAPI connection.

Apart from :mod:`celery_ext.django` and below :mod:`celery_ext.binding`, which binds
Django's connection like a Session: the Django package builds on the binding, and the
binding on this module, one way. Django itself is imported only where it is used.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from weakref import WeakKeyDictionary

from sqlalchemy import Connection, create_engine
from sqlalchemy.engine import URL, Engine
from sqlalchemy.pool import StaticPool

__all__ = ["broker_url", "database_url", "is_django_connection", "sqlalchemy_connection"]

#: Django's database engine module -> SQLAlchemy backend name
BACKENDS = {"postgresql": "postgresql", "sqlite3": "sqlite", "mysql": "mysql"}
#: the DBAPI module a Django backend runs on -> SQLAlchemy's driver name for it
#: (PyMySQL's connections are its own, also where it stands in for MySQLdb)
DRIVERS = {"psycopg": "psycopg", "psycopg2": "psycopg2", "sqlite3": "pysqlite",
           "MySQLdb": "mysqldb", "pymysql": "pymysql"}


def is_django_connection(target: Any) -> bool:
    """Whether ``target`` is one of Django's database connections (``django.db.connection``)."""
    return hasattr(target, "settings_dict") and hasattr(target, "alias")


def database_url(database: str | Mapping[str, Any] = "default",
                 driver: str | None = None) -> URL:
    """The SQLAlchemy URL of a database of Django's ``DATABASES``: its alias, or its entry
    (in the settings module, before the settings are ready)."""
    where = f"DATABASES[{database!r}]" if isinstance(database, str) else "a DATABASES entry"
    if isinstance(database, str):
        from django.conf import settings

        entry: Mapping[str, Any] = settings.DATABASES[database]
    else:
        entry = database
    vendor = entry["ENGINE"].rsplit(".", 1)[-1]
    backend = BACKENDS.get(vendor)
    if backend is None:
        raise ValueError(f"{where}: no sqlinbox broker for {entry['ENGINE']}")
    if backend == "sqlite":
        return URL.create(f"sqlite+{driver}" if driver else "sqlite", database=str(entry["NAME"]))
    port = entry.get("PORT")
    return URL.create(f"{backend}+{driver}" if driver else backend,
                      username=entry.get("USER") or None,
                      password=entry.get("PASSWORD") or None,
                      host=entry.get("HOST") or None, port=int(port) if port else None,
                      database=entry.get("NAME"))


def broker_url(database: str | Mapping[str, Any] = "default") -> str:
    """``CELERY_BROKER_URL`` for the inbox in a database of ``DATABASES`` (alias or entry)."""
    return "sqlinbox+" + database_url(database).render_as_string(hide_password=False)


#: per Django connection: the DBAPI connection an engine was made over, and the engine
_ENGINES: WeakKeyDictionary[Any, tuple[Any, Engine]] = WeakKeyDictionary()


def _never_ends(dbapi_connection: Any) -> None:
    """Django begins, commits and rolls back its own transactions."""


def sqlalchemy_connection(connection: Any) -> Connection:
    """An SQLAlchemy Connection over Django's DBAPI connection, in Django's transaction: its
    engine never commits or rolls back (Django does) and never closes the connection."""
    from django.db import connections

    connection = connections[connection.alias]  # this thread's, behind django.db.connection
    connection.ensure_connection()
    raw = connection.connection
    found = _ENGINES.get(connection)
    if found is None or found[0] is not raw:
        driver = DRIVERS[type(raw).__module__.split(".")[0]]
        engine = create_engine(database_url(connection.alias, driver),
                               creator=lambda: raw, poolclass=StaticPool,
                               pool_reset_on_return=None)
        engine.dialect.do_commit = _never_ends  # type: ignore[method-assign]
        engine.dialect.do_rollback = _never_ends  # type: ignore[method-assign]
        found = _ENGINES[connection] = (raw, engine)
    return found[1].connect()
