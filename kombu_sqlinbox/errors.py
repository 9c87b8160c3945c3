"""Errors the transport raises on its own account (driver errors pass through)."""

from __future__ import annotations

import click
from kombu.exceptions import EncodeError


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


class DuplicateTask(SqlInboxError):
    """A publish with a unique key another row of the queue holds: nothing was written.
    ``task_id`` is the holder's (None where its envelope names none); Celery's
    ``celery_ext.unique.UniqueTask`` returns its ``AsyncResult`` instead of raising."""

    def __init__(self, queue: str, key: str, task_id: str | None) -> None:
        super().__init__(f"queue {queue!r}: unique key {key[:80]!r} is held by task {task_id}")
        self.queue, self.key, self.task_id = queue, key, task_id


class ResultTooLarge(SqlInboxError, EncodeError):
    """A task's result (with its meta) is larger than the result table's column or the
    server's statement limit accepts. An ``EncodeError``: Celery's worker then stores
    the task as failed with this error, which ``AsyncResult.get()`` raises."""


class ResultIdRefused(SqlInboxError, ValueError):
    """A task or group id the result tables cannot key: refused as the task is sent (its
    result could never be stored, ``get()`` would wait for it in vain); a worker given
    one by a producer that did not check runs the task and logs that its result is not
    stored."""


class ResultIdTooLong(ResultIdRefused):
    """A task or group id longer than the result tables' key holds."""


class DatabaseUnreachable(SqlInboxError):
    """The broker's database cannot be connected to (a server down or elsewhere, refused
    credentials, an SQLite file that cannot be opened). A connection error: kombu and
    Celery retry it as they retry any broker; its message is the driver's reason, one line.
    """

    def __init__(self, url: str, reason: str, server: bool = True) -> None:
        super().__init__(reason)
        #: the broker URL, its password masked
        self.url = url
        #: whether a server is connected to (not an SQLite file)
        self.server = server

    def advice(self) -> str:
        """What a user checks: the mistake is theirs or their server's, not a bug."""
        if self.server:
            return ("Check that the database server is running and that the URL's host, "
                    "port, database name, user and password are right")
        return "Check that the file's directory exists and that the worker may write there"


def reason_of(exc: BaseException) -> str:
    """The first line of the driver's message in a database error (SQLAlchemy's wraps
    it as ``orig``, and adds lines of its own): what the server or driver said."""
    original = getattr(exc, "orig", None)
    text = str(original if original is not None else exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
