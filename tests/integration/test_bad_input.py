"""Bad input: rows the transport cannot decode, hostile queue names."""

from __future__ import annotations

import base64
import json

import pytest
from kombu import Consumer, Queue
from kombu.message import Message
from sqlalchemy import inspect, text
from sqlalchemy.engine import Engine

from kombu_sqlinbox import ConfigurationError, Role, TableBuilder, TableSpec
from kombu_sqlinbox.dialects import (
    LimitStatements,
    PauseStatements,
    RateStatements,
    RoutingStatements,
    dialect_for,
)

from .conftest import Connect
from .support import DEAD_LETTERS, count_rows, death, get_within, publish, quoted, table_of

#: a headers column that does not hold a message envelope, and the reason it is parked with
BAD_ENVELOPES = {
    "not-json": ("not json {", "cannot decode"),
    "json-then-more": ('{"properties": {}, "headers": {}} {}', "cannot decode"),
    "json-array": ("[1, 2]", "not a JSON object"),
    "properties-not-object": ('{"properties": "x", "headers": {}}', "JSON objects"),
    "routing-not-object": ('{"properties": {"routing": "x"}, "headers": {}}', "routing"),
    "routing-key-not-text": ('{"properties": {"routing": {"routing_key": 5}}, "headers": {}}',
                             "routing"),
    "unknown-body-encoding": ('{"properties": {"body_encoding": "rot13"}, "headers": {}}',
                              "body_encoding"),
    "content-type-not-text": ('{"content-type": 5, "properties": {}, "headers": {}}',
                              "content-type"),
}


def insert_raw(engine: Engine, table: str, payload: bytes, headers: str | None = None,
               attempt: int = 0) -> None:
    """Write a row the way non-Celery code would: plain SQL, no envelope checks."""
    columns = "payload, attempt" if headers is None else "payload, attempt, headers"
    values = ":payload, :attempt" if headers is None else ":payload, :attempt, :headers"
    with engine.begin() as conn:
        conn.execute(text(f"INSERT INTO {quoted(engine, table)} ({columns}) VALUES ({values})"),
                     {"payload": payload, "headers": headers, "attempt": attempt})


@pytest.mark.drivers
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


@pytest.mark.drivers
def test_a_consumer_goes_on_past_a_row_it_cannot_decode(
    connect: Connect, engine: Engine, table_prefix: str,
) -> None:
    """The row is parked inside the consumer's own drain loop; the next one is delivered."""
    conn = connect(**DEAD_LETTERS)
    conn.default_channel.queue_declare("jobs")
    insert_raw(engine, table_of("jobs", table_prefix), b"raw",
               BAD_ENVELOPES["routing-not-object"][0])
    publish(conn, "jobs", {"good": True})
    received: list[Message] = []
    with Consumer(conn.default_channel, [Queue("jobs")], callbacks=[
            lambda body, message: received.append(message)], accept=["json"]):
        conn.drain_events(timeout=10)
    assert [m.decode() for m in received] == [{"good": True}]
    assert "routing" in death(get_within(conn, "jobs.dead"))["reason"]


@pytest.mark.drivers
def test_a_row_past_max_attempts_is_parked_for_that_whether_or_not_it_decodes(
    connect: Connect, engine: Engine, table_prefix: str,
) -> None:
    """Its reason is max_attempts even when it would not decode either; the parked copy
    gets an envelope that decodes."""
    headers = BAD_ENVELOPES["routing-not-object"][0]
    conn = connect(queues={"jobs": {"dead_letter_queue": "jobs.dead", "max_attempts": 3}})
    conn.default_channel.queue_declare("jobs")
    insert_raw(engine, table_of("jobs", table_prefix), b"tried often", headers, attempt=3)
    publish(conn, "jobs", {"good": True})
    assert get_within(conn, "jobs").decode() == {"good": True}
    parked = get_within(conn, "jobs.dead")
    assert parked.body == b"tried often"
    record = death(parked)
    assert record["reason"].startswith("delivered 4 times, max_attempts is 3")
    assert record["original_headers"] == headers


#: a headers column the database itself keeps as JSON, where it has such a type
JSON_HEADERS = {"postgresql": "JSONB NOT NULL", "mysql": "JSON NOT NULL", "sqlite": "JSON"}


