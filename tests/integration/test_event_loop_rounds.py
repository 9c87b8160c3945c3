"""A polling round of kombu's event loop (:confval:`event_loop`) that fails.

A failed round is logged and the next one set (see
``tests/acceptance/test_event_loop.py``, where a table renamed away makes rounds fail
under a real worker); a connection error is not swallowed: it leaves the hub, as a
connection error does on kombu's own brokers, so Celery connects again.
"""

from __future__ import annotations

import time

import pytest
from kombu import Connection, Consumer, Queue
from kombu.asynchronous import Hub

from tests.tcp_proxy import Proxy

#: how long the hub runs with the database unreachable: many polling intervals
ROUNDS_FOR = 10.0


@pytest.mark.databases("postgresql", "mysql")  # a database file has no connection to break
def test_a_connection_error_in_a_round_leaves_the_hub(
        db_url: str, table_prefix: str) -> None:
    from sqlalchemy.engine import make_url

    target = make_url(db_url)
    proxy = Proxy(str(target.host), int(target.port or 0))
    conn = Connection("sqlinbox+" + proxy.url(db_url), transport_options={
        "table_prefix": table_prefix, "event_loop": True, "polling_interval": 0.05})
    hub = Hub()
    try:
        hub.propagate_errors = conn.connection_errors  # as Celery's event loop sets them
        conn.register_with_event_loop(hub)
        queue = Queue("rounds", routing_key="rounds")
        Consumer(conn, [queue], on_message=lambda message: None).consume()
        hub.run_once()
        deadline = time.monotonic() + ROUNDS_FOR
        with proxy.refuse(), pytest.raises(conn.connection_errors):
            while time.monotonic() < deadline:  # a failed round waits 5 s at most
                hub.run_once()
    finally:
        hub.close()
        conn.release()
        proxy.close()
