"""Rows without Celery's envelope, without a database: a row in row mode becomes the
Celery task its declaration names, a plain row a JSON message, a task published to such
a queue the row that would run it, and what does not fit is refused or parked with why."""

from __future__ import annotations

import json
import uuid
from datetime import date, datetime, time, timezone
from decimal import Decimal
from typing import Any, cast

import pytest
from celery import Celery
from sqlalchemy import types as sqltypes
from sqlalchemy.dialects import mysql, postgresql

from kombu_sqlinbox import ConfigurationError, RowTask, TableBuilder, TableSpec
from kombu_sqlinbox.broker import QueueTable
from kombu_sqlinbox.claims import ClaimForm
from kombu_sqlinbox.codec import (
    DEATH_HEADER,
    ROW_TASK_NAMESPACE,
    Undecodable,
    decode_stored,
    encode_plain,
    parked_row,
    stores_plain,
    unparked_row,
)
from kombu_sqlinbox.dialects import ClaimedRow
from kombu_sqlinbox.exact import column_check
from kombu_sqlinbox.options import QueueOptions

QUEUE = "order_events"


def base(headers: bool = False) -> TableBuilder:
    builder = TableBuilder("order_events").id()
    if headers:
        builder.headers()
    return builder.attempt().locked_until()


BY_COLUMNS = base().group("order_id", fifo=True).task(
    "on_order_event", arguments=("order_id", "kind")).build()
BY_KWARGS = base().payload().task(column="task").build()
BY_ARGS = base().payload().task("add", arguments="args").build()
PLAIN = base().payload().plain().build()


def queue_table(spec: TableSpec, text: bool = True) -> QueueTable:
    return QueueTable(QUEUE, spec, QueueOptions(), text, False, cast(ClaimForm, None))


def row(columns: tuple[Any, ...] = (), payload: Any = None, headers: str | None = None,
        attempt: int = 1, row_id: int = 7) -> ClaimedRow:
    return ClaimedRow(row_id, attempt, payload, headers, None, None, columns)


def task_message(name: str, args: Any = (), kwargs: Any = None) -> dict[str, Any]:
    """A task message as Celery's producer hands it to ``_put`` (protocol 2, JSON)."""
    app = Celery(set_as_current=False)
    built = app.amqp.as_task_v2("tid-1", name, args=list(args), kwargs=kwargs or {})
    return {"body": json.dumps(built.body), "content-type": "application/json",
            "content-encoding": "utf-8", "headers": built.headers,
            "properties": {"delivery_info": {"exchange": "", "routing_key": QUEUE}}}


def test_a_row_becomes_the_declared_task_with_its_columns_as_keyword_arguments() -> None:
    table = queue_table(BY_COLUMNS)
    message = decode_stored(row((5, "paid")), table, 1)
    headers = message["headers"]
    assert headers["task"] == "on_order_event"
    assert headers["id"] == str(uuid.uuid5(ROW_TASK_NAMESPACE, f"{QUEUE}/7"))
    assert headers["root_id"] == headers["id"] and headers["retries"] == 0
    assert json.loads(message["body"])[:2] == [[], {"order_id": 5, "kind": "paid"}]
    assert message["content-type"] == "application/json"
    assert message["properties"]["delivery_info"]["routing_key"] == QUEUE


def test_a_redelivery_keeps_the_task_id_a_row_with_another_id_gets_another() -> None:
    table = queue_table(BY_COLUMNS)
    first = decode_stored(row((5, "paid")), table, 1)
    again = decode_stored(row((5, "paid"), attempt=2), table, 2)
    other = decode_stored(row((5, "paid"), row_id=8), table, 3)
    assert again["headers"]["id"] == first["headers"]["id"] != other["headers"]["id"]
    assert again["properties"]["delivery_info"]["redelivered"] is True


def test_column_values_json_has_no_type_for_arrive_as_numbers_and_text() -> None:
    message = decode_stored(row((Decimal("5"), b"paid")), queue_table(BY_COLUMNS), 1)
    assert json.loads(message["body"])[1] == {"order_id": 5, "kind": "paid"}
    message = decode_stored(row((Decimal("2.5"), uuid.UUID(int=1))), queue_table(BY_COLUMNS), 1)
    assert json.loads(message["body"])[1] == {"order_id": 2.5, "kind": str(uuid.UUID(int=1))}
    moment = datetime(2026, 11, 30, 12, 0, tzinfo=timezone.utc)
    message = decode_stored(row((moment, time(9, 30))), queue_table(BY_COLUMNS), 1)
    assert json.loads(message["body"])[1] == {"order_id": "2026-11-30T12:00:00+00:00",
                                              "kind": "09:30:00"}


