"""Large messages: 16 MiB round-trips everywhere; MySQL's packet limit is a clear error."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator

import pytest
from sqlalchemy import text
from sqlalchemy.engine import Engine

from kombu_sqlinbox import MessageTooLarge

from .conftest import Connect
from .support import get_within, publish

MIB = 1024 * 1024
#: what the suite needs on MySQL/MariaDB for a 16 MiB message (its default is exactly 16 MiB)
MYSQL_PACKET = 64 * MIB


@pytest.fixture
def room_for_large_messages(database: str, engine: Engine) -> Iterator[None]:
    """Raise MySQL's max_allowed_packet for connections opened from now on; left raised."""
    if database == "mysql":
        with engine.connect() as conn:
            current = conn.execute(text("SELECT @@GLOBAL.max_allowed_packet")).scalar_one()
            if int(current) < MYSQL_PACKET:
                conn.execute(text(f"SET GLOBAL max_allowed_packet = {MYSQL_PACKET}"))
    yield


@pytest.mark.usefixtures("room_for_large_messages")
def test_16_mib_payload_round_trips(connect: Connect) -> None:
    body = os.urandom(16 * MIB)
    conn = connect()
    publish(conn, "jobs", body, content_type="application/octet-stream",
            content_encoding="binary")
    message = get_within(conn, "jobs", timeout=30)
    assert hashlib.sha256(message.body).digest() == hashlib.sha256(body).digest()
    message.ack()


@pytest.mark.parametrize("database", ["mysql"], indirect=True)
@pytest.mark.usefixtures("room_for_large_messages")
def test_message_over_max_allowed_packet_is_refused_naming_it(
    connect: Connect, engine: Engine,
) -> None:
    with engine.connect() as conn:
        limit = int(conn.execute(text("SELECT @@GLOBAL.max_allowed_packet")).scalar_one())
    if limit > 4 * MYSQL_PACKET:
        pytest.skip(f"max_allowed_packet is {limit}: a message over it is too big to build here")
    conn = connect()
    with pytest.raises(MessageTooLarge, match="max_allowed_packet"):
        publish(conn, "jobs", b"x" * limit, content_type="application/octet-stream",
                content_encoding="binary")
    assert conn.default_channel.queue_declare("jobs", passive=True).message_count == 0


@pytest.mark.parametrize("database", ["mysql"], indirect=True)
def test_a_message_under_the_packet_as_encoded_but_over_it_as_sent_is_refused(
    connect: Connect, engine: Engine,
) -> None:
    """The driver puts a bound value in the statement's text (PyMySQL in hex, twice its
    size): a message under max_allowed_packet as encoded but over it as sent is refused
    with MessageTooLarge, not sent for the server to drop the connection."""
    with engine.connect() as conn:
        limit = int(conn.execute(text("SELECT @@GLOBAL.max_allowed_packet")).scalar_one())
    if limit > 4 * MYSQL_PACKET:
        pytest.skip(f"max_allowed_packet is {limit}: a message near it is too big to build here")
    conn = connect()
    with pytest.raises(MessageTooLarge, match="max_allowed_packet"):
        publish(conn, "jobs", b"\x00" * (limit * 2 // 3), content_type="application/octet-stream",
                content_encoding="binary")
    assert conn.default_channel.queue_declare("jobs", passive=True).message_count == 0
