"""A polling round of kombu's event loop (:confval:`event_loop`) that fails.

A failed round is logged and the next one set (see
``tests/acceptance/test_event_loop.py``, where a table renamed away makes rounds fail
under a real worker); a connection error is not swallowed: it leaves the hub, as a
connection error does on kombu's own brokers, so Celery connects again.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest
from kombu import Connection, Consumer, Queue
from kombu.asynchronous import Hub
from sqlalchemy import text

from kombu_sqlinbox.tables import table_name_for_queue
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


#: how long messages keep coming to a healthy queue while the other queue's rounds fail
TRAFFIC_FOR = 3.0
#: failed rounds a back-off of 0.2 s doubling allows in TRAFFIC_FOR (0.2, 0.4, 0.8, 1.6),
#: plus the first
BACKED_OFF_ROUNDS = 6
#: a consumer's sessions: the pool's, the LISTEN connection and the keeper's own
SESSIONS_OF_A_CONSUMER = 8


@pytest.mark.databases("postgresql")  # the wake-ups that come as readers: LISTEN
def test_wake_ups_do_not_run_failing_rounds_ahead_of_their_back_off(
        broker_url: str, table_prefix: str, engine: Any, caplog: pytest.LogCaptureFixture
) -> None:
    options = {"table_prefix": table_prefix, "event_loop": True, "polling_interval": 0.05}
    conn = Connection(f"{broker_url}?application_name={table_prefix}",
                      transport_options=options)
    sender = Connection(broker_url, transport_options=options)
    hub = Hub()
    received: list[Any] = []
    try:
        hub.propagate_errors = conn.connection_errors
        conn.register_with_event_loop(hub)
        broken, healthy = (Queue(name, routing_key=name) for name in ("broken", "healthy"))
        Consumer(conn, [broken, healthy], on_message=received.append).consume()
        hub.run_once()
        away = table_name_for_queue("broken", table_prefix)
        with engine.begin() as db:
            db.execute(text(f'ALTER TABLE "{away}" RENAME TO "{away}_away"'))
        producer = sender.Producer()
        sent = 0
        deadline = time.monotonic() + TRAFFIC_FOR
        while time.monotonic() < deadline:
            producer.publish({"n": sent}, routing_key="healthy", declare=[healthy])
            sent += 1
            until = time.monotonic() + 0.05
            while time.monotonic() < until:
                hub.run_once()
        failed = [r for r in caplog.records
                  if "a polling round failed" in r.getMessage() and r.levelno >= logging.ERROR]
        assert len(failed) <= BACKED_OFF_ROUNDS, (
            f"{len(failed)} failed rounds in {TRAFFIC_FOR}s for {sent} wake-ups")
        deadline = time.monotonic() + 1.0
        while len(received) < sent and time.monotonic() < deadline:
            hub.run_once()
        assert len(received) == sent  # the healthy queue is served as its messages come
        with engine.begin() as db:  # each failed claim's LISTEN connection was closed
            sessions = db.execute(text("SELECT count(*) FROM pg_stat_activity"
                                       " WHERE application_name = :name"),
                                  {"name": table_prefix}).scalar_one()
        assert sessions <= SESSIONS_OF_A_CONSUMER, f"{sessions} sessions left open"
        for message in received:
            message.ack()
        with engine.begin() as db:
            db.execute(text(f'ALTER TABLE "{away}_away" RENAME TO "{away}"'))
    finally:
        hub.close()
        conn.release()
        sender.release()