def test_the_task_column_names_the_task_and_the_payload_holds_its_kwargs() -> None:
    message = decode_stored(row(("report",), b'{"day": "mon"}'), queue_table(BY_KWARGS, False), 1)
    assert message["headers"]["task"] == "report"
    assert json.loads(message["body"])[:2] == [[], {"day": "mon"}]


def test_the_payload_holds_positional_arguments() -> None:
    message = decode_stored(row((), "[1, 2]"), queue_table(BY_ARGS), 1)
    assert message["headers"]["task"] == "add"
    assert json.loads(message["body"])[:2] == [[1, 2], {}]


@pytest.mark.parametrize(("spec", "stored", "reason"), [
    (BY_KWARGS, row((None,), '{"day": "mon"}'), "the row names no task: column 'task' is None"),
    (BY_KWARGS, row(("",), '{"day": "mon"}'), "the row names no task"),
    (BY_KWARGS, row(("report",), "{oops"), "the payload column is not JSON"),
    (BY_KWARGS, row(("report",), "[1]"), "must hold a JSON object of keyword arguments"),
    (BY_ARGS, row((), '{"a": 1}'), "must hold a JSON array of positional arguments"),
    (BY_COLUMNS, row((5, b"\xffpaid")), "column 'kind' is not UTF-8"),
    (BY_COLUMNS, row((memoryview(b"\xfe"), "paid")), "column 'order_id' is not UTF-8"),
])
def test_a_row_that_cannot_be_a_task_is_undecodable_saying_why(
        spec: TableSpec, stored: ClaimedRow, reason: str) -> None:
    with pytest.raises(Undecodable, match=reason):
        decode_stored(stored, queue_table(spec), 1)


def test_a_row_kombu_wrote_with_its_envelope_decodes_as_any_message() -> None:
    spec = base(headers=True).payload().task(column="task").build()
    envelope = json.dumps({"headers": {"task": "report", "id": "kept"},
                           "content-type": "application/json", "properties": {}})
    message = decode_stored(row(("ignored",), '[[], {}, {}]', envelope), queue_table(spec), 1)
    assert message["headers"]["id"] == "kept"


def test_a_plain_row_reads_as_a_json_message() -> None:
    message = decode_stored(row((), b'{"to": "ann"}'), queue_table(PLAIN, False), 1)
    assert json.loads(message["body"]) == {"to": "ann"}
    assert message["content-type"] == "application/json"
    assert "task" not in message["headers"]


def test_which_queues_store_no_envelope() -> None:
    assert stores_plain(PLAIN) and stores_plain(BY_COLUMNS) and stores_plain(BY_KWARGS)
    assert not stores_plain(base(headers=True).payload().task("t").build())
    assert not stores_plain(base(headers=True).payload().build())


def test_a_task_published_to_a_row_mode_queue_is_stored_as_the_row_that_runs_it() -> None:
    payload, columns = encode_plain(task_message("on_order_event", kwargs={
        "order_id": 5, "kind": "paid"}), queue_table(BY_COLUMNS))
    assert (payload, columns) == (None, (5, "paid"))
    payload, columns = encode_plain(task_message("report", kwargs={"day": "mon"}),
                                    queue_table(BY_KWARGS))
    assert (json.loads(payload or ""), columns) == ({"day": "mon"}, ("report",))
    payload, columns = encode_plain(task_message("add", args=(1, 2)), queue_table(BY_ARGS, False))
    assert (payload, columns) == (b"[1, 2]", ())


def test_a_kombu_message_to_a_plain_queue_stores_its_body_alone() -> None:
    message = {"body": '{"a": 1}', "content-type": "application/json", "headers": {},
               "properties": {}}
    assert encode_plain(message, queue_table(PLAIN, False)) == (b'{"a": 1}', ())
    assert encode_plain({**message, "body": None}, queue_table(PLAIN)) == ("", ())


