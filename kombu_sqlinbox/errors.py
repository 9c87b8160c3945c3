"""Errors the transport raises on its own account (driver errors pass through)."""

from __future__ import annotations

import click


class SqlInboxError(Exception):
    """Base of every error raised by kombu-sqlinbox itself."""


class ConfigurationError(SqlInboxError, ValueError, click.ClickException):
    """A setting, declaration or queue name is not usable; raised at start-up.

    A :class:`click.ClickException` too, so that ``celery worker`` (a click command) and
    every other command print its message on one line and exit 1: a user's mistake, not
    a bug, which a traceback of Celery's start-up would bury."""

    def __init__(self, message: str) -> None:
        click.ClickException.__init__(self, message)


class SchemaMismatch(ConfigurationError):
    """A queue table does not match its declaration; the message carries the fixing DDL."""


class MessageTooLarge(SqlInboxError):
    """A message is larger than the database accepts in one statement."""
