"""Dialects: one module per database holding every statement it runs."""

from __future__ import annotations

from difflib import get_close_matches
from importlib import import_module
from importlib.metadata import entry_points
from inspect import ismodule

from sqlalchemy.engine import Engine

from ..errors import ConfigurationError
from .base import (
    Capabilities,
    ClaimedRow,
    Dialect,
    LimitedClaim,
    LimitStatements,
    PauseStatements,
    RateStatements,
    ResultStatements,
    RoutingStatements,
    RowsInsert,
    ScheduleStatements,
    Statements,
    ThroughputStatements,
    Tokens,
    UniqueStatements,
    plain_payload,
)
from .mysql import MySQLDialect
from .postgresql import PostgreSQLDialect
from .sqlite import SQLiteDialect

__all__ = [
    "SPELLINGS", "Capabilities", "ClaimedRow", "Dialect", "LimitStatements", "LimitedClaim",
    "MySQLDialect", "PauseStatements", "PostgreSQLDialect", "RateStatements",
    "ResultStatements", "RoutingStatements", "RowsInsert", "SQLiteDialect",
    "ScheduleStatements", "Statements", "ThroughputStatements", "Tokens", "UniqueStatements",
    "dialect_class", "dialect_for", "plain_payload", "register", "url_schemes",
]

_REGISTRY: dict[str, type[Dialect]] = {}
#: other names URLs give a registered dialect: ``postgres://``, the ``DATABASE_URL`` of
#: Heroku and many other hosts, which SQLAlchemy no longer reads as PostgreSQL
SPELLINGS = {"postgres": "postgresql"}


def register(dialect: type[Dialect]) -> type[Dialect]:
    """Make a dialect class serve the SQLAlchemy dialect names it lists (usable as decorator)."""
    for name in dialect.names:
        _REGISTRY[name] = dialect
    return dialect


for _builtin in (PostgreSQLDialect, MySQLDialect, SQLiteDialect):
    register(_builtin)


def dialect_class(name: str) -> type[Dialect]:
    """The registered dialect for an SQLAlchemy dialect name."""
    try:
        return _REGISTRY[name]
    except KeyError:
        close = get_close_matches(name, [*_REGISTRY, *SPELLINGS], n=1)
        hint = (f"did you mean {close[0]!r}?" if close else
                "subclass kombu_sqlinbox.dialects.Dialect and register() it")
        raise ConfigurationError(
            f"no kombu-sqlinbox dialect for database {name!r}; {hint}") from None


def dialect_for(engine: Engine) -> Dialect:
    return dialect_class(engine.dialect.name)(engine)


def url_schemes() -> list[str]:
    """Every SQLAlchemy URL scheme of a registered dialect: ``<dialect>`` and
    ``<dialect>+<driver>`` for each driver SQLAlchemy ships or a package registers, under
    each of its :data:`SPELLINGS` too."""
    schemes = set()
    for name in _REGISTRY:
        schemes.add(name)
        try:
            package = import_module(
                f"sqlalchemy.dialects.{'mysql' if name == 'mariadb' else name}")
        except ModuleNotFoundError:  # a dialect SQLAlchemy does not ship: its plugin's drivers
            continue
        schemes.update(f"{name}+{driver}" for driver, module in vars(package).items()
                       if ismodule(module) and hasattr(module, "dialect") and driver != "base")
    for plugin in entry_points(group="sqlalchemy.dialects"):
        name, _, driver = plugin.name.partition(".")
        if name in _REGISTRY and driver:
            schemes.add(f"{name}+{driver}")
    for spelling, name in SPELLINGS.items():
        schemes.update(spelling + scheme[len(name):] for scheme in list(schemes)
                       if scheme.partition("+")[0] == name)
    return sorted(schemes)