def json_headers_table(engine: Engine, database: str, table: str) -> TableSpec:
    """A declared table whose headers column has a JSON type, created by plain DDL."""
    spec = TableBuilder(table).id().payload().headers("meta").attempt().locked_until().build()
    dialect = dialect_for(engine)
    text_type = f"{dialect.quote('meta')} {dialect.column_types[Role.HEADERS]}"
    with engine.begin() as conn:
        for statement in dialect.create_ddl(spec):
            conn.exec_driver_sql(statement.replace(
                text_type, f"{dialect.quote('meta')} {JSON_HEADERS[database]}"))
    return spec


@pytest.mark.drivers
def test_a_json_headers_column_delivers_what_the_driver_returns_as_a_dict(
    connect: Connect, engine: Engine, table_prefix: str, database: str,
) -> None:
    """PostgreSQL's drivers hand JSONB over as a dict, MariaDB and SQLite as text: both
    decode, from a publish and from a row written by plain SQL; a bad one there is parked."""
    table = f"{table_prefix}json_jobs"
    spec = json_headers_table(engine, database, table)
    conn = connect(queues={"jobs": {"table": spec, "dead_letter_queue": "jobs.dead"}})
    conn.default_channel.queue_declare("jobs")
    envelope = ('{"headers": {"trace": "t-1"}, "content-type": "application/json", '
                '"content-encoding": "utf-8", "properties": {}}')
    with engine.begin() as sql:
        for meta in (BAD_ENVELOPES["routing-not-object"][0], envelope):
            sql.execute(text(f"INSERT INTO {quoted(engine, table)} (payload, meta) "
                             "VALUES (:payload, :meta)"), {"payload": b'{"raw": 1}', "meta": meta})
    publish(conn, "jobs", {"published": 2}, headers={"trace": "t-2"})
    first, second = get_within(conn, "jobs"), get_within(conn, "jobs")
    assert (first.decode(), first.headers["trace"]) == ({"raw": 1}, "t-1")
    assert (second.decode(), second.headers["trace"]) == ({"published": 2}, "t-2")
    parked = get_within(conn, "jobs.dead")
    assert "routing" in death(parked)["reason"]
    assert json.loads(death(parked)["original_headers"]) == {
        "properties": {"routing": "x"}, "headers": {}}
    first.ack()
    second.ack()


@pytest.mark.drivers
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
    """The name is a bound value in the routing tables and in the rate budget (every
    queue rate-limited here), and only ever part of its own table's name."""
    name = STORED_NAMES[case]
    conn = connect(rate_limit="1000/s")
    publish(conn, name, {"queue": name})
    message = get_within(conn, name)
    assert message.decode() == {"queue": name}
    assert message.delivery_info["routing_key"] == name
    table = table_of(name, table_prefix)
    (budget,) = RateStatements.tables(table_prefix)
    own = {*RoutingStatements.tables(table_prefix), *PauseStatements.tables(table_prefix),
           *LimitStatements.tables(table_prefix), budget}
    assert [t for t in inspect(engine).get_table_names()
            if t.startswith(table_prefix) and t not in own] == [table]
    with engine.connect() as db:
        names = db.execute(text(f"SELECT DISTINCT name FROM {quoted(engine, budget)}")).scalars()
        assert [bytes(found).decode() if isinstance(found, (bytes, bytearray)) else found
                for found in names] == [name]
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


def bare_table(prefix: str) -> TableSpec:
    """A declared table without a headers column: its payload holds the whole envelope."""
    return TableBuilder(f"{prefix}bare").id().payload().attempt().locked_until().build()


#: what other code may leave in a column of SQLite's dynamic typing (the declared type
#: does not constrain it): the row is parked, the consumer goes on
OTHER_TYPES = {
    "integer payload, no headers column": ("bare", {"payload": 42}, "holds int 42"),
    "real payload, no headers column": ("bare", {"payload": 4.5}, "holds float 4.5"),
    "blob headers": ("jobs", {"payload": b"{}", "headers": b"\xff{}"}, "not UTF-8"),
    "integer headers": ("jobs", {"payload": b"{}", "headers": 7}, "not a JSON object"),
}


