"""Bad input: rows the transport cannot decode, hostile queue names."""

from __future__ import annotations

import pytest
from sqlalchemy import inspect, text
from sqlalchemy.engine import Engine

from kombu_sqlinbox import ConfigurationError, TableBuilder

from .conftest import Connect
from .support import DEAD_LETTERS, count_rows, death, get_within, publish, quoted, table_of

#: a headers column that does not hold a message envelope, and the reason it is parked with
BAD_ENVELOPES = {
    "not-json": ("not json {", "cannot decode"),
    "json-array": ("[1, 2]", "not a JSON object"),
    "properties-not-object": ('{"properties": "x", "headers": {}}', "JSON objects"),
}


def insert_raw(engine: Engine, table: str, payload: bytes, headers: str | None = None) -> None:
    """Write a row the way non-Celery code would: plain SQL, no envelope checks."""
    columns = "payload" if headers is None else "payload, headers"
    values = ":payload" if headers is None else ":payload, :headers"
    with engine.begin() as conn:
        conn.execute(text(f"INSERT INTO {quoted(engine, table)} ({columns}) VALUES ({values})"),
                     {"payload": payload, "headers": headers})


@pytest.mark.parametrize("case", list(BAD_ENVELOPES))
def test_row_with_undecodable_headers_is_dead_lettered_and_the_next_delivered(
    connect: Connect, engine: Engine, table_prefix: str, case: str,
) -> None:
    headers, reason = BAD_ENVELOPES[case]
    conn = connect(**DEAD_LETTERS)
    conn.default_channel.queue_declare("jobs")
    insert_raw(engine, table_of("jobs", table_prefix), b"raw payload", headers)
    publish(conn, "jobs", {"good": True})
    assert get_within(conn, "jobs").decode() == {"good": True}
    assert count_rows(engine, table_of("jobs", table_prefix)) == 1  # the good one, still held
    parked = get_within(conn, "jobs.dead")
    assert parked.body == b"raw payload"
    record = death(parked)
    assert record["queue"] == "jobs"
    assert reason in record["reason"]
    assert record["original_headers"] == headers


def test_garbage_payload_in_a_table_without_headers_is_dead_lettered(
    connect: Connect, engine: Engine, table_prefix: str,
) -> None:
    """Without a headers role the payload holds the whole envelope; garbage there is parked."""
    table = f"{table_prefix}bare"
    spec = TableBuilder(table).id().payload().attempt().locked_until().build()
    conn = connect(queues={"jobs": {"table": spec, "dead_letter_queue": "jobs.dead"}})
    conn.default_channel.queue_declare("jobs")
    insert_raw(engine, table, b"\xff\xfe garbage, not an envelope")
    publish(conn, "jobs", {"good": True})
    assert get_within(conn, "jobs").decode() == {"good": True}
    parked = get_within(conn, "jobs.dead")
    assert parked.body == b"\xff\xfe garbage, not an envelope"
    assert "cannot decode" in death(parked)["reason"]


STORED_NAMES = {
    "sql-injection": 'x"; DROP TABLE t; --',
    "punctuation": "a.b@c",
    "backquote": "a`b'c\\d",
    "long": "q" * 255,
    "unicode": "очередь.ünï 日本",
}


@pytest.mark.parametrize("case", list(STORED_NAMES))
def test_hostile_queue_name_is_stored_safely(
    connect: Connect, engine: Engine, table_prefix: str, case: str,
) -> None:
    name = STORED_NAMES[case]
    conn = connect()
    publish(conn, name, {"queue": name})
    message = get_within(conn, name)
    assert message.decode() == {"queue": name}
    assert message.delivery_info["routing_key"] == name
    table = table_of(name, table_prefix)
    assert [t for t in inspect(engine).get_table_names() if t.startswith(table_prefix)] == [table]
    message.ack()


@pytest.mark.parametrize("name", ["q" * 256, "nul\x00byte"], ids=["too-long", "nul"])
def test_unusable_queue_name_is_refused(connect: Connect, name: str) -> None:
    with pytest.raises(ConfigurationError, match="queue name"):
        connect().default_channel.queue_declare(name)


def test_names_differing_only_in_punctuation_never_share_a_table(
    connect: Connect, engine: Engine, table_prefix: str,
) -> None:
    names = ["a.b", "a_b", "a-b", "a@b", "a b", "A.B", "a:b"]
    conn = connect()
    for name in names:
        publish(conn, name, {"queue": name})
    tables = {table_of(name, table_prefix) for name in names}
    assert len(tables) == len(names)
    assert tables <= set(inspect(engine).get_table_names())
    for name in names:
        assert get_within(conn, name).decode() == {"queue": name}
        assert count_rows(engine, table_of(name, table_prefix)) == 1
