"""Errors the transport raises on its own account (driver errors pass through)."""

from __future__ import annotations


class SqlInboxError(Exception):
    """Base of every error raised by kombu-sqlinbox itself."""


class ConfigurationError(SqlInboxError, ValueError):
    """A setting, declaration or queue name is not usable; raised at start-up."""


class SchemaMismatch(ConfigurationError):
    """A queue table does not match its declaration; the message carries the fixing DDL."""


class MessageTooLarge(SqlInboxError):
    """A message is larger than the database accepts in one statement."""
