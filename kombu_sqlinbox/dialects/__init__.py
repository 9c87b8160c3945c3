"""Dialects: one module per database holding every statement it runs."""

from __future__ import annotations

from sqlalchemy.engine import Engine

from ..errors import ConfigurationError
from .base import (
    Capabilities,
    ClaimedRow,
    Dialect,
    RoutingStatements,
    Statements,
    Tokens,
    plain_payload,
)
from .mysql import MySQLDialect
from .postgresql import PostgreSQLDialect
from .sqlite import SQLiteDialect

__all__ = [
    "Capabilities", "ClaimedRow", "Dialect", "MySQLDialect", "PostgreSQLDialect",
    "RoutingStatements", "SQLiteDialect", "Statements", "Tokens", "dialect_class", "dialect_for",
    "plain_payload", "register",
]

_REGISTRY: dict[str, type[Dialect]] = {}


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
        raise ConfigurationError(
            f"no kombu-sqlinbox dialect for database {name!r}; "
            "subclass kombu_sqlinbox.dialects.Dialect and register() it"
        ) from None


def dialect_for(engine: Engine) -> Dialect:
    return dialect_class(engine.dialect.name)(engine)