@pytest.mark.parametrize(("spec", "message", "refusal"), [
    (BY_KWARGS, {"body": "{}", "headers": {}, "properties": {}},
     "only Celery tasks can be published"),
    (BY_COLUMNS, task_message("other", kwargs={"order_id": 1, "kind": "x"}),
     "runs task 'on_order_event' for every row, not 'other'"),
    (BY_COLUMNS, task_message("on_order_event", args=(1,)), "takes keyword arguments"),
    (BY_COLUMNS, task_message("on_order_event", kwargs={"order_id": 1, "colour": "x"}),
     "takes keyword arguments order_id, kind only"),
    (BY_KWARGS, task_message("report", args=(1,)), "stores kwargs only"),
    (BY_ARGS, task_message("add", kwargs={"a": 1}), "stores args only"),
    (BY_KWARGS, {**task_message("report"), "content-type": "application/x-python-serialize"},
     "set serializer='json'"),
    (BY_KWARGS, {**task_message("report"), "body": "{}"}, "not a Celery task body"),
])
def test_what_the_row_cannot_hold_is_refused(spec: TableSpec, message: dict[str, Any],
                                             refusal: str) -> None:
    with pytest.raises(ConfigurationError, match=refusal):
        encode_plain(message, queue_table(spec))


def test_a_parked_row_keeps_its_raw_columns_and_reads_as_json() -> None:
    payload, headers = parked_row(row((Decimal(5), "paid")), queue_table(BY_COLUMNS),
                                  {"reason": "why"})
    assert json.loads(payload) == {"order_id": 5, "kind": "paid"}
    envelope = json.loads(headers)
    assert envelope["content-type"] == "application/json"
    assert envelope["headers"][DEATH_HEADER] == {
        "reason": "why", "columns": {"order_id": None, "kind": None}}
    payload, headers = parked_row(row(("report",), b"{oops"), queue_table(BY_KWARGS), {})
    assert json.loads(payload) == {"payload": "{oops", "task": "report"}
    columns = json.loads(headers)["headers"][DEATH_HEADER]["columns"]
    assert columns == {"payload": "utf-8", "task": None}
    assert unparked_row(payload, columns) == {"payload": b"{oops", "task": "report"}


def test_a_parked_row_that_is_not_utf8_reads_back_byte_for_byte() -> None:
    payload, headers = parked_row(row(("report",), b"\xff{"), queue_table(BY_KWARGS), {})
    columns = json.loads(headers)["headers"][DEATH_HEADER]["columns"]
    assert columns == {"payload": "base64", "task": None}
    assert unparked_row(payload, columns) == {"payload": b"\xff{", "task": "report"}
    with pytest.raises(Undecodable, match="cannot read the parked row back"):
        unparked_row(payload, {"payload": "base64"})


@pytest.mark.parametrize(("body", "columns"), [
    ('{"payload": "x"}', {"payload": "utf-8", "task": None}),  # a column missing
    ("{oops", {"payload": None}),  # not JSON
    ('{"payload": "not base64!"}', {"payload": "base64"}),
    ('{"payload": 5}', {"payload": "utf-8"}),  # a number is no text
    (None, {"payload": None}),  # no body at all
])
def test_a_parked_row_that_does_not_read_back_is_undecodable(
        body: str | None, columns: dict[str, Any]) -> None:
    with pytest.raises(Undecodable, match="cannot read the parked row back"):
        unparked_row(cast(str, body), columns)


@pytest.mark.parametrize(("arguments", "refusal"), [
    ({}, "name the task, or the column holding it"),
    ({"name": "t", "column": "c"}, "name the task, or the column holding it"),
    ({"name": ""}, "is not a name"),
    ({"column": "bad column"}, "not a valid identifier"),
    ({"name": "t", "arguments": ()}, "at least one argument column"),
    ({"name": "t", "arguments": ("a", "a")}, "an argument column repeats"),
    ({"name": "t", "arguments": ("a b",)}, "not a valid identifier"),
    ({"name": "t", "arguments": "both"}, "expected 'kwargs', 'args' or a tuple"),
])
def test_a_row_mode_declaration_that_cannot_work_fails_at_once(
        arguments: dict[str, Any], refusal: str) -> None:
    with pytest.raises(ConfigurationError, match=refusal):
        RowTask(**arguments)


def test_row_mode_from_the_payload_needs_a_payload_column_from_columns_none() -> None:
    for builder in (base().task("t"), base().task("t", arguments="args"), base()):
        with pytest.raises(ConfigurationError, match="needs a column with role payload"):
            builder.build()
    assert base().task("t", arguments=["a"]).build().row_columns == ("a",)


@pytest.mark.parametrize(("statement", "arguments", "refusal"), [
    ("UPDATE t SET payload = :payload", "kwargs", "must be an INSERT"),
    ("INSERT INTO t (payload, x) VALUES (:payload, :colour)", "kwargs", "binds :colour"),
    ("INSERT INTO t (payload) VALUES (:payload)", ("a", "priority"),
     "column 'priority' has the name of a parameter"),
])
def test_a_publish_statement_that_cannot_work_fails_at_declaration(
        statement: str, arguments: Any, refusal: str) -> None:
    with pytest.raises(ConfigurationError, match=refusal):
        base().payload().task("t", arguments=arguments).publish_statement(statement).build()


