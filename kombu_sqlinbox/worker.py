"""What a ``celery worker`` consuming from this transport changes in itself at start-up.

Connected when the package is imported (the app's module imports it for the
``sqlinbox+`` alias), so it is in place before Celery's worker reads its settings.
"""

from __future__ import annotations

import logging
from typing import Any

from celery.signals import celeryd_init
from kombu import Connection
from kombu.transport import resolve_transport

from .errors import ConfigurationError, DatabaseUnreachable
from .options import parse_options


def transport_of(app: Any) -> tuple[type, dict[str, Any]]:
    """The transport class a Celery app consumes from, and its transport options."""
    with app.connection_for_read() as conn:
        assert isinstance(conn, Connection)
        return resolve_transport(conn.transport_cls), dict(conn.transport_options or {})


def consume_without_pool_waits(instance: Any, conf: Any, options: dict[str, Any],
                               **_: Any) -> None:
    """Celery's blocking loop (this transport's unless :confval:`event_loop`) hands each
    task to the prefork pool with a wait for a free process: the worker then answers no
    remote control (ping, revoke, inspect) until a running task ends, seconds while a
    backlog comes in. Without that wait a task waits in the pool instead, and the loop
    goes on serving control commands (as Celery's event loop does on Redis).

    A warm shutdown runs what waits in the pool, so the wait stays without a prefetch
    limit (``worker_prefetch_multiplier`` 0: the pool would take in the whole queue, and
    a shutdown would run it all), and a ``worker_pool_putlocks`` the user set (in the
    app's settings or a config object) is kept."""
    from .transport import Transport  # here: importing the package loads no transport

    multiplier = options.get("prefetch_multiplier")
    if multiplier is None:
        multiplier = conf.worker_prefetch_multiplier
    if chosen(conf, "worker_pool_putlocks") or not multiplier:
        return
    transport, transport_options = transport_of(instance.app)
    if issubclass(transport, Transport) and not parse_options(transport_options).event_loop:
        conf.worker_pool_putlocks = False


def chosen(conf: Any, key: str) -> bool:
    """Whether a Celery setting was set by the user, not left at Celery's default (the
    last of the settings' maps)."""
    return any(key in layer for layer in conf.maps[:-1])


celeryd_init.connect(consume_without_pool_waits, weak=False,
                     dispatch_uid="sqlinbox.consume_without_pool_waits")


def user_mistake(exc: BaseException | None) -> ConfigurationError | DatabaseUnreachable | None:
    """The mistake ``exc`` is or was raised from (kombu re-raises a connection error as its
    own, from it), if a user's or their server's; None for a bug, even one raised while
    handling a mistake."""
    while exc is not None:
        if isinstance(exc, (ConfigurationError, DatabaseUnreachable)):
            return exc
        exc = exc.__cause__
    return None


class OneLineMistakes(logging.Filter):
    """Celery's worker logs the error that stops it ("Unrecoverable error") with the
    traceback of its start-up, 60 to 170 lines, also for an unreachable database (once
    its retries are spent) and a setting found wrong as it connects: those become a line
    or two saying what to do, unless the worker logs at DEBUG, which keeps the traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        mistake = user_mistake(record.exc_info[1] if record.exc_info else None)
        if mistake is None or logging.getLogger(record.name).isEnabledFor(logging.DEBUG):
            return True
        if isinstance(mistake, DatabaseUnreachable):
            record.msg = ("cannot connect to the broker database %s: %s\n"
                          "%s (-l debug shows the traceback)")
            record.args = (mistake.url, mistake, mistake.advice())
        else:
            record.msg, record.args = "%s (-l debug shows the traceback)", (mistake,)
        record.exc_info, record.exc_text = None, None
        return True


#: one filter for every worker of the process (``addFilter`` adds it once)
ONE_LINE_MISTAKES = OneLineMistakes()


def shorten_mistakes(**_: Any) -> None:
    """On Celery's worker logger: where Celery logs the error that stops a worker."""
    logging.getLogger("celery.worker").addFilter(ONE_LINE_MISTAKES)


celeryd_init.connect(shorten_mistakes, weak=False, dispatch_uid="sqlinbox.shorten_mistakes")
