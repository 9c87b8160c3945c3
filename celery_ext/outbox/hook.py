"""The publish hook: which tasks are tracked, the wrapped sender that records them, and
sending records (after the caller's commit, or again by republish).

``before_task_publish`` swallows its receivers' errors, so a record that fails to
write would let the task go out untracked. Instead the hook wraps
``app.amqp.send_task_message`` and hands it a producer whose ``publish`` writes the
record first: a failed write raises :class:`~.store.RecordFailed` out of
``apply_async`` and nothing is sent. The wrapper sees the message exactly as the
broker will (serialized body, final exchange and routing key, headers, properties),
which is what republish needs to send it again unchanged.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from celery import Celery
from kombu import Exchange, Queue
from kombu.exceptions import OperationalError as KombuOperationalError
from kombu.serialization import dumps

from kombu_sqlinbox.errors import DuplicateTask
from kombu_sqlinbox.transport import Transport as InboxTransport

from .. import binding
from .store import Message, RecordStore

__all__ = ["HEADER", "TRANSIENT", "PublishHook", "RecordingProducer", "Republished",
           "TaskFilter"]

logger = logging.getLogger(__name__)

#: the message header carrying the record id
HEADER = "outbox_id"
#: Producer.publish arguments that steer one send and are not part of the message
TRANSIENT = frozenset({"retry", "retry_policy", "declare", "timeout", "confirm_timeout",
                       "serializer", "mandatory", "immediate"})

TaskFilter = Collection[str] | Callable[[str], bool] | None


@dataclass(frozen=True)
class Republished:
    """What one republish run did: how many records it sent again, the ids of those it
    could not send (logged with the reason), and how many it held back for their eta."""

    sent: int
    failed: tuple[Any, ...] = ()
    held: int = 0


class PublishHook:
    """The sending side of one outbox (see the module doc).

    ``tasks`` is None (all), a collection of task names or a predicate on the name;
    ``queues`` a collection of queue names; with both, a task matching either is tracked.
    ``untracked`` names tasks never tracked (the outbox's own).
    """

    def __init__(self, app: Celery, store: RecordStore, *, tasks: TaskFilter,
                 queues: Collection[str] | None, untracked: Collection[str], grace: float,
                 batch: int) -> None:
        self.app = app
        self.store = store
        self.tasks = tasks
        self.queues = frozenset(queues) if queues is not None else None
        self.untracked = frozenset(untracked)
        self.grace = grace
        self.batch = batch
        #: the wrapper in place (None: unhooked); one left under another's wrapper
        #: after :meth:`unhook` sends untracked
        self._sender: Callable[..., Any] | None = None
        self._previous: Callable[..., Any] | None = None

    # -- what is tracked ------------------------------------------------------------
    def tracks_task(self, name: str) -> bool:
        if name in self.untracked:
            return False
        if self.tasks is None:
            return self.queues is None
        if callable(self.tasks):
            return bool(self.tasks(name))
        return name in self.tasks

    def tracks(self, name: str, routing_key: str, declare: Any) -> bool:
        if self.tracks_task(name):
            return True
        if self.queues is None:
            return False
        names = {q.name for q in declare or () if isinstance(q, Queue)} or {routing_key}
        return not names.isdisjoint(self.queues)

    # -- the wrapped sender -----------------------------------------------------------
    def hook(self) -> None:
        """Replace ``app.amqp.send_task_message`` with one that records tracked tasks.

        Celery builds the original from the configuration on first use, so the wrapper
        builds it lazily too: installing early does not freeze settings configured later.
        """
        amqp = self.app.amqp
        original: Callable[..., Any] | None = None

        def send_task_message(producer: Any, name: str, message: Any, **options: Any) -> Any:
            nonlocal original
            if original is None:
                original = amqp._create_task_sender()
            if self._sender is send_task_message and (
                    self.queues is not None or self.tracks_task(name)):
                producer = RecordingProducer(self, producer, name, message[0])
            return original(producer, name, message, **options)

        # the sender Celery built and cached, if it did (a cached_property)
        self._previous = amqp.__dict__.get("send_task_message")
        self._sender = amqp.send_task_message = send_task_message

    def unhook(self) -> None:
        """Give the app back the sender it had before :meth:`hook`."""
        if self._sender is None:
            return
        amqp = self.app.amqp
        if amqp.__dict__.get("send_task_message") is self._sender:
            if self._previous is None:
                del amqp.send_task_message  # built again from the configuration when used
            else:
                amqp.send_task_message = self._previous
        self._sender = self._previous = None

    # -- sending ------------------------------------------------------------------
    def send(self, producer: Any, message: Message, record_id: Any,
             declare: Any = None) -> None:
        """Publish a recorded message with its record id, retrying as Celery's publish does."""
        conf = self.app.conf
        if declare is None:
            queue = self.app.amqp.queues.get(message.routing_key)
            declare = [queue] if queue is not None else []
        producer.publish(
            message.body, exchange=message.exchange, routing_key=message.routing_key,
            headers={**message.headers, HEADER: record_id}, declare=declare,
            retry=conf.task_publish_retry, retry_policy=conf.task_publish_retry_policy,
            **message.properties)

    def send_after_commit(self, message: Message, record_id: Any, declare: Any) -> None:
        """The deferred publish of a record written in the caller's transaction (unbound:
        a Session still bound after its commit must not take the publish in)."""
        try:
            with binding.unbound(), self.app.producer_or_acquire() as producer:
                self.send(producer, message, record_id, declare)
        except Exception:
            logger.exception("outbox: record %s is committed but its message could not be "
                             "sent now; republish will send it", record_id)

    def republish(self, older_than: float | None = None, limit: int | None = None,
                  progress: Callable[[int], None] | None = None) -> Republished:
        """Send again the records unprocessed, and not sent, for ``older_than`` seconds
        (default: the grace period), oldest id first, with their task id and record id.

        Each batch is claimed first (its resend time set, in a transaction that locks the
        rows, skipping those another republisher holds), then sent: two republishers never
        send one record, and a record goes out at most once per grace period. A record
        that cannot be sent (say, its stored headers are not JSON) is logged and skipped
        until its next period; the others go on. A task whose eta is still ahead is held
        back (claimed, not sent) until a period after it. A broker error ends the run,
        and the records it kept from being sent are due again at once. ``progress`` is
        told how many records each batch handled.
        """
        store = self.store
        grace = self.grace if older_than is None else older_than
        # the run moves on by id: what it claimed may be due again at once (older_than=0)
        after: Any = -1 if store.spec.generated_id else ""
        sent = held = 0
        failed: list[Any] = []
        with self.app.producer_or_acquire() as producer:
            broker_errors = (KombuOperationalError, *producer.connection.connection_errors)
            while limit is None or sent + held + len(failed) < limit:
                size = self.batch if limit is None else min(
                    self.batch, limit - sent - held - len(failed))
                rows = store.claim_due(grace, after, size)
                if rows:
                    after = rows[-1][0]
                for done, row in enumerate(rows):
                    try:
                        message = Message.from_row(row)
                        if message.eta_ahead():
                            held += 1
                        else:
                            self.send(producer, message, row[0])
                            sent += 1
                    except DuplicateTask as exc:
                        # its unique key is held: by its own message, which waits (the
                        # guard marks it when it runs), or by another task, which runs
                        # instead of it
                        if exc.task_id != message.headers.get("id"):
                            store.discard(row[0])
                        sent += 1
                    except broker_errors:
                        store.unclaim([later[0] for later in rows[done:]])
                        raise
                    except Exception as exc:
                        logger.error("outbox: record %s could not be sent again (%s: %s); "
                                     "republish tries it again after the grace period",
                                     row[0], type(exc).__name__, exc)
                        failed.append(row[0])
                if progress is not None:
                    progress(len(rows))
                if len(rows) < size:
                    break
        if sent or failed or held:
            logger.info("outbox: republished %d record(s) of %s, %d failed, %d held back "
                        "for their eta", sent, store.spec.table, len(failed), held)
        return Republished(sent, tuple(failed), held)


class RecordingProducer:
    """A producer whose first publish of the task's message records it before sending.

    Other publishes through it (the task-sent event) pass straight through; a publish
    retried after a connection error sends the already recorded message again.
    """

    def __init__(self, hook: PublishHook, producer: Any, name: str,
                 task_headers: dict[str, Any]) -> None:
        self._hook = hook
        self._producer = producer
        self._name = name
        self._headers = task_headers
        self._recorded: tuple[bytes, dict[str, Any]] | None = None

    def __getattr__(self, attribute: str) -> Any:
        return getattr(self._producer, attribute)

    def publish(self, body: Any, **kwargs: Any) -> Any:
        if kwargs.get("headers") is not self._headers:
            return self._producer.publish(body, **kwargs)
        if self._recorded is not None:
            data, publish_kwargs = self._recorded
            return self._producer.publish(data, **publish_kwargs)
        hook, store = self._hook, self._hook.store
        exchange = kwargs.get("exchange") or ""
        exchange = exchange.name if isinstance(exchange, Exchange) else str(exchange)
        routing_key = str(kwargs.get("routing_key") or "")
        if not hook.tracks(self._name, routing_key, kwargs.get("declare")):
            return self._producer.publish(body, **kwargs)
        data, kwargs = self._serialize(body, kwargs)
        headers = kwargs["headers"]
        headers.pop(HEADER, None)  # a retried task's request headers carry the old id
        properties = {k: v for k, v in kwargs.items()
                      if k not in TRANSIENT and k not in ("exchange", "routing_key", "headers")}
        message = Message(data, exchange, routing_key, dict(headers), properties)
        task_id = headers.get("id") or (body.get("id") if isinstance(body, dict) else None)
        bound = store.bound_connection()
        record_id = store.record(message, task_id, self._name, bound)
        headers[HEADER] = record_id
        if bound is not None and not isinstance(self._producer.connection.transport,
                                                InboxTransport):
            binding.after_commit(functools.partial(
                hook.send_after_commit, message, record_id, kwargs.get("declare")))
            return None
        # unbound, or the sqlinbox transport, whose publish joins the bound transaction
        self._recorded = (data, kwargs)
        try:
            return self._producer.publish(data, **kwargs)
        except DuplicateTask:
            store.discard(record_id, bound)  # the key's holder runs instead: never sent
            raise

    def _serialize(self, body: Any, kwargs: dict[str, Any]) -> tuple[bytes, dict[str, Any]]:
        """Serialize as kombu would, so the recorded body is the exact bytes sent."""
        kwargs = dict(kwargs)
        serializer = kwargs.pop("serializer", None) or self._producer.serializer
        content_type = kwargs.get("content_type")
        encoding = kwargs.get("content_encoding")
        if not content_type:
            content_type, encoding, body = dumps(body, serializer=serializer)
        if isinstance(body, str):
            encoding = encoding or "utf-8"
            body = body.encode(encoding)
        kwargs["content_type"] = content_type
        kwargs["content_encoding"] = encoding or "binary"
        return bytes(body), kwargs