def test_a_publish_statement_binds_row_mode_columns_by_name() -> None:
    statement = "INSERT INTO t (order_id, kind) VALUES (:order_id, :kind)"
    assert base().task("t", arguments=("order_id", "kind")).publish_statement(
        statement).build().publish == statement


def test_a_publish_statement_may_bind_every_documented_parameter_and_cast() -> None:
    statement = ("INSERT INTO t (a, b, c, d, e, f, g, h) VALUES (:payload, :headers, :group, "
                 ":partition_key, :available_at, CAST(:priority AS INTEGER), :task_name, "
                 "'shop:'::text || :task_id)")
    assert base().payload().publish_statement(statement).build().publish == statement


def test_class_and_builder_forms_declare_the_same_shared_queue() -> None:
    from kombu_sqlinbox import Column, InboxTable, Role

    class Events(InboxTable, table="order_events", rows=RowTask("t", arguments="args"),
                 plain=True, publish="INSERT INTO order_events (payload) VALUES (:payload)"):
        id = Column(Role.ID, generated=True)
        attempt = Column(Role.ATTEMPT)
        locked_until = Column(Role.LOCKED_UNTIL)
        payload = Column(Role.PAYLOAD)

    built = (base().payload().task("t", arguments="args").plain()
             .publish_statement("INSERT INTO order_events (payload) VALUES (:payload)").build())
    assert Events.__spec__ == built and hash(Events.__spec__) == hash(built)


# -- which values a row mode column holds exactly --------------------------------------


