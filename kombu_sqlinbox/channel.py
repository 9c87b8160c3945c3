"""kombu glue: the Channel, and its QoS.

Each queue is a table. ``_get`` serves messages from a per-queue buffer that
one claim fills with as many rows as Celery has free prefetch slots (the buffers and
the deliveries until settled: :mod:`.deliveries`); the QoS turns ack, requeue and
reject into settlements the lease keeper batches.
"""

from __future__ import annotations

import logging
import weakref
from collections import deque
from collections.abc import Callable
from functools import partial
from itertools import count
from queue import Empty
from time import monotonic, time
from typing import Any, Protocol

from kombu.exceptions import ChannelError
from kombu.transport import virtual
from kombu.transport.base import to_rabbitmq_queue_arguments
from kombu.transport.virtual.base import queue_declare_ok_t
from sqlalchemy.exc import DBAPIError

from .broker import Broker, QueueTable
from .codec import (
    GROUP_HEADER,
    PARTITION_HEADER,
    encode_message,
    encode_plain,
    eta_epoch,
    expiration_seconds,
    expiry,
    priority_of,
    stores_plain,
)
from .deliveries import Deliveries
from .keeper import SETTLE_LIMIT
from .limits import limit_key_of
from .rows import ClaimedRow, Held, Settlement
from .unique import unique_of

logger = logging.getLogger(__name__)


class Owner(Protocol):
    """What a channel takes from its transport as it opens (:mod:`.transport` imports
    this module, not the other way round)."""

    @property
    def broker(self) -> Broker: ...


def _key(value: Any) -> str | None:
    return None if value is None else str(value)


class QoS(virtual.QoS):
    """Prefetch accounting plus settlement: acks may come from any thread."""

    def __init__(self, channel: Channel, prefetch_count: int = 0) -> None:
        super().__init__(channel, prefetch_count)
        self._connection_lost = False

    def connection_lost(self) -> None:
        """The channel closes because its connection failed, not to shut down: tasks of
        its deliveries may still be running (see :meth:`restore_unacked`)."""
        self._connection_lost = True

    def _settle(self, delivery_tag: Any, settle: Callable[[Held, ClaimedRow], None]) -> None:
        """kombu forgets the delivery, then its row settles
        (:meth:`~.deliveries.Deliveries.settle`)."""
        was_full = not self.can_consume()
        self._quick_ack(delivery_tag)
        self.channel.deliveries.settle(delivery_tag, settle, was_full)

    def ack(self, delivery_tag: Any) -> None:
        broker = self.channel.broker
        self._settle(delivery_tag, self._counted(
            lambda held: broker.settle(Settlement.COMPLETE, held)))

    def completed(self, delivery_tag: Any) -> None:
        """The delivery's row was completed by its task's own transaction (its result
        written with it): the delivery leaves as acked, with no statement of its own."""
        self._settle(delivery_tag, self._counted(lambda held: held.table.claims.completed(held)))

    def _counted(self, settle: Callable[[Held], None]) -> Callable[[Held, ClaimedRow], None]:
        """``settle``, then the row counted for its queue's throughput (:mod:`.throughput`):
        the one point every row a consumer acks or completes passes (a settlement that
        raised is not counted; transient queues hold no table rows, and are not)."""
        throughput = self.channel.broker.throughput

        def counted(held: Held, row: ClaimedRow) -> None:
            settle(held)
            if not held.table.transient:
                throughput.count(held.table.queue)
        return counted

    def retry_after(self, delivery_tag: Any, seconds: float) -> None:
        """Requeue in place (same row, attempt counted), hidden for ``seconds``."""
        broker = self.channel.broker
        self._settle(delivery_tag, lambda held, row: broker.retry_later(held, seconds))

    def reject(self, delivery_tag: Any, requeue: bool = False) -> None:
        broker = self.channel.broker
        self._settle(delivery_tag, lambda held, row: broker.reject(held, row, requeue))

    def restore_unacked(self) -> list[Any]:
        """Give unacked rows back in place (their delivery counted) instead of re-publishing.

        After a lost connection the consumer goes on with what it started: a running
        task acks late, here. So a row stays held (the keeper extends it) for as long
        as its message is referenced; one the consumer dropped unstarted goes back once
        its message is freed, at the consumer's next turn of the loop, the keeper's next
        extension or a flush: its finalizer only hands the release over
        (:mod:`.handover`), since it runs in whichever thread collects, perhaps one
        holding the keeper's lock.
        """
        self._flush()
        kept = set()
        while self._connection_lost and self._delivered:
            tag, message = self._delivered.popitem(last=False)
            if self.channel.deliveries.holds(tag):
                weakref.finalize(message, self.channel.broker.keeper.handed_over.put,
                                 partial(self._release, tag))
                kept.add(tag)
            del message  # ours must not be the reference that keeps it held
        self._delivered.clear()
        for tag in self.channel.deliveries.unsettled():
            if tag not in kept:
                self._release(tag)
        return []

    def _release(self, delivery_tag: Any) -> None:
        """Requeue in place a row nobody can settle any more."""
        self.reject(delivery_tag, requeue=True)


