"""kombu glue: the Transport.

Its channels (:mod:`.channel`) claim from queue tables and publish to them; the
transport waits for work between claims, in kombu's blocking loop or Celery's event
loop, and delivers what they claimed.
"""

from __future__ import annotations

import logging
from queue import Empty
from time import monotonic
from typing import Any

import sqlalchemy
from celery.signals import worker_shutting_down
from kombu.transport import virtual
from sqlalchemy.exc import DisconnectionError, InterfaceError, OperationalError

from .broker import Broker, QueueTable
from .brokers import broker_for, shutting_down, stop_waiting
from .channel import Channel, QoS
from .errors import (
    ConfigurationError,
    DatabaseUnreachable,
    MessageTooLarge,
    SchemaMismatch,
    reason_of,
)
from .options import parse_options
from .polling import EventLoop
from .retries import Cadence
from .urls import client_url, conceal_password, refuse_alternates_with_query, shown_uri


def _driver_connection_errors() -> tuple[type[BaseException], ...]:
    """The installed drivers' own connection errors: raised unwrapped where SQLAlchemy sets
    a connection up (pool checkout, on-connect hooks) after a server restart."""
    found: list[type[BaseException]] = []
    for module in ("psycopg2", "psycopg", "pymysql", "MySQLdb", "sqlite3"):
        try:
            driver = __import__(module)
        except ImportError:
            continue
        found += [getattr(driver, name) for name in ("OperationalError", "InterfaceError")
                  if hasattr(driver, name)]
    return tuple(found)


DRIVER_CONNECTION_ERRORS = _driver_connection_errors()
logger = logging.getLogger(__name__)

worker_shutting_down.connect(stop_waiting, weak=False, dispatch_uid="sqlinbox.stop_waiting")


class Transport(virtual.Transport):
    """kombu transport over SQL tables: ``sqlinbox+<SQLAlchemy URL>``."""

    Channel = Channel
    can_parse_url = True
    default_port = None
    #: not "sql": Celery switches remote control and events off for that driver type
    driver_type = "sqlinbox"
    driver_name = "sqlalchemy"
    polling_interval = 0.2
    implements: Any = virtual.Transport.implements.extend(
        exchange_type=frozenset(["direct", "topic", "fanout"]))

    connection_errors = (
        *virtual.Transport.connection_errors, OperationalError, InterfaceError,
        DisconnectionError, DatabaseUnreachable, *DRIVER_CONNECTION_ERRORS,
    )
    channel_errors = (*virtual.Transport.channel_errors, MessageTooLarge)


    def __init__(self, client: Any, **kwargs: Any) -> None:
        self.options = parse_options(client.transport_options)
        refuse_alternates_with_query(client.alt)
        conceal_password(client)
        super().__init__(client, **kwargs)
        self.polling_interval = self.options.polling_interval
        self.cadence = Cadence(self.options.polling_interval_min, self.options.polling_backoff)
        self._broker: Broker | None = None
        #: whether the last claim of a queue table (not a transient queue) found rows
        self.working = False
        #: the channel, queue and table of the last delivery through kombu's cycles, while
        #: no other queue would take a turn (:meth:`Channel._served`)
        self.served: tuple[Channel, str, QueueTable] | None = None
        self.event_loop = EventLoop(self)
        if self.options.event_loop:  # Celery then runs its event loop, not the blocking one
            self.implements = type(self).implements.extend(asynchronous=True)

    @property
    def broker(self) -> Broker:
        if self._broker is None or self._broker.closed:
            self._broker = broker_for(self.url, self.options)
        return self._broker

    @property
    def url(self) -> str:
        """The SQLAlchemy URL connected to, password included: never for showing."""
        return client_url(self.client)

    def as_uri(self, uri: str, include_password: bool = False, mask: str = "**") -> str:
        """The broker URL as kombu shows it (the worker's banner, connection errors)."""
        return shown_uri(self.client, include_password, mask)

    def _collect(self, connection: Any) -> None:
        """kombu's clean-up of a connection that failed (Celery's reconnect path): close
        its channels, keeping the rows of deliveries whose tasks may still run."""
        for channel in (*self.channels, *self._avail_channels):
            channel.qos.connection_lost()
        self.close_connection(connection)

    def drain_events(self, connection: Any, timeout: float | None = None) -> None:
        """kombu's virtual loop, with the polling sleep replaced by the broker's wake-up
        (NOTIFY on PostgreSQL, the same-host signal on SQLite, an in-process poke
        everywhere) and the :class:`Cadence`'s wait. Once the process's Celery worker
        shuts down, a drain that finds nothing returns at once."""
        if self._deliver_buffered():
            self.cadence.active()
            return
        started = monotonic()
        while True:
            try:
                self.cycle.get(self._deliver, timeout=timeout)
                self.cadence.active()
                return
            except Empty:
                self.broker.keeper.handed_over.run()  # also while no channel may consume
                if shutting_down() or (timeout is not None
                                       and monotonic() - started >= timeout):
                    raise TimeoutError() from None
                self.broker.sweep()
                interval = self.broker.rates.idle_wait(
                    self.cadence.idle(self.polling_interval), self.polling_interval)
                if timeout:
                    interval = min(interval, timeout)
                self.broker.wakeup.wait(interval)

    def _deliver_buffered(self) -> bool:
        """Hand over the next buffered row of the queue that delivered last, without kombu's
        two round-robin cycles (over channels, then over a channel's queues) and their
        checks: they cost more than the rest of a delivery. The rows of a claim still go
        out one per call. Whether a message went out."""
        if self.served is None:
            return False
        channel, queue, table = self.served
        callback = self._callbacks.get(queue)
        message = None if callback is None else channel.next_buffered(queue, table)
        if message is None:
            return False
        callback(message)
        return True

    def register_with_event_loop(self, connection: Any, loop: Any) -> None:
        """Consume from kombu's event loop (Celery's, with :confval:`event_loop`): see
        :class:`~.polling.EventLoop`."""
        self.event_loop.register(loop)

    def close_connection(self, connection: Any) -> None:
        self.event_loop.leave()
        super().close_connection(connection)

    def consume_ready(self) -> bool:
        """Deliver what is ready, a claim's worth at a time; more in a later turn of the
        loop, so timers and acks from other threads are not kept waiting. The wake-up
        pipe brings that turn about (the hub's poll would not return for a callback
        scheduled from one of its own callbacks). Whether anything was delivered."""
        self.broker.keeper.handed_over.run()
        for delivered in range(self.options.max_batch):
            if self._deliver_buffered():
                continue
            try:
                self.cycle.get(self._deliver, timeout=0)
            except Empty:
                return delivered > 0
        self.broker.wakeup.poke()
        return True

    def establish_connection(self) -> Any:
        """Connect once to the database: a failure is a connection error kombu and Celery
        retry, saying what the driver said and which URL, in one line (SQLAlchemy's own
        message takes three, and names no URL)."""
        broker = self.broker
        try:
            broker.ping()
        except self.connection_errors as exc:
            raise DatabaseUnreachable(self.as_uri(""), reason_of(exc),
                                      server=broker.engine.dialect.name != "sqlite") from exc
        return super().establish_connection()

    def driver_version(self) -> str:
        return str(sqlalchemy.__version__)


__all__ = ["Channel", "ConfigurationError", "QoS", "SchemaMismatch", "Transport"]
