"""The stored form of a message, without a database: what a publish writes into the
payload and headers columns is what a claim turns back into the same kombu message."""

from __future__ import annotations

import copy
import json
from datetime import datetime, timedelta, timezone
from typing import Any, cast

import pytest

from kombu_sqlinbox.broker import QueueTable
from kombu_sqlinbox.claims import ClaimForm
from kombu_sqlinbox.codec import (
    DEATH_HEADER,
    EXPIRES_KEY,
    GROUP_HEADER,
    PARTITION_HEADER,
    ROW_KEY,
    Undecodable,
    convert_payload,
    dead_letter_headers,
    decode_row,
    decode_stored,
    encode_message,
    eta_epoch,
    expiration_seconds,
    expiry,
)
from kombu_sqlinbox.dialects import ClaimedRow
from kombu_sqlinbox.options import QueueOptions
from kombu_sqlinbox.tables import TableBuilder

QUEUE = "jobs"
WITH_HEADERS = TableBuilder("jobs").id().payload().headers().attempt().locked_until().build()
WITHOUT_HEADERS = TableBuilder("jobs").id().payload().attempt().locked_until().build()
BINARY = bytes(range(256))
#: the (headers column?, text payload column?) layouts a queue table can have
LAYOUTS = [(True, False), (True, True), (False, False), (False, True)]


def queue_table(headers: bool = True, text: bool = False) -> QueueTable:
    """A queue's table as the transport sees it; the codec never claims, so no claim form."""
    spec = WITH_HEADERS if headers else WITHOUT_HEADERS
    return QueueTable(QUEUE, spec, QueueOptions(), text, True, cast(ClaimForm, None))


def kombu_message(body: bytes | str | None, **headers: Any) -> dict[str, Any]:
    """A message as kombu's virtual channel hands it to ``_put``."""
    return {
        "body": body,
        "content-type": "application/json",
        "content-encoding": "utf-8",
        "headers": headers,
        "properties": {
            "correlation_id": "c-1",
            "reply_to": "replies",
            "delivery_mode": 2,
            "priority": 7,
            "body_encoding": None,
            "delivery_tag": "tag-from-the-producer",
            "delivery_info": {"exchange": "tasks", "routing_key": "jobs.email"},
        },
    }


def stored(table: QueueTable, payload: bytes | str, headers: str | None,
           attempt: int = 1, row_id: int = 41) -> ClaimedRow:
    """The row a claim reads back: a text column returns text, a binary one bytes."""
    return ClaimedRow(row_id, attempt, convert_payload(payload, table.payload_is_text),
                      headers, None, None)


def round_trip(message: dict[str, Any], table: QueueTable, attempt: int = 1) -> dict[str, Any]:
    payload, headers = encode_message(message, table)
    return decode_row(stored(table, payload, headers, attempt), table, 5)


def as_bytes(body: bytes | str) -> bytes:
    return body.encode("utf-8") if isinstance(body, str) else body


# -- round trips -------------------------------------------------------------------


@pytest.mark.parametrize("headers, text", LAYOUTS)
@pytest.mark.parametrize("body", [b'{"args": [1]}', '{"args": ["caf\u00e9"]}', b"", BINARY])
def test_every_layout_gives_the_body_back(headers: bool, text: bool,
                                          body: bytes | str) -> None:
    decoded = round_trip(kombu_message(body), queue_table(headers, text))
    assert as_bytes(decoded["body"]) == as_bytes(body)


@pytest.mark.parametrize("headers, text", LAYOUTS)
def test_a_binary_body_comes_back_as_the_same_bytes(headers: bool, text: bool) -> None:
    """Bytes that are not UTF-8 travel base64-encoded where the column or the JSON
    envelope needs text, and come back as bytes, with no body_encoding left for kombu."""
    table = queue_table(headers, text)
    payload, _ = encode_message(kombu_message(BINARY), table)
    decoded = round_trip(kombu_message(BINARY), table)
    assert decoded["body"] == BINARY
    assert decoded["properties"]["body_encoding"] is None
    assert (payload == BINARY) is (headers and not text)