class Channel(virtual.Channel):
    """A kombu channel over inbox tables."""

    QoS = QoS
    body_encoding = None
    #: fanout and topic exchanges reach the queues every process bound (:mod:`.routing`)
    supports_fanout = True
    from_transport_options = ()
    _delivery_tags = count(1)

    def __init__(self, connection: Owner, **kwargs: Any) -> None:
        super().__init__(connection, **kwargs)
        self.broker: Broker = connection.broker
        self.deliveries = Deliveries(self.broker)
        #: when each transient queue of this channel was last claimed and found empty
        self._found_empty: dict[str, float] = {}
        #: auto-delete queues declared here: deleted when their last consumer here goes
        self._auto_delete: set[str] = set()
        #: auto-delete queues the cancel of their last consumer here deleted, not declared
        #: again since (kombu deletes a reply queue once more after its replies came)
        self._deleted_on_cancel: set[str] = set()
        #: exclusive queues declared here: deleted when this channel closes
        self._exclusive: set[str] = set()

    def _next_delivery_tag(self) -> int:
        return next(self._delivery_tags)

    # -- publish ---------------------------------------------------------------
    def _put(self, queue: str, message: dict[str, Any], **kwargs: Any) -> None:
        table = self.broker.table(queue)
        unique = unique_of(message["properties"])  # a key refused before it is encoded
        if limit_key_of(message) is not None:
            self.broker.limits.check(table)  # a table that would lose the key
        columns: tuple[Any, ...] = ()
        expiration = expiration_seconds(message)
        if stores_plain(table.spec):  # the payload and row columns alone, no envelope
            payload, columns, headers = (*encode_plain(message, table), None)
        else:
            # a transient message's expiry is a column its claim reads, not in the envelope
            expires_at = None if table.transient else expiry(
                expiration, self.broker.routes.message_ttl(queue), time())
            payload, headers = encode_message(message, table, expires_at)
        priority = priority_of(message["properties"])
        message_headers = message.get("headers") or {}
        self.broker.publish_message(
            table, payload, headers, priority, eta_epoch(message_headers),
            _key(message_headers.get(GROUP_HEADER)), _key(message_headers.get(PARTITION_HEADER)),
            expiration, (message_headers.get("task"), message_headers.get("id")),
            columns, unique)

    def basic_publish(self, message: dict[str, Any], exchange: str, routing_key: str,
                      **kwargs: Any) -> None:
        """Route through the bindings of every process: the bindings table
        (:meth:`~.routing.Routes.bound`), which holds this process's too and not those
        another process unbound (kombu's in-process routing alone where there is none).
        The transient queues bound anywhere get the message in one statement; a direct
        exchange with a table-backed queue bound here for the key (a task publish) runs
        it only when the bindings table has a transient queue taking the key."""
        if not exchange:
            super().basic_publish(message, exchange, routing_key, **kwargs)
            return
        self._inplace_augment_message(message, exchange, routing_key)
        kind = self.typeof(exchange)
        try:
            here = kind.lookup(self.get_table(exchange), exchange, routing_key, None)
        except KeyError:
            here = set()
        tables = {queue for queue in here if not self.broker.table(queue).transient}
        found = self.broker.routes.bound(exchange, routing_key)
        elsewhere, transient = (tables, False) if found is None else found
        if transient or kind.type != "direct" or not tables:
            payload, headers = encode_message(message, self.broker.transient_template)
            self.broker.transient.route(exchange, routing_key, payload, headers,
                                        expiration_seconds(message),
                                        priority_of(message["properties"]))
        for queue in elsewhere:
            self._put(queue, message, **kwargs)

    # -- consume ---------------------------------------------------------------
    def _get(self, queue: str, timeout: float | None = None) -> dict[str, Any]:
        table = self.broker.table(queue)
        self.broker.routes.keep_alive(queue)
        deliveries = self.deliveries
        buffer = deliveries.buffers.get(queue)
        if buffer is None:
            buffer = deliveries.buffers[queue] = deque()
        while True:
            row = deliveries.next_free(queue, buffer)
            if row is None:
                if table.transient and self._transient_may_wait(queue):
                    raise Empty()
                try:
                    claimed = deliveries.claim(table, buffer, self.qos.can_consume_max_estimate(),
                                               bool(self._consumers))
                except DBAPIError as exc:
                    if not self.broker.restore_dropped(table):
                        raise
                    logger.warning("sqlinbox: a claim on queue %r failed (%s); claiming "
                                   "again next round", queue, exc.orig)
                    raise Empty() from None
                if claimed is None:
                    raise Empty()
                if table.transient:
                    if not claimed:
                        self._found_empty[queue] = monotonic()
                else:
                    self.connection.working = bool(claimed)
                if not claimed:
                    raise Empty()
                continue
            message = deliveries.deliverable(table, row, self._next_delivery_tag())
            if message is not None:
                self._served(queue, table)
                return message

    def _served(self, queue: str, table: QueueTable) -> None:
        """A delivery went out through kombu's cycles: its queue's next buffered rows may
        skip them (:meth:`Transport._deliver_buffered`) when no other queue would take a
        turn meanwhile: every other queue consumed on the connection is transient (those
        wait anyway while rows are ready elsewhere, see :meth:`_transient_may_wait`)."""
        transport = self.connection
        served = transport.served
        if served is not None and served[0] is self and served[1] == queue:
            return
        alone = all(name == queue or self.broker.table(name).transient
                    for name in transport._callbacks)
        transport.served = (self, queue, table) if alone else None

    def next_buffered(self, queue: str, table: QueueTable) -> dict[str, Any] | None:
        """The message of the next buffered row of ``queue`` that may go out now, when a
        prefetch slot is free; else None (a claim is due: kombu's cycles decide)."""
        buffer = self.deliveries.buffers.get(queue)
        if not buffer or self.closed or not self.qos.can_consume():
            return None
        while buffer:
            row = self.deliveries.next_free(queue, buffer)
            if row is None:
                return None
            message = self.deliveries.deliverable(table, row, self._next_delivery_tag())
            if message is not None:
                return message
        return None

    def _transient_may_wait(self, queue: str) -> bool:
        """Whether a transient queue (a worker's remote-control queue, a reply queue) may
        skip this round, as kombu asks every queue in turn: while another queue of the
        connection has a row ready to go out, and, while the last claim of a queue table
        found rows, for a polling interval after the queue was found empty, unless a
        NOTIFY for it came meanwhile (PostgreSQL). A busy worker then claims its
        remote-control queue when a command came for it (elsewhere a few times a second),
        not once per claim of its task queue; an idle one, at every round."""
        if self._ready_elsewhere(queue):
            return True
        if self.broker.transient.told(queue):  # a NOTIFY: a message came for it
            return False
        found_empty = self._found_empty.get(queue)
        return (self.connection.working and found_empty is not None
                and monotonic() - found_empty < self.connection.polling_interval)

    def _ready_elsewhere(self, queue: str) -> bool:
        """Whether another queue of this connection (any channel) has a buffered row that
        can go out now. kombu asks the queues in turn, so a worker's remote-control queue
        (transient, on a channel of its own) would be polled once per task; while claimed
        rows wait, it is polled once per claim instead."""
        return any(channel.deliveries.ready(besides=queue)
                   for channel in list(self.connection.channels))

    def basic_consume(self, queue: str, no_ack: bool, callback: Callable[[Any], Any],
                      consumer_tag: str, **kwargs: Any) -> Any:
        """Consume from ``queue``; a tag this channel already consumes with is refused, as
        AMQP does (kombu's channel took it over, and one cancel left the first consumption
        counted for ever: its queue never expired)."""
        if consumer_tag in self._consumers:
            raise ChannelError(f"consumer tag {consumer_tag!r} is already in use on this "
                               "channel: cancel it first")
        self.broker.listen(self.broker.table(queue))
        self.connection.served = None  # another queue to take turns with
        if no_ack:
            callback = self._completed_on_delivery(callback)
        result = super().basic_consume(queue, no_ack, callback, consumer_tag, **kwargs)
        self.broker.routes.consuming(queue, added=True)
        return result

    def _completed_on_delivery(self, callback: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """A ``no_ack`` consumer's messages are settled as they are handed over: nothing
        will ever ack them, and a row left held would be delivered again."""
        def deliver(message: Any) -> Any:
            self.qos.ack(message.delivery_tag)
            return callback(message)
        return deliver

    def basic_get(self, queue: str, no_ack: bool = False, **kwargs: Any) -> Any:
        message = super().basic_get(queue, no_ack, **kwargs)
        if message is not None and no_ack:
            self.qos.ack(message.delivery_tag)
        return message

    def basic_cancel(self, consumer_tag: str) -> Any:
        """Stop consuming; rows claimed for it but not delivered are back in the queue
        when this returns, as on Redis."""
        queue = self._tag_to_queue.get(consumer_tag)
        result = super().basic_cancel(consumer_tag)
        if queue:
            self.broker.routes.consuming(queue, added=False)
            if self.deliveries.release_buffered([queue]):
                self.broker.keeper.flush(timeout=SETTLE_LIMIT)
            if queue in self._auto_delete and queue not in self._active_queues:
                self._auto_delete.discard(queue)
                # AMQP's auto-delete; a transient queue's rows go off this call's way
                self.broker.delete_queue(queue, later=True)
                self.state.queue_bindings_delete(queue)
                self._deleted_on_cancel.add(queue)
        return result

    def after_reply_message_received(self, queue: str) -> None:
        """kombu deletes a reply queue once its replies came (``app.control.ping``): that
        of an auto-delete queue the cancel of its consumer deleted already (AMQP's
        auto-delete) costs no second round of statements."""
        if queue in self._deleted_on_cancel:
            self._deleted_on_cancel.discard(queue)
            return
        self.queue_delete(queue)

    def basic_recover(self, requeue: bool = False) -> Any:
        """Give every unacked message back (kombu's virtual channels refuse
        ``requeue=False``); they are in the queue again when this returns, as on Redis."""
        result = super().basic_recover(requeue)
        self.broker.keeper.flush(timeout=SETTLE_LIMIT)
        return result

    def close(self) -> None:
        if not self.closed:
            self.deliveries.release_buffered(list(self.deliveries.buffers))
            for queue in self._exclusive:
                self.queue_delete(queue)
            self._exclusive.clear()
        super().close()
        self.broker.keeper.flush(timeout=SETTLE_LIMIT)

    # -- exchanges, bindings and queues -----------------------------------------
    def prepare_queue_arguments(self, arguments: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        """kombu's ``Queue(expires=, message_ttl=, ...)`` as AMQP queue arguments."""
        return dict(to_rabbitmq_queue_arguments(arguments, **kwargs))

    def queue_bind(self, queue: str, exchange: str | None = None, routing_key: str = "",
                   arguments: Any = None, **kwargs: Any) -> None:
        """kombu's in-process binding, and its row in the bindings table, written on every
        declaration (a sweep may have deleted an expired queue's bindings)."""
        exchange = exchange or "amq.direct"
        kind = self.typeof(exchange)
        meta = kind.prepare_bind(queue, exchange, routing_key, arguments)
        if not self.state.has_binding(queue, exchange, routing_key):
            self.state.binding_declare(queue, exchange, routing_key, arguments)
            self.state.exchanges[exchange].setdefault("table", []).append(meta)
        self.broker.routes.bind(exchange, kind.type, queue, routing_key, meta[1] or "")

    def queue_unbind(self, queue: str, exchange: str | None = None, routing_key: str = "",
                     arguments: Any = None, **kwargs: Any) -> None:
        super().queue_unbind(queue, exchange, routing_key, arguments, **kwargs)
        self.broker.routes.unbind(exchange or "amq.direct", queue, routing_key)

    def exchange_delete(self, exchange: str, if_unused: bool = False,
                        nowait: bool = False) -> None:
        super().exchange_delete(exchange, if_unused, nowait)
        self.broker.routes.delete_exchange(exchange)

    # -- queue management ------------------------------------------------------
    def queue_delete(self, queue: str, if_unused: bool = False, if_empty: bool = False,
                     **kwargs: Any) -> None:
        """Delete the queue's table whatever this process knows of its bindings (kombu's
        virtual channel only deletes through bindings declared in this process)."""
        if if_empty and self._size(queue):
            return
        self._delete(queue)
        self.state.queue_bindings_delete(queue)

    def queue_declare(self, queue: str | None = None, passive: bool = False,
                      **kwargs: Any) -> Any:
        """A passive declare only looks, as on AMQP (kombu's declared the queue again as
        durable without arguments: another process's transient queue left the registry
        with its messages, a durable one its x-expires)."""
        if passive and queue and self._has_queue(queue):
            return queue_declare_ok_t(queue, self._size(queue), 0)
        return super().queue_declare(queue, passive, **kwargs)

    def _new_queue(self, queue: str, durable: bool = True, exclusive: bool = False,
                   auto_delete: bool = False, arguments: dict[str, Any] | None = None,
                   **kwargs: Any) -> None:
        self._deleted_on_cancel.discard(queue)
        if auto_delete:
            self._auto_delete.add(queue)
        if exclusive:
            self._exclusive.add(queue)
        self.broker.declare_queue(queue, durable, auto_delete, exclusive, arguments)

    def _has_queue(self, queue: str, **kwargs: Any) -> bool:
        return self.broker.routes.is_transient(queue) or self.broker.known_table(queue)

    def _size(self, queue: str) -> int:
        return self.broker.size(self.broker.table(queue))

    def _purge(self, queue: str) -> int:
        return self.broker.purge(self.broker.table(queue))

    def _delete(self, queue: str, *args: Any, **kwargs: Any) -> None:
        self.broker.delete_queue(queue)
