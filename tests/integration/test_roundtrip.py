"""A message comes back exactly as it was sent: body, properties, headers, content type."""

from __future__ import annotations

import pytest
from kombu import Consumer, Queue
from kombu.message import Message
from sqlalchemy import inspect
from sqlalchemy.engine import Engine

from .conftest import Connect
from .support import get_within, publish, settled, table_of

#: what a driver returns for a payload, a headers column, a time: every variant
pytestmark = pytest.mark.drivers

HOSTILE_HEADERS = {
    "sql": "'; DROP TABLE x; --",
    "quotes": "\"`'\\",
    "unicode": "ünïcødé ✓ 日本語 🚀",
    "binaryish": "".join(chr(c) for c in range(1, 32)) + "\x7f\x80\xff\ufffd",
    "nested": {"list": [1, "two", None], "flag": True},
}


def test_publish_consume_round_trip(connect: Connect) -> None:
    conn = connect()
    sent = [{"n": n, "text": f"message {n}"} for n in range(5)]
    for body in sent:
        publish(conn, "jobs", body)
    received: list[Message] = []
    with Consumer(conn.default_channel, [Queue("jobs")], callbacks=[
            lambda body, message: received.append(message)], accept=["json"]):
        while len(received) < len(sent):
            conn.drain_events(timeout=10)
    assert [message.decode() for message in received] == sent
    for message in received:
        message.ack()


def test_properties_headers_and_content_type_survive(
    connect: Connect, engine: Engine, table_prefix: str,
) -> None:
    conn = connect()
    publish(
        conn, "jobs", '{"hello": "world"}', content_type="application/x-custom",
        content_encoding="utf-8", headers=HOSTILE_HEADERS, correlation_id="corr-1",
        reply_to="replies", priority=7, expiration=60,
    )
    message = get_within(conn, "jobs")
    assert {key: message.headers.get(key) for key in HOSTILE_HEADERS} == HOSTILE_HEADERS
    assert message.content_type == "application/x-custom"
    assert message.content_encoding == "utf-8"
    assert message.body == b'{"hello": "world"}'
    assert message.properties["correlation_id"] == "corr-1"
    assert message.properties["reply_to"] == "replies"
    assert message.properties["priority"] == 7
    assert message.delivery_info["routing_key"] == "jobs"
    assert message.delivery_info["redelivered"] is False
    message.ack()
    settled(conn)
    assert inspect(engine).has_table(table_of("jobs", table_prefix))


def test_binary_body_survives(connect: Connect) -> None:
    conn = connect()
    body = bytes(range(256)) * 64 + b"\xff\xfe\x00\xc3\x28"
    publish(conn, "jobs", body, content_type="application/octet-stream",
            content_encoding="binary")
    message = get_within(conn, "jobs")
    assert message.body == body
    assert message.content_type == "application/octet-stream"
    message.ack()