@pytest.mark.parametrize("headers, text", LAYOUTS)
def test_every_layout_gives_the_envelope_back(headers: bool, text: bool) -> None:
    eta = "2030-01-02T03:04:05+00:00"
    message = kombu_message(b"{}", eta=eta, task="app.send", retries=2,
                            **{GROUP_HEADER: "customer-9", PARTITION_HEADER: "shard-3"})
    decoded = round_trip(message, queue_table(headers, text))
    assert decoded["content-type"] == "application/json"
    assert decoded["content-encoding"] == "utf-8"
    assert decoded["headers"] == {
        "eta": eta, "task": "app.send", "retries": 2, "group_key": "customer-9",
        "partition_key": "shard-3",
    }
    properties = decoded["properties"]
    assert {k: properties[k] for k in ("correlation_id", "reply_to", "delivery_mode",
                                       "priority")} == {
        "correlation_id": "c-1", "reply_to": "replies", "delivery_mode": 2, "priority": 7}
    assert eta_epoch(decoded["headers"]) == datetime(2030, 1, 2, 3, 4, 5,
                                                     tzinfo=timezone.utc).timestamp()


@pytest.mark.parametrize("headers, text", LAYOUTS)
def test_delivery_properties_are_rebuilt_on_every_claim(headers: bool, text: bool) -> None:
    """The producer's tag and delivery info are not stored: each claim makes its own,
    routing included, and a second delivery says it is one."""
    table = queue_table(headers, text)
    payload, envelope = encode_message(kombu_message(b"{}"), table)
    written = json.loads(envelope or payload)
    assert not {"delivery_tag", "delivery_info"} & set(written["properties"])
    first = decode_row(stored(table, payload, envelope), table, 5)
    again = decode_row(stored(table, payload, envelope, attempt=2), table, 6)
    assert first["properties"]["delivery_tag"] == 5
    assert first["properties"]["delivery_info"] == {
        "exchange": "tasks", "routing_key": "jobs.email", "redelivered": False,
        ROW_KEY: {"queue": QUEUE, "id": 41, "attempt": 1}}
    assert again["properties"]["delivery_tag"] == 6
    assert again["properties"]["delivery_info"]["redelivered"] is True
    assert again["properties"]["delivery_info"][ROW_KEY] == {
        "queue": QUEUE, "id": 41, "attempt": 2}


def test_a_headers_column_holds_the_envelope_and_the_payload_only_the_body() -> None:
    payload, envelope = encode_message(kombu_message(b'{"a": 1}', x=1), queue_table())
    assert payload == b'{"a": 1}'
    assert envelope is not None and json.loads(envelope)["headers"] == {"x": 1}


@pytest.mark.parametrize("text", [False, True])
def test_without_a_headers_column_the_payload_holds_the_whole_message(text: bool) -> None:
    payload, envelope = encode_message(kombu_message(b'{"a": 1}', x=1), queue_table(False, text))
    assert envelope is None
    assert isinstance(payload, str if text else bytes)
    written = json.loads(payload)
    assert (written["body"], written["headers"]) == ('{"a": 1}', {"x": 1})


@pytest.mark.parametrize("headers, text, body", [
    (True, False, b""), (True, True, ""), (False, False, None), (False, True, None)])
def test_a_message_without_a_body(headers: bool, text: bool, body: bytes | str | None) -> None:
    assert round_trip(kombu_message(None), queue_table(headers, text))["body"] == body


def test_routing_defaults_to_the_queue() -> None:
    """A message published with no exchange or routing key is delivered as the queue's."""
    message = kombu_message(b"{}")
    message["properties"]["delivery_info"] = {}
    info = round_trip(message, queue_table())["properties"]["delivery_info"]
    assert info == {"exchange": "", "routing_key": QUEUE, "redelivered": False,
                    ROW_KEY: {"queue": QUEUE, "id": 41, "attempt": 1}}


def test_a_row_written_without_an_envelope_decodes_to_a_plain_message() -> None:
    """Other code may insert bare payloads into a table with a headers column."""
    table = queue_table()
    decoded = decode_row(stored(table, b"hello", None), table, 1)
    assert decoded["body"] == b"hello"
    assert decoded["headers"] == {}
    assert (decoded["content-type"], decoded["content-encoding"]) == (None, None)


def test_encoding_leaves_the_message_as_it_was() -> None:
    """kombu may publish the same message dict again (a retried publish)."""
    message = kombu_message(BINARY, eta="2030-01-01T00:00:00")
    before = copy.deepcopy(message)
    for headers, text in LAYOUTS:
        encode_message(message, queue_table(headers, text))
    assert message == before


