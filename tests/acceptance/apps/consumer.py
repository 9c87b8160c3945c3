"""A plain kombu consumer process for the race test.

``python -m tests.acceptance.apps.consumer BROKER OPTIONS_JSON QUEUE PREFETCH OUT``
consumes ``{"n": ...}`` messages and acks each one; it leaves ``OUT.ready`` once
it consumes, stops when ``OUT.stop`` exists and the queue has gone quiet, and
writes what it received to ``OUT`` as JSON after closing its connection (so every
ack has been settled by then).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from kombu import Connection, Message, Queue

import kombu_sqlinbox  # noqa: F401  (registers the sqlinbox alias)

#: a consumer the parent forgot still ends by itself
LIFETIME = 600.0


def main(broker: str, options: str, queue: str, prefetch: str, out: str) -> None:
    result = Path(out)
    received: list[int] = []
    redelivered = 0

    def on_message(body: Any, message: Message) -> None:
        nonlocal redelivered
        received.append(int(body["n"]))
        redelivered += bool(message.delivery_info.get("redelivered"))
        message.ack()

    deadline = time.monotonic() + LIFETIME
    with Connection(broker, transport_options=json.loads(options)) as conn, conn.Consumer(
        Queue(queue), callbacks=[on_message], prefetch_count=int(prefetch), accept=["json"]
    ):
        result.with_name(result.name + ".ready").touch()
        while time.monotonic() < deadline:
            try:
                conn.drain_events(timeout=0.5)
            except TimeoutError:
                if result.with_name(result.name + ".stop").exists():
                    break
    partial = result.with_name(result.name + ".part")
    partial.write_text(json.dumps({"received": received, "redelivered": redelivered}))
    partial.rename(result)


if __name__ == "__main__":
    main(*sys.argv[1:])
