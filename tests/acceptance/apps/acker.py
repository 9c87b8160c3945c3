"""A kombu program that acks what it received and ends without closing anything.

``python -m tests.acceptance.apps.acker BROKER OPTIONS_JSON QUEUE COUNT MARKERS``
receives COUNT messages, leaves ``MARKERS.received``, waits for ``MARKERS.ack``, acks
every message, leaves ``MARKERS.acked`` and returns. It neither closes its connection
nor flushes: only the transport's own exit handling can write those acks.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Any

from kombu import Connection, Message, Queue

import kombu_sqlinbox  # noqa: F401  (registers the sqlinbox alias)

#: how long it waits for its messages, and for the go-ahead to ack them
LIMIT = 60.0


def main(broker: str, options: str, queue: str, count: str, markers: str) -> None:
    base = Path(markers)
    received: list[Message] = []

    def on_message(body: Any, message: Message) -> None:
        received.append(message)

    conn = Connection(broker, transport_options=json.loads(options))
    conn.Consumer(Queue(queue), callbacks=[on_message], prefetch_count=int(count),
                  accept=["json"]).consume()
    deadline = time.monotonic() + LIMIT
    while len(received) < int(count):
        if time.monotonic() > deadline:
            raise SystemExit(f"received {len(received)} of {count} messages in {LIMIT}s")
        with contextlib.suppress(TimeoutError):
            conn.drain_events(timeout=0.5)
    base.with_name(base.name + ".received").touch()
    go = base.with_name(base.name + ".ack")
    while not go.exists():
        if time.monotonic() > deadline:
            raise SystemExit("no go-ahead to ack")
        time.sleep(0.05)
    for message in received:
        message.ack()
    base.with_name(base.name + ".acked").touch()


if __name__ == "__main__":
    main(*sys.argv[1:])