# -- malformed rows ----------------------------------------------------------------


@pytest.mark.parametrize("envelope, error", [
    ("not json", "cannot decode stored message"),
    ("[1, 2]", "the stored envelope is not a JSON object"),
    ('"text"', "the stored envelope is not a JSON object"),
    ('{"properties": [1]}', "properties and headers must be JSON objects"),
    ('{"headers": "x"}', "properties and headers must be JSON objects"),
    ('{"properties": {"routing": "q"}}', "routing must be a JSON object"),
    ('{"properties": {"routing": {"exchange": 5}}}', "routing must be a JSON object"),
    ('{"properties": {"routing": {"routing_key": ["q"]}}}', "routing must be a JSON object"),
    ('{"content-type": 5}', "content-type and content-encoding must be strings"),
    ('{"content-encoding": {}}', "content-type and content-encoding must be strings"),
    ('{"properties": {"body_encoding": "rot13"}}', "unknown body_encoding 'rot13'"),
    ('{"properties": {"body_encoding": "base64"}}', "cannot decode stored message"),
    ('{} {}', "cannot decode stored message"),
    ('{}]', "cannot decode stored message"),
    (' {"a": }', "cannot decode stored message"),
    ('{"headers": {}}\x00', "cannot decode stored message"),
    ('\ufeff{"headers": {}}', "cannot decode stored message"),
])
def test_a_malformed_envelope_is_undecodable(envelope: str, error: str) -> None:
    table = queue_table()
    with pytest.raises(Undecodable, match=error):
        decode_row(stored(table, b"not base64!", envelope), table, 1)


@pytest.mark.parametrize("payload, error", [
    (b"\xff\xfe", "cannot decode stored message"),
    (b"not json", "cannot decode stored message"),
    (b"", "cannot decode stored message"),
    (b"[]", "the stored envelope is not a JSON object"),
    (b'{"body": 5}', "the stored body is not text"),
    (b'{"body": {"a": 1}}', "the stored body is not text"),
    (b'{"body": "%%", "properties": {"body_encoding": "base64"}}',
     "cannot decode stored message"),
    (b'{"body": "", "headers": ["x"]}', "properties and headers must be JSON objects"),
])
def test_a_malformed_payload_without_a_headers_column_is_undecodable(
        payload: bytes, error: str) -> None:
    table = queue_table(headers=False)
    with pytest.raises(Undecodable, match=error):
        decode_row(stored(table, payload, None), table, 1)


@pytest.mark.parametrize("before, after", [(" ", ""), ("", "\n"), ("\t\r\n", "  ")])
def test_an_envelope_with_space_around_it_decodes_as_without(before: str, after: str) -> None:
    """Rows other code wrote may pad their JSON, as json.loads allows."""
    table = queue_table()
    payload, headers = encode_message(kombu_message(b"{}", task="app.send"), table)
    assert headers is not None
    padded = stored(table, payload, before + headers + after)
    assert decode_row(padded, table, 5) == decode_row(stored(table, payload, headers), table, 5)


def test_undecodable_is_a_value_error() -> None:
    assert issubclass(Undecodable, ValueError)


# -- eta -------------------------------------------------------------------------


@pytest.mark.parametrize("headers, epoch", [
    ({}, None),
    ({"eta": None}, None),
    ({"eta": ""}, None),
    ({"eta": 1700000000}, 1700000000.0),
    ({"eta": 1700000000.5}, 1700000000.5),
    ({"eta": "2023-11-14T22:13:20+00:00"}, 1700000000.0),
    ({"eta": "2023-11-14T22:13:20"}, 1700000000.0),  # naive: UTC, not local time
    ({"eta": "2023-11-15T00:13:20+02:00"}, 1700000000.0),
])
def test_eta_epoch(headers: dict[str, Any], epoch: float | None) -> None:
    assert eta_epoch(headers) == epoch


def test_eta_epoch_of_a_celery_eta() -> None:
    moment = datetime.now(timezone.utc) + timedelta(minutes=5)
    assert eta_epoch({"eta": moment.isoformat()}) == pytest.approx(moment.timestamp())


def test_an_eta_that_is_no_time_is_refused() -> None:
    with pytest.raises(ValueError):
        eta_epoch({"eta": "tomorrow"})


# -- the death record ------------------------------------------------------------


DEATH = {"queue": QUEUE, "reason": "rejected", "attempts": 3, "id": 41, "at": 1700000000.0}


