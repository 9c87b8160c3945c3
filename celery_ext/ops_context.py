"""The operations the ``sqlinbox`` commands run on: the database of the app or of
``--url``, a database that fails said in one line."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import click
from sqlalchemy.exc import InterfaceError, OperationalError

from kombu_sqlinbox.errors import ConfigurationError
from kombu_sqlinbox.operations import Operations
from kombu_sqlinbox.options import parse_options
from kombu_sqlinbox.urls import client_url, masked

from .outbox_cli import database_failed

__all__ = ["app_operations", "operations"]


def app_url(app: Any) -> str:
    """The app's broker database as its workers connect to it: its password setting,
    its first URL."""
    with app.connection_for_write() as connection:
        return str(client_url(connection))


def app_operations(app: Any) -> Operations:
    """The operations on the app's broker database, with its options and queues."""
    return Operations(app_url(app), parse_options(app.conf.broker_transport_options),
                      list(app.amqp.queues))


@contextmanager
def operations(ctx: click.Context) -> Iterator[Operations]:
    """The operations on the database of the app (``celery -A proj``) or of ``--url``."""
    obj = ctx.obj
    url, raw, app = obj.url, obj.transport_options, obj.app
    queues: list[str] = []
    if app is not None:
        broker_url = str(app.conf.broker_url or "")
        if url is None and not broker_url.startswith("sqlinbox+"):
            raise click.UsageError(
                f"the app's broker is not sqlinbox ({masked(broker_url)!r}): pass --url")
        raw = app.conf.broker_transport_options if raw is None else raw
        queues = list(app.amqp.queues)
    elif not url:
        raise click.UsageError("no sqlinbox database: pass --url URL, or -A proj")
    try:
        if url is None:
            url = app_url(app)
        made = Operations(str(url), parse_options(raw), queues)
    except ConfigurationError as exc:
        raise click.UsageError(str(exc)) from None
    try:
        yield made
    except ConfigurationError as exc:  # a queue that is not a dead-letter queue...
        raise click.UsageError(str(exc)) from None
    except (OperationalError, InterfaceError) as exc:
        if obj.traceback:
            raise
        raise database_failed(str(url), exc) from None
    finally:
        made.close()
