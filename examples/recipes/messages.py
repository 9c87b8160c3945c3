"""Moving messages between queues with plain kombu: dead-letter requeue, migration from ``sqla``.

Both recipes read a message, publish a copy, then acknowledge the original.
That is at least once: a crash between the publish and the ack leaves the
message in both places, so run them while the tasks involved are idempotent,
or check the destination before running again.
"""

from __future__ import annotations

from queue import Empty
from typing import Any

from kombu import Connection, Producer
from kombu.message import Message

DEATH_HEADER = "x-sqlinbox-death"


def republish(producer: Producer, message: Message, queue: str, headers: dict[str, Any]) -> None:
    """Publish a received message again, unchanged but for ``headers``, to ``queue``."""
    properties = message.properties
    producer.publish(
        message.body,
        exchange="",
        routing_key=queue,
        headers=headers,
        content_type=message.content_type,
        content_encoding=message.content_encoding,
        priority=properties.get("priority"),
        correlation_id=properties.get("correlation_id"),
        reply_to=properties.get("reply_to"),
    )


def requeue_dead_letters(connection: Connection, dead_letter_queue: str,
                         limit: int | None = None) -> int:
    """Send parked messages back to the queue each came from; returns how many moved.

    The death record (``x-sqlinbox-death``) is dropped on the way, so a requeued
    message starts again with a fresh attempt count.
    """
    moved = 0
    with connection.SimpleQueue(dead_letter_queue) as parked, connection.Producer() as producer:
        while limit is None or moved < limit:
            try:
                message = parked.get(block=False)
            except Empty:
                break
            headers = dict(message.headers)
            death = headers.pop(DEATH_HEADER)
            republish(producer, message, death["queue"], headers)
            message.ack()
            moved += 1
    return moved


def move_queue(old: Connection, new: Connection, queue: str) -> int:
    """Move every message waiting in ``queue`` from one broker to another (e.g. ``sqla+`` to
    ``sqlinbox+``); returns how many moved."""
    moved = 0
    with old.SimpleQueue(queue) as source, new.Producer() as producer:
        while True:
            try:
                message = source.get(block=False)
            except Empty:
                return moved
            republish(producer, message, queue, dict(message.headers))
            message.ack()
            moved += 1