def test_the_death_record_joins_the_original_envelope() -> None:
    _, envelope = encode_message(kombu_message(b"{}", task="app.send"), queue_table())
    dead = json.loads(dead_letter_headers(envelope, dict(DEATH)))
    original = json.loads(envelope or "")
    assert dead["headers"] == {"task": "app.send", DEATH_HEADER: DEATH}
    assert dead["properties"] == original["properties"]
    assert dead["content-type"] == original["content-type"]


def test_a_second_death_keeps_the_first_record_under_previous() -> None:
    _, envelope = encode_message(kombu_message(b"{}", task="app.send"), queue_table())
    once = dead_letter_headers(envelope, dict(DEATH))
    again = {**DEATH, "queue": f"{QUEUE}.dead", "id": 7}
    twice = json.loads(dead_letter_headers(once, dict(again)))
    assert twice["headers"][DEATH_HEADER] == {**again, "previous": DEATH}


@pytest.mark.parametrize("headers", [None, ""])
def test_a_message_without_an_envelope_gets_one_for_its_death_record(
        headers: str | None) -> None:
    assert json.loads(dead_letter_headers(headers, dict(DEATH))) == {
        "headers": {DEATH_HEADER: DEATH}}


@pytest.mark.parametrize("headers", [
    "not json", "[1]", '"text"', "5", '{"headers": []}', '{"properties": "p"}'])
def test_an_envelope_that_does_not_parse_is_kept_inside_the_death_record(
        headers: str) -> None:
    dead = json.loads(dead_letter_headers(headers, dict(DEATH)))
    assert dead == {"headers": {DEATH_HEADER: {**DEATH, "original_headers": headers}}}


@pytest.mark.parametrize("text", [False, True])
def test_a_dead_letter_decodes_with_its_death_record(text: bool) -> None:
    """A parked message is delivered from its dead-letter queue like any other."""
    source = queue_table()
    payload, envelope = encode_message(kombu_message(b'{"a": 1}', task="app.send"), source)
    target = queue_table(text=text)
    parked = stored(target, convert_payload(payload, text),
                    dead_letter_headers(envelope, dict(DEATH)))
    decoded = decode_row(parked, target, 9)
    assert decoded["headers"][DEATH_HEADER] == DEATH
    assert decoded["headers"]["task"] == "app.send"
    assert as_bytes(decoded["body"]) == b'{"a": 1}'


# -- payload conversion ------------------------------------------------------------


@pytest.mark.parametrize("payload, to_text, converted", [
    (b"caf\xc3\xa9", True, "caf\u00e9"),
    ("caf\u00e9", False, b"caf\xc3\xa9"),
    (b"caf\xc3\xa9", False, b"caf\xc3\xa9"),
    ("caf\u00e9", True, "caf\u00e9"),
    (b"\xff", True, "\ufffd"),  # text columns cannot hold it: replaced, never an error
])
def test_convert_payload(payload: bytes | str, to_text: bool, converted: bytes | str) -> None:
    assert convert_payload(payload, to_text) == converted


# -- expiry ------------------------------------------------------------------------


def with_expiration(expiration: str | None) -> dict[str, Any]:
    message = kombu_message(b"{}")
    if expiration is not None:
        message["properties"]["expiration"] = expiration
    return message


@pytest.mark.parametrize("expiration, queue_ttl, expires", [
    (None, None, None), ("1500", None, 101.5), (None, 3.0, 103.0), ("1500", 0.5, 100.5),
    ("not-a-number", None, None), ("-5", None, 100.0)])
def test_a_message_expires_at_the_sooner_of_its_ttl_and_its_queues(
        expiration: str | None, queue_ttl: float | None, expires: float | None) -> None:
    assert expiry(expiration_seconds(with_expiration(expiration)), queue_ttl, now=100.0) == expires


@pytest.mark.parametrize("headers, text", LAYOUTS)
def test_the_expiry_is_stored_but_never_delivered_as_a_header(headers: bool, text: bool) -> None:
    table = queue_table(headers, text)
    payload, envelope = encode_message(kombu_message(b"{}", k1="v1"), table, expires_at=123.5)
    decoded = decode_row(stored(table, payload, envelope), table, 5)
    assert decoded[EXPIRES_KEY] == 123.5
    assert decoded["headers"] == {"k1": "v1"}