@pytest.mark.databases("sqlite")
@pytest.mark.parametrize("case", list(OTHER_TYPES))
def test_a_column_holding_another_type_is_parked_and_the_next_delivered(
    connect: Connect, engine: Engine, table_prefix: str, case: str,
) -> None:
    """Through ``get`` and through a consumer's drain: neither raises, nothing stays held."""
    queue, values, reason = OTHER_TYPES[case]
    options = {"dead_letter_queue": "jobs.dead"}
    if queue == "bare":
        options["table"] = bare_table(table_prefix)  # type: ignore[assignment]
    conn = connect(queues={"jobs": options})
    conn.default_channel.queue_declare("jobs")
    table = f"{table_prefix}bare" if queue == "bare" else table_of("jobs", table_prefix)
    for _ in range(2):
        columns = ", ".join(values)
        with engine.begin() as sql:
            sql.execute(text(f"INSERT INTO {quoted(engine, table)} ({columns}) VALUES "
                             f"({', '.join(':' + name for name in values)})"), values)
        publish(conn, "jobs", {"good": True})
    assert get_within(conn, "jobs").decode() == {"good": True}
    received: list[Message] = []
    with Consumer(conn.default_channel, [Queue("jobs")], callbacks=[
            lambda body, message: received.append(message)], accept=["json"]):
        conn.drain_events(timeout=10)
    assert [m.decode() for m in received] == [{"good": True}]
    for _ in range(2):
        assert reason in death(get_within(conn, "jobs.dead"))["reason"]
    assert count_rows(engine, table) == 2  # the good ones, held; nothing else


@pytest.mark.databases("sqlite")
def test_a_parked_row_keeps_headers_that_are_not_utf8_byte_for_byte(
    connect: Connect, engine: Engine, table_prefix: str,
) -> None:
    """A BLOB in the headers column that is not UTF-8 is parked; the death record keeps
    the stored headers whole (each byte that is not UTF-8 as its ``surrogateescape``
    surrogate), as the payload is kept, so the row can be put back as it was."""
    conn = connect(queues={"jobs": {"dead_letter_queue": "jobs.dead"}})
    conn.default_channel.queue_declare("jobs")
    insert_raw(engine, table_of("jobs", table_prefix), b"{}", headers=b"\xff{}")  # type: ignore[arg-type]
    publish(conn, "jobs", {"good": True})
    assert get_within(conn, "jobs").decode() == {"good": True}
    kept = death(get_within(conn, "jobs.dead"))["original_headers"]
    assert kept.encode("utf-8", "surrogateescape") == b"\xff{}"


def row_mode_jobs(prefix: str) -> TableSpec:
    """Row mode: the payload column holds the keyword arguments of ``rows.handle``."""
    return (TableBuilder(f"{prefix}row_jobs").id().payload().attempt().locked_until()
            .task("rows.handle").build())


@pytest.mark.parametrize("attempt", [0, 2, 3, 5],
                         ids=["first-claim", "claim-at-max-attempts", "one-past", "far-past"])
def test_a_row_mode_payload_that_is_not_utf8_is_parked_and_the_next_delivered(
    connect: Connect, engine: Engine, table_prefix: str, attempt: int,
) -> None:
    """Parked with why: not UTF-8 on its first claim, max_attempts once past it (checked
    before the payload is read). The dead letter keeps the raw columns."""
    conn = connect(queues={"jobs": {"table": row_mode_jobs(table_prefix), "max_attempts": 3,
                                    "dead_letter_queue": "jobs.dead"}})
    conn.default_channel.queue_declare("jobs")
    insert_raw(engine, f"{table_prefix}row_jobs", b"\xff\xfe{}", attempt=attempt)
    insert_raw(engine, f"{table_prefix}row_jobs", b'{"n": 2}')
    assert get_within(conn, "jobs").payload[1] == {"n": 2}
    parked = get_within(conn, "jobs.dead")
    reason = death(parked)["reason"]
    # the claim makes the stored count one more: a row whose claim reaches max_attempts is
    # still read (and found unreadable), one past it is parked unread
    assert ("max_attempts is 3" if attempt >= 3 else "the payload column is not UTF-8") in reason
    kept = parked.decode()["payload"]
    assert death(parked)["columns"]["payload"] == "base64"
    assert base64.b64decode(kept) == b"\xff\xfe{}", "not kept byte for byte"