@pytest.mark.parametrize(("database", "kind", "value", "why"), [
    ("postgresql", sqltypes.INTEGER(), 2**31, "out of range"),
    ("sqlite", sqltypes.INTEGER(), 2**31, None),  # SQLite's integers have 64 bits
    ("mysql", mysql.TINYINT(unsigned=True), 255, None),
    ("mysql", mysql.TINYINT(unsigned=True), -1, "out of range"),
    ("mysql", mysql.TINYINT(display_width=1), True, None),  # MySQL's BOOLEAN
    ("postgresql", sqltypes.BIGINT(), 3.0, None),
    ("postgresql", sqltypes.BIGINT(), [1], "not a number but list"),
    ("postgresql", sqltypes.BIGINT(), float("nan"), "not a finite number"),
    ("postgresql", postgresql.DOUBLE_PRECISION(), 2**53 + 1, "would round"),
    ("postgresql", postgresql.DOUBLE_PRECISION(), 0.1, None),
    ("postgresql", sqltypes.REAL(), 1e300, "single precision"),
    ("mysql", mysql.FLOAT(), 0.5, None),
    ("postgresql", sqltypes.NUMERIC(), 1.23456789, None),  # no precision: any
    ("postgresql", sqltypes.NUMERIC(5, 2), 999.99, None),
    ("postgresql", sqltypes.Uuid(), str(uuid.UUID(int=5)), None),
    ("postgresql", sqltypes.Uuid(), "A0EEBC99-9C0B-4EF8-BB6D-6BB9BD380A11", "canonical form"),
    ("postgresql", sqltypes.Uuid(), "not-a-uuid", "canonical form"),
    ("postgresql", sqltypes.CHAR(3), "ab", "pad it with spaces"),
    ("mysql", sqltypes.CHAR(3), "ab ", "ends in a space"),
    ("mysql", sqltypes.CHAR(3), "ab", None),
    ("sqlite", sqltypes.TEXT(), "any length", None),
    ("postgresql", postgresql.BYTEA(), "text", None),
    ("postgresql", sqltypes.TIMESTAMP(), "2026-12-03T10:00:00+02:00", "offset"),
    ("postgresql", sqltypes.TIMESTAMP(timezone=True), "2026-12-03T10:00:00", "no UTC offset"),
    ("postgresql", sqltypes.TIMESTAMP(timezone=True), "2026-12-03T10:00:00.5+00:00", None),
    ("mysql", mysql.DATETIME(), "2026-12-03T10:00:00.5", "fractional digits"),
    ("mysql", mysql.DATETIME(fsp=6), "2026-12-03T10:00:00.123456", None),
    ("sqlite", sqltypes.DATETIME(), "2026-12-03T10:00:00+02:00", None),  # kept as text
    ("postgresql", sqltypes.TIME(), "25:00", "ISO 8601"),
    ("postgresql", sqltypes.DATE(), "20261203", "YYYY-MM-DD"),
    ("postgresql", sqltypes.DATE(), "2026-12-3", "ISO 8601"),
    ("postgresql", sqltypes.BIGINT(), 10**400, "out of range"),
    ("postgresql", postgresql.DOUBLE_PRECISION(), -(10**400), "out of range"),
    ("postgresql", sqltypes.REAL(), 10**400, "out of range"),
    ("mysql", mysql.TIME(), "1000", "extended form (HH:MM:SS)"),  # MariaDB: 00:10:00
    ("mysql", mysql.TIME(), "10:00", None),
    ("postgresql", sqltypes.TIMESTAMP(), "20261203T1000", "extended form"),
    ("postgresql", sqltypes.TIMESTAMP(), "2026-12-03 10:00", None),
    ("postgresql", sqltypes.DATE(), "\uff12\uff10\uff12\uff16-12-03", "extended form"),
    ("mysql", mysql.ENUM("sad", "ok"), 1, "not one of"),  # MariaDB: its first value
    ("mysql", mysql.ENUM("sad", "ok"), "OK", "not one of"),  # its collation ignores case
    ("mysql", mysql.ENUM("sad", "ok"), "ok", None),
    ("postgresql", sqltypes.TEXT(), "a\x00b", "NUL"),
    ("mysql", sqltypes.VARCHAR(8), "\udcff", "lone surrogate"),
    ("postgresql", postgresql.BYTEA(), "\\x41", "backslash"),  # bytea's escape input
    ("mysql", mysql.VARBINARY(4), "\u00e9\u00e9\u00e9", "4 bytes"),
    ("mysql", mysql.VARBINARY(4), "\u00e9\u00e9", None),
    # what kombu's JSON tags (Decimal, date, time, UUID): checked as the value they are
    ("postgresql", sqltypes.BIGINT(), Decimal("12"), None),
    ("postgresql", sqltypes.BIGINT(), Decimal("12.5"), "not a whole number"),
    ("postgresql", sqltypes.NUMERIC(5, 2), Decimal("NaN"), "not a finite number"),
    ("postgresql", sqltypes.NUMERIC(5, 2), Decimal("1.005"), "3 decimal places"),
    ("postgresql", postgresql.DOUBLE_PRECISION(), Decimal("0.1"), None),
    ("postgresql", postgresql.DOUBLE_PRECISION(), Decimal("0.10000000000000000001"), "round"),
    ("postgresql", sqltypes.REAL(), Decimal("0.1"), "single precision"),
    ("postgresql", sqltypes.DATE(), date(2026, 12, 3), None),
    ("postgresql", sqltypes.DATE(), datetime(2026, 12, 3, 10), "extended form"),
    ("postgresql", sqltypes.TIMESTAMP(), datetime(2026, 12, 3, tzinfo=timezone.utc), "offset"),
    ("postgresql", sqltypes.Uuid(), uuid.UUID(int=5), None),
    ("postgresql", postgresql.JSONB(), {"a": [1, None]}, None),  # written as its JSON text
    ("postgresql", sqltypes.JSON(), float("nan"), "not JSON"),
    ("mysql", mysql.TIMESTAMP(), "2040-01-01T00:00:00", "out of the column's range"),
    ("mysql", mysql.TIMESTAMP(), "2026-12-03T10:00:00+02:00", "UTC offset"),
    ("mysql", mysql.DATETIME(), "2040-01-01T00:00:00", None),
    ("postgresql", postgresql.BYTEA(), b"\\x41", None),  # bytes are bound as they are
    ("postgresql", postgresql.BYTEA(), b"\xff", "not UTF-8"),
    ("mysql", mysql.VARBINARY(4), b"abcde", "4 bytes"),
    ("mysql", sqltypes.VARCHAR(4), b"ab", "not text but bytes"),
])
def test_a_column_takes_what_it_holds_exactly(database: str, kind: Any, value: Any,
                                              why: str | None) -> None:
    check = column_check(database, kind)
    assert check is not None and check(None) is None  # NULL is the database's to refuse
    found = check(value)
    assert (found is None) if why is None else (found is not None and why in found), found


@pytest.mark.parametrize(("database", "kind"), [
    ("postgresql", sqltypes.NullType()), ("mysql", sqltypes.JSON()),
    ("postgresql", postgresql.ARRAY(sqltypes.INTEGER()))])
def test_types_that_keep_any_value_as_given_have_no_check(database: str, kind: Any) -> None:
    assert column_check(database, kind) is None