def test_an_expiry_that_is_not_a_number_is_undecodable() -> None:
    table = queue_table()
    envelope = json.dumps({"headers": {}, "properties": {}, EXPIRES_KEY: "soon"})
    with pytest.raises(Undecodable, match=EXPIRES_KEY):
        decode_row(stored(table, b"{}", envelope), table, 5)


def test_a_dead_letter_does_not_expire() -> None:
    envelope = json.dumps({"headers": {}, "properties": {}, EXPIRES_KEY: 1.0})
    assert EXPIRES_KEY not in json.loads(dead_letter_headers(envelope, {"reason": "expired"}))


# -- every decode path: what it cannot read is Undecodable, never another error ---------


#: a bare JSON message (no headers column: the payload holds it) and an envelope
BARE = '{"body": "{}", "headers": {}, "properties": {}}'
ENVELOPE = '{"headers": {"task": "t"}, "properties": {}}'
ROW_MODE = TableBuilder("jobs").id().payload().attempt().locked_until().task("t").build()
PLAIN = TableBuilder("jobs").id().payload().attempt().locked_until().plain().build()
#: each path the decoder has: the table, the column the stored value goes to (the other
#: holds a good value), the good text of that column, and which kinds of value it reads
#: (the rest must be Undecodable): a bare row (no envelope) in a table with headers, a
#: plain row's NULL payload and a plain row's binary payload are messages too
DECODE_PATHS: dict[str, tuple[Any, str, str, set[str]]] = {
    "envelope in headers, scanner": (WITH_HEADERS, "headers", ENVELOPE,
                                     {"str", "bytes", "memoryview", "None"}),
    "envelope in headers, json.loads": (WITH_HEADERS, "headers", f" {ENVELOPE}\n",
                                        {"str", "bytes", "memoryview", "None"}),
    "body beside an envelope": (WITH_HEADERS, "payload", "{}",
                                {"str", "bytes", "memoryview", "None", "not UTF-8"}),
    "envelope in payload, scanner": (WITHOUT_HEADERS, "payload", BARE,
                                     {"str", "bytes", "memoryview"}),
    "envelope in payload, json.loads": (WITHOUT_HEADERS, "payload", f"\t{BARE} ",
                                        {"str", "bytes", "memoryview"}),
    "row mode": (ROW_MODE, "payload", '{"a": 1}', {"str", "bytes", "memoryview"}),
    "plain row": (PLAIN, "payload", '{"a": 1}',
                  {"str", "bytes", "memoryview", "None", "not UTF-8"}),
}
#: how a driver may hand a column over: text, a BLOB (bytes, psycopg2's memoryview), or
#: what SQLite's dynamic typing lets other code store in any column
STORED_KINDS: dict[str, Any] = {
    "str": lambda good: good,
    "bytes": lambda good: good.encode(),
    "memoryview": lambda good: memoryview(good.encode()),
    "int": lambda good: 42,
    "float": lambda good: 4.2,
    "None": lambda good: None,
    "not UTF-8": lambda good: b"\xff\xfe" + good.encode(),
}


@pytest.mark.parametrize("kind", list(STORED_KINDS))
@pytest.mark.parametrize("path", list(DECODE_PATHS))
def test_every_decode_path_reads_a_value_or_finds_it_undecodable(path: str, kind: str) -> None:
    """Whatever a column holds, decoding it gives a message or raises Undecodable (the
    row is parked): never a TypeError or UnicodeDecodeError, which would stop the consumer
    at the same row on every claim. A BLOB read as bytes or a memoryview is its text."""
    spec, column, good, reads = DECODE_PATHS[path]
    table = QueueTable(QUEUE, spec, QueueOptions(), False, True, cast(ClaimForm, None))
    values = {"payload": b"{}", "headers": None if spec is not WITH_HEADERS else ENVELOPE}
    row = ClaimedRow(41, 1, **{**values, column: STORED_KINDS[kind](good)},  # type: ignore[arg-type]
                     group=None, partition_key=None)
    if kind not in reads:
        with pytest.raises(Undecodable):
            decode_stored(row, table, 5)
        return
    decoded = decode_stored(row, table, 5)
    if kind in ("bytes", "memoryview"):
        from_text = decode_stored(row._replace(**{column: good}), table, 5)
        assert as_bytes(decoded.pop("body")) == as_bytes(from_text.pop("body"))
        assert decoded == from_text
