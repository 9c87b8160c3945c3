"""What a worker consuming from this transport changes in itself at start-up (a ``celery
worker``, or one built in Python, such as Celery's ``start_worker``).

Connected when the package is imported (the app's module imports it for the
``sqlinbox+`` alias), so it is in place before Celery's worker reads its settings.
"""

from __future__ import annotations

import logging
import re
import sys
import traceback
from typing import Any

import click
from celery.signals import celeryd_init, worker_init
from celery.utils.log import mlevel
from kombu import Connection
from kombu.transport import resolve_transport

from .errors import ConfigurationError, DatabaseUnreachable
from .options import parse_options
from .urls import failover_urls, refuse_alternates_with_query

#: a broker URL meant for this transport: kombu reads one without ``://`` as a host of
#: RabbitMQ, so its mistake would surface as a failed DNS lookup
_OURS = re.compile(r"sqlinbox(\+|:|$)")
#: Celery's own line when it may not retry a failed connection, which names no cause
_RETRY_DISABLED = re.compile(r"has been disabled \(app\.conf\.(\w+)=False\)")


def named_transport(conf: Any) -> bool:
    """Whether ``broker_transport`` names this transport (or a subclass): every broker URL
    is then its, a plain SQLAlchemy URL."""
    if not conf.broker_transport:
        return False
    from .transport import Transport  # here: importing the package loads no transport

    try:
        named = resolve_transport(conf.broker_transport)
    except (KeyError, ImportError, AttributeError, ValueError):  # Celery's to refuse
        return False
    return isinstance(named, type) and issubclass(named, Transport)


def broker_urls(conf: Any) -> list[str]:
    """Every URL of the app's broker settings meant for this transport, each URL of a
    failover list on its own, once."""
    found: dict[str, None] = {}
    every = named_transport(conf)
    # Celery's properties: the environment (``celery -b``) first, the read and write
    # URLs defaulting to broker_url
    for value in (conf.broker_url, conf.broker_read_url, conf.broker_write_url):
        for given in [value] if isinstance(value, str) else value or ():
            urls = failover_urls(given)
            ours = [url for url in urls if every or _OURS.match(url)]
            if ours:
                refuse_alternates_with_query(urls)
            found.update(dict.fromkeys(ours))
    return list(found)


def check_broker(app: Any) -> None:
    """Every mistake in the app's broker URLs and transport options that shows without a
    connection (a URL that is none, its driver, an SQLite database in memory, an
    option, an engine option): raised before a worker starts anything."""
    from .database import open_database  # here: importing the package loads no engine

    urls = broker_urls(app.conf)
    if not urls:
        return
    options = parse_options(app.conf.broker_transport_options)
    for url in urls:
        open_database(url, options).dispose()


def check_configuration(instance: Any, options: dict[str, Any], **_: Any) -> None:
    """Under ``celery worker``, a mistake :func:`check_broker` finds ends the command in
    one line and exit status 1, as its click error would (Celery's start-up signals log
    what their receivers raise, and go on); ``-l debug`` prints the traceback first. A
    worker built in Python, outside a command, is not ended from here: the transport
    raises such a mistake where Celery creates it or connects."""
    try:
        check_broker(instance.app)
    except ConfigurationError as exc:
        if click.get_current_context(silent=True) is None:
            return
        if mlevel(options.get("loglevel") or logging.WARNING) <= logging.DEBUG:
            traceback.print_exc()
        exc.show()
        raise SystemExit(exc.exit_code) from exc


celeryd_init.connect(check_configuration, weak=False,
                     dispatch_uid="sqlinbox.check_configuration")


def transport_of(app: Any) -> Any:
    """The transport class a Celery app consumes from."""
    with app.connection_for_read() as conn:
        assert isinstance(conn, Connection)
        return resolve_transport(conn.transport_cls)


def consume_without_pool_waits(sender: Any, **_: Any) -> None:
    """Celery's blocking loop (this transport's unless :confval:`event_loop`) hands each
    task to the prefork pool with a wait for a free process: the worker then answers no
    remote control (ping, revoke, inspect) until a running task ends, seconds while a
    backlog comes in. Without that wait a task waits in the pool instead, and the loop
    goes on serving control commands (as Celery's event loop does on Redis).

    Connected to ``worker_init``, which every worker sends before it builds its pool: a
    ``celery worker`` and a worker built in Python (Celery's ``start_worker``, which its
    integration suite and pytest plugin run, sends no ``celeryd_init``). The worker has
    read its settings by then, so its own ``pool_putlocks`` is what changes.

    A warm shutdown runs what waits in the pool, so the wait stays without a prefetch
    limit (``worker_prefetch_multiplier`` 0: the pool would take in the whole queue, and
    a shutdown would run it all), and a ``worker_pool_putlocks`` the user set (in the
    app's settings, a config object, or the worker's ``pool_putlocks`` argument) is
    kept."""
    from .transport import Transport  # here: importing the package loads no transport

    worker = sender
    if (chosen(worker.app.conf, "worker_pool_putlocks")
            or worker.options.get("pool_putlocks") is not None
            or not worker.prefetch_multiplier or worker.use_eventloop):
        return
    transport = transport_of(worker.app)
    if isinstance(transport, type) and issubclass(transport, Transport):
        worker.pool_putlocks = False


def chosen(conf: Any, key: str) -> bool:
    """Whether a Celery setting was set by the user, not left at Celery's default (the
    last of the settings' maps)."""
    return any(key in layer for layer in conf.maps[:-1])


worker_init.connect(consume_without_pool_waits, weak=False,
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
    or two saying what to do, unless the worker logs at DEBUG, which keeps the traceback.
    So does Celery's line when it may not retry (``broker_connection_retry_on_startup``
    False), which names neither the database nor what failed: logged while the error
    is handled, with no traceback of its own."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.CRITICAL:
            return True  # not a stop: a connection the worker retries keeps its traceback
        exc = record.exc_info[1] if record.exc_info else None
        no_retry = None if exc else _RETRY_DISABLED.search(record.getMessage())
        if no_retry:
            exc = sys.exc_info()[1]
        mistake = user_mistake(exc)
        if mistake is None:
            return True
        if logging.getLogger(record.name).isEnabledFor(logging.DEBUG):
            if no_retry:
                record.exc_info = sys.exc_info()
            return True
        if isinstance(mistake, DatabaseUnreachable):
            record.msg = ("cannot connect to the broker database %s: %s\n"
                          "%s%s (-l debug shows the traceback)")
            record.args = (mistake.url, mistake, mistake.advice(), "" if not no_retry else
                           f"; Celery does not retry: {no_retry.group(1)} is False")
        else:
            record.msg, record.args = "%s (-l debug shows the traceback)", (mistake,)
        record.exc_info, record.exc_text = None, None
        return True


#: one filter for every worker of the process (``addFilter`` adds it once)
ONE_LINE_MISTAKES = OneLineMistakes()


def shorten_mistakes(**_: Any) -> None:
    """On Celery's worker logger, where Celery logs the error that stops a worker, and its
    consumer's, where it logs that it may not retry (a logger's filters do not apply to
    its children's records)."""
    for name in ("celery.worker", "celery.worker.consumer.consumer"):
        logging.getLogger(name).addFilter(ONE_LINE_MISTAKES)


celeryd_init.connect(shorten_mistakes, weak=False, dispatch_uid="sqlinbox.shorten_mistakes")
