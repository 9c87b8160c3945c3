"""Plain kombu on sqlinbox: a primary database and its standby, and a queue whose messages
expire. Run by the tests (tests/docs/test_examples.py)."""

from __future__ import annotations

from typing import Any

from kombu import Connection, Queue
from kombu.simple import SimpleQueue

import kombu_sqlinbox  # noqa: F401  (registers every sqlinbox+ URL scheme)


def connect(primary: str, standby: str, **options: Any) -> Connection:
    """A connection to the primary, or to the standby when the primary does not answer
    (kombu tries the URLs in turn, round robin, on every connection error)."""
    conn = Connection(f"{primary};{standby}", transport_options=options)
    conn.ensure_connection(max_retries=3, interval_start=0, interval_step=1)
    return conn


def short_lived(conn: Connection, name: str, seconds: float) -> SimpleQueue:
    """A queue whose messages expire ``seconds`` after they were published; a consumer
    never sees an expired one."""
    return conn.SimpleQueue(Queue(name, routing_key=name, message_ttl=seconds))
