"""The stored form of a message: its envelope, its body's encoding, its death record.

A kombu message is stored as a payload column (the body) plus a JSON envelope in the
headers column; a table without a headers column keeps the whole envelope, body
included, as JSON in its payload. Everything here is pure: no database, no I/O.
"""

from __future__ import annotations

import base64
import binascii
import json
import json.scanner
import uuid
from datetime import date, datetime, time, timezone
from decimal import Decimal
from reprlib import repr as saferepr
from typing import TYPE_CHECKING, Any, cast

from .errors import ConfigurationError
from .exact import as_written, json_text, tagged
from .tables import Role, TableSpec

if TYPE_CHECKING:
    from .rows import ClaimedRow, QueueTable

#: properties that describe one delivery, rebuilt on every claim rather than stored
DELIVERY_PROPERTIES = ("delivery_tag", "delivery_info")
#: message headers whose values fill the group and partition-key columns on publish
GROUP_HEADER = "group_key"
PARTITION_HEADER = "partition_key"
#: delivery_info key set on every delivery: which row it is, so a task's own transaction
#: can take the row over by id and fencing token (transactional tasks). In delivery_info,
#: not the headers: a message is delivered with exactly the headers it was published with,
#: and Celery copies headers, never delivery_info, into the messages it publishes again
ROW_KEY = "sqlinbox_row"
#: envelope key of a message's expiry (epoch seconds): kombu's ``expiration`` property or
#: its queue's ``x-message-ttl``, made absolute at publish
EXPIRES_KEY = "expires_at"
#: header carrying why and from where a message reached a dead-letter queue
DEATH_HEADER = "x-sqlinbox-death"


#: the types a text field of an envelope, a stored body, an expiry may have
_TEXT = (str, type(None))
_BODY = (str, bytes, type(None))
_NUMBER = (int, float, type(None))


class Undecodable(ValueError):
    """A row whose stored message cannot be turned back into a kombu message."""


#: the scanner ``json.loads`` runs (of a decoder with its defaults), without the checks
#: around it (see :func:`_json`)
_scan = json.scanner.make_scanner(cast(Any, json.JSONDecoder()))


def _json(text: str) -> Any:
    """``json.loads`` of a stored envelope, at half its cost for those the transport
    writes: they start and end with their value, so the scanner alone reads them. Any
    other text (space around the value, a byte order mark, something after it, no JSON
    at all) goes through ``json.loads``, which reads it the same or raises."""
    try:
        value, end = _scan(text, 0)
    except StopIteration:
        return json.loads(text)
    return value if end == len(text) else json.loads(text)


def _text(value: Any, what: str, nullable: bool = False) -> str | None:
    """A stored column as text: a driver hands a BLOB over as bytes (psycopg2 as a
    memoryview), and SQLite's dynamic typing lets other code store a number in any
    column. What is neither text nor UTF-8 (nor a NULL, when ``nullable``) is
    :class:`Undecodable`."""
    if isinstance(value, str) or (value is None and nullable):
        return value
    if value is None:
        raise Undecodable(f"the {what} is NULL")
    if isinstance(value, (bytes, bytearray, memoryview)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise Undecodable(f"the {what} is not UTF-8: {exc}") from None
    raise Undecodable(f"the {what} holds {type(value).__name__} {saferepr(value)}, not text")


def convert_payload(payload: bytes | str, to_text: bool) -> bytes | str:
    if to_text and isinstance(payload, bytes):
        return payload.decode("utf-8", errors="replace")
    if not to_text and isinstance(payload, str):
        return payload.encode("utf-8")
    return payload


def expiry(expiration: float | None, queue_ttl: float | None, now: float) -> float | None:
    """When a message published at ``now`` expires (epoch seconds): the sooner of its
    ``expiration`` (seconds, :func:`expiration_seconds`) and its queue's TTL (seconds), as
    RabbitMQ takes the two; None when neither is set."""
    if expiration is None:
        return None if queue_ttl is None else now + queue_ttl
    return now + (expiration if queue_ttl is None else min(expiration, queue_ttl))


def expiration_seconds(message: dict[str, Any]) -> float | None:
    """A message's ``expiration`` property (milliseconds, as kombu writes it) in seconds;
    None when it has none, or none that is a number (RabbitMQ refuses such a message,
    Redis ignores the property, as here).

    Also None for a Celery task whose ``expiration`` came from ``apply_async(expires=)``
    (its ``expires`` header): the worker that receives it after that time records it
    revoked, where the caller's ``result.get()`` sees it; dropped unseen, the task
    would leave its caller waiting for ever."""
    headers = message.get("headers") or {}
    if headers.get("task") is not None and headers.get("expires") is not None:
        return None
    expiration = message["properties"].get("expiration")
    if expiration is not None:
        try:  # try, not contextlib.suppress: every publish passes here
            return max(0.0, float(expiration) / 1000.0)
        except (TypeError, ValueError):
            pass
    return None


def priority_of(properties: dict[str, Any]) -> int:
    """A message's ``priority`` property as stored: 0-255, higher first (as RabbitMQ); 0
    when it has none, or none that is a finite number (an infinite one failed the
    publish)."""
    try:  # try, not contextlib.suppress: every publish passes here
        return max(0, min(255, int(properties.get("priority") or 0)))
    except (TypeError, ValueError, OverflowError):
        return 0


def encode_message(message: dict[str, Any], table: QueueTable,
                   expires_at: float | None = None) -> tuple[bytes | str, str | None]:
    """Split a kombu message into the payload column (the body) and the headers envelope.

    A table without a headers role stores the whole message as JSON in its payload.
    """
    body = message.get("body")
    properties = {k: v for k, v in message["properties"].items() if k not in DELIVERY_PROPERTIES}
    info = message["properties"].get("delivery_info") or {}
    properties["routing"] = {"exchange": info.get("exchange"),
                             "routing_key": info.get("routing_key")}
    has_headers = table.spec.has(Role.HEADERS)
    if isinstance(body, bytes) and (table.payload_is_text or not has_headers):
        raw: bytes = body
        try:
            body = raw.decode("utf-8")
        except UnicodeDecodeError:
            body = base64.b64encode(raw).decode("ascii")
            properties["body_encoding"] = "base64"
    envelope = {
        "headers": message.get("headers") or {},
        "content-type": message.get("content-type"),
        "content-encoding": message.get("content-encoding"),
        "properties": properties,
    }
    if expires_at is not None:
        envelope[EXPIRES_KEY] = expires_at
    if not has_headers:
        envelope["body"] = body
        return convert_payload(json.dumps(envelope), table.payload_is_text), None
    if body is None:
        body = b""
    return convert_payload(body, table.payload_is_text), json.dumps(envelope)


def decode_row(row: ClaimedRow, table: QueueTable, delivery_tag: int) -> dict[str, Any]:
    """A claimed row as the raw message dict kombu's virtual Message takes, plus its
    expiry under :data:`EXPIRES_KEY` (for the transport to pop, never in the headers).

    Everything kombu and Celery read from the envelope is checked here, so that a row
    written by other code fails as :class:`Undecodable` (and is parked), never later in
    the consumer."""
    try:
        if table.spec.has(Role.HEADERS):
            stored = row.headers
            if type(stored) is not str:  # checked once: the transport writes text
                stored = _text(stored, "headers column", nullable=True)
            envelope = _json(stored) if stored else {}
            body: Any = row.payload
            if isinstance(body, memoryview):
                body = bytes(body)
        else:
            envelope = _json(_text(row.payload, "payload column") or "")  # never None
            body = envelope.get("body") if isinstance(envelope, dict) else None
        if not isinstance(envelope, dict):
            raise Undecodable("the stored envelope is not a JSON object")
        properties = envelope.get("properties") or {}
        headers = envelope.get("headers") or {}
        if not isinstance(properties, dict) or not isinstance(headers, dict):
            raise Undecodable("properties and headers must be JSON objects")
        routing = properties.pop("routing", None) or {}
        if (not isinstance(routing, dict)
                or not isinstance(exchange := routing.get("exchange"), _TEXT)
                or not isinstance(routing_key := routing.get("routing_key"), _TEXT)):
            raise Undecodable("routing must be a JSON object of exchange and routing_key strings")
        if (not isinstance(content_type := envelope.get("content-type"), _TEXT)
                or not isinstance(content_encoding := envelope.get("content-encoding"), _TEXT)):
            raise Undecodable("content-type and content-encoding must be strings")
        if not isinstance(body, _BODY):
            raise Undecodable("the stored body is not text")
        encoding = properties.get("body_encoding")
        if encoding == "base64":
            body = base64.b64decode(body or b"", validate=True)
        elif encoding not in (None, "utf-8"):
            raise Undecodable(f"unknown body_encoding {encoding!r}")
        properties["body_encoding"] = None
        expires_at = envelope.get(EXPIRES_KEY)
        if not isinstance(expires_at, _NUMBER):
            raise Undecodable(f"{EXPIRES_KEY} must be a number of epoch seconds")
    except (ValueError, UnicodeDecodeError, binascii.Error) as exc:
        raise Undecodable(f"cannot decode stored message: {exc}") from exc
    properties["delivery_tag"] = delivery_tag
    properties["delivery_info"] = {
        "exchange": exchange or "",
        "routing_key": routing_key or table.queue,
        "redelivered": row.attempt > 1,
        ROW_KEY: {"queue": table.queue, "id": row.id, "attempt": row.attempt},
    }
    return {
        EXPIRES_KEY: expires_at,
        "body": body,
        "content-type": content_type,
        "content-encoding": content_encoding,
        "headers": headers,
        "properties": properties,
    }


def eta_epoch(headers: dict[str, Any]) -> float | None:
    """Celery's ``eta`` header (ISO 8601) as epoch seconds; naive times are UTC."""
    eta = headers.get("eta")
    if not eta:
        return None
    if isinstance(eta, (int, float)):
        return float(eta)
    moment = datetime.fromisoformat(str(eta))
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return moment.timestamp()


def dead_letter_headers(headers: str | None, death: dict[str, Any]) -> str:
    """The envelope of a dead-lettered message: the original one plus the death record;
    an envelope that does not parse is kept verbatim inside the record. A message that
    dies again in a dead-letter queue keeps its earlier record under ``previous``: a
    requeue puts that one back, so the message can go on to where it first died."""
    try:
        envelope = json.loads(headers) if headers else {}
        parts = (envelope.get("headers", {}), envelope.get("properties", {}))
        if not all(isinstance(part, dict) for part in parts):
            raise ValueError("not an envelope")
    except (ValueError, AttributeError):
        envelope = {}
        death["original_headers"] = headers
    earlier = envelope.setdefault("headers", {}).get(DEATH_HEADER)
    if isinstance(earlier, dict):
        death["previous"] = earlier
    envelope["headers"][DEATH_HEADER] = death
    envelope.pop(EXPIRES_KEY, None)  # a dead letter is kept until someone looks at it
    return _dumps(envelope)  # original headers a BLOB held: as text


def parked_payload(payload: Any) -> bytes | str:
    """The payload a dead letter keeps: text or bytes as stored, a BLOB as its bytes, any
    other value other code stored there (a number, NULL) as its JSON text, so that the
    dead letter itself decodes."""
    if isinstance(payload, (bytes, str)):
        return payload
    return bytes(payload) if isinstance(payload, memoryview) else _dumps(payload)


# -- queues shared with other services: rows without Celery's envelope -----------------------
#: namespace of the task ids derived from rows (row mode): the same row, the same task id
ROW_TASK_NAMESPACE = uuid.UUID("5b0f3c52-8f5e-4d0c-9a53-2c7a1d1e4b6f")
#: the embed part of a Celery task body (protocol 2): no callbacks, chain or chord
NO_EMBED = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}


def stores_plain(spec: TableSpec) -> bool:
    """Whether a publish stores only the payload (and row columns), no envelope: a queue
    declared plain, or in row mode with no headers column to keep an envelope in."""
    return spec.plain or (spec.rows is not None and not spec.has(Role.HEADERS))


def _jsonable(value: Any) -> Any:
    """A column value JSON has no type for: bytes as text (whole: a byte that is not UTF-8
    as the lone surrogate of Python's ``surrogateescape``, ``"\\udcff"`` in the JSON),
    decimals as numbers, times in ISO 8601, the rest (UUIDs) as text."""
    if isinstance(value, (bytes, memoryview)):
        return bytes(value).decode("utf-8", "surrogateescape")
    if isinstance(value, Decimal):
        return int(value) if value == value.to_integral_value() else float(value)
    if isinstance(value, (date, time)):  # datetime is a date
        return value.isoformat()
    return str(value)


def _dumps(value: Any) -> str:
    return json.dumps(value, default=_jsonable)


def encode_plain(message: dict[str, Any], table: QueueTable
                 ) -> tuple[bytes | str | None, tuple[Any, ...]]:
    """A kombu message as a row without Celery's envelope: the payload column and the
    values of the row columns (:attr:`~.tables.TableSpec.row_columns`).

    A Celery task message to a queue in row mode is stored as the row that would run it
    (its task name, its arguments as the declaration maps them); anything else stores its
    serialized body. What the declaration cannot hold is refused, never dropped."""
    spec, rows = table.spec, table.spec.rows
    headers = message.get("headers") or {}
    body = message.get("body")
    columns: dict[str, Any] = {}
    if rows is not None:
        if "task" not in headers:
            raise ConfigurationError(
                f"queue {table.queue!r} is in row mode: only Celery tasks can be published "
                "to it")
        task = headers["task"]
        if rows.name is not None and task != rows.name:
            raise ConfigurationError(
                f"queue {table.queue!r} runs task {rows.name!r} for every row, not {task!r}")
        args, kwargs = _task_arguments(message, table.queue)
        if rows.column is not None:
            columns[rows.column] = task
        if rows.from_columns:
            unknown = sorted(set(kwargs) - set(rows.arguments))
            if args or unknown:
                raise ConfigurationError(
                    f"queue {table.queue!r} takes keyword arguments "
                    f"{', '.join(rows.arguments)} only, got args {args!r}, "
                    f"kwargs {sorted(kwargs)!r}")
            columns.update((name, tagged(kwargs.get(name))) for name in rows.arguments)
            body = None
        elif (args if rows.arguments == "kwargs" else kwargs):
            raise ConfigurationError(
                f"queue {table.queue!r} stores {rows.arguments} only, got args {args!r}, "
                f"kwargs {sorted(kwargs)!r}")
        else:
            body = _dumps(kwargs if rows.arguments == "kwargs" else args)
        for name, check in table.exact:
            why = check(columns.get(name))
            if why is not None:
                what = "the task name" if name == rows.column else f"argument {name}"
                raise ConfigurationError(
                    f"queue {table.queue!r}: {what}={saferepr(columns.get(name))} does not "
                    f"fit column {name} of table {spec.table!r} exactly: {why}; "
                    "nothing was written")
        columns = {name: json_text(value) if name in table.as_json and value is not None
                   else as_written(value) for name, value in columns.items()}
    if spec.has(Role.PAYLOAD) and body is None:
        body = b""
    payload = None if body is None else convert_payload(body, table.payload_is_text)
    return payload, tuple(columns.get(name) for name in spec.row_columns)


def _task_arguments(message: dict[str, Any], queue: str) -> tuple[list[Any], dict[str, Any]]:
    """The args and kwargs of a Celery task message (protocol 2, JSON)."""
    if message.get("content-type") != "application/json":
        raise ConfigurationError(
            f"queue {queue!r}: a row holds JSON arguments; the task was serialized as "
            f"{message.get('content-type')!r} (set serializer='json')")
    body = message.get("body") or ""
    try:
        args, kwargs, _ = json.loads(body.decode("utf-8") if isinstance(body, bytes) else body)
    except (TypeError, ValueError) as exc:
        raise ConfigurationError(f"queue {queue!r}: not a Celery task body: {exc}") from None
    return list(args), dict(kwargs)


def decode_stored(row: ClaimedRow, table: QueueTable, delivery_tag: int) -> dict[str, Any]:
    """A claimed row as kombu's raw message, whichever way its queue stores messages: a
    row in row mode as the Celery task it runs, a plain row as a JSON message, a row with
    an envelope (one kombu wrote) by :func:`decode_row`."""
    spec = table.spec
    if (spec.rows is None and not spec.plain) or row.headers is not None:
        return decode_row(row, table, delivery_tag)
    if isinstance(row.payload, memoryview):
        row = row._replace(payload=bytes(row.payload))
    if spec.rows is not None:
        message = _row_task(row, table)
    else:
        message = {"body": row.payload, "headers": {}, "content-type": "application/json",
                   "content-encoding": "utf-8", "properties": {}}
    message["properties"]["delivery_info"] = {"exchange": "", "routing_key": table.queue}
    payload, headers = encode_message(message, table)
    return decode_row(row._replace(payload=payload, headers=headers), table, delivery_tag)


def _row_task(row: ClaimedRow, table: QueueTable) -> dict[str, Any]:
    """The Celery task message (protocol 2, as ``app.amqp.as_task_v2`` builds it) that a
    row in row mode runs; its task id is derived from the queue and the row's id, so a
    redelivery keeps it."""
    rows = table.spec.rows
    assert rows is not None
    values = dict(zip(table.spec.row_columns, row.columns, strict=True))
    name = rows.name if rows.column is None else values[rows.column]
    if not isinstance(name, str) or not name:
        raise Undecodable(f"the row names no task: column {rows.column!r} is {name!r}")
    args: Any = []
    kwargs: Any = {}
    if isinstance(rows.arguments, tuple):
        kwargs = {column: values[column] for column in rows.arguments}
        for column, value in kwargs.items():
            if isinstance(value, (bytes, memoryview)):  # a binary column: its bytes' text
                kwargs[column] = _text(value, f"column {column!r}")
    else:
        raw = _text(row.payload, "payload column") or ""  # never None: not nullable
        try:
            found = json.loads(raw)
        except ValueError as exc:
            raise Undecodable(f"the payload column is not JSON: {exc}") from exc
        wanted = dict if rows.arguments == "kwargs" else list
        if not isinstance(found, wanted):
            raise Undecodable(
                f"the payload column must hold a JSON {'object' if wanted is dict else 'array'}"
                f" of {'keyword' if wanted is dict else 'positional'} arguments, got "
                f"{type(found).__name__}")
        if wanted is dict:
            kwargs = found
        else:
            args = found
    task_id = str(uuid.uuid5(ROW_TASK_NAMESPACE, f"{table.queue}/{row.id}"))
    return {
        "body": _dumps([args, kwargs, NO_EMBED]),
        "content-type": "application/json",
        "content-encoding": "utf-8",
        "headers": {
            "lang": "py", "task": name, "id": task_id, "shadow": None, "eta": None,
            "expires": None, "group": None, "group_index": None, "retries": 0,
            "timelimit": [None, None], "root_id": task_id, "parent_id": None,
            "argsrepr": saferepr(args), "kwargsrepr": saferepr(kwargs),
            "origin": f"sqlinbox row {table.spec.table}", "ignore_result": False,
        },
        "properties": {"correlation_id": task_id, "reply_to": ""},
    }


def parked_row(row: ClaimedRow, table: QueueTable, death: dict[str, Any]) -> tuple[str, str]:
    """The dead letter of a row without an envelope: its raw columns, as a JSON object by
    column name, and an envelope with the death record, so it reads as a JSON message.
    The record's ``columns`` names them, with how each bytes value was written as text
    (``utf-8``, or ``base64`` where it is not UTF-8; None for other values), so that a
    requeue writes the row back as it was."""
    spec = table.spec
    values: dict[str, Any] = {}
    for role, value in ((Role.PAYLOAD, row.payload), (Role.GROUP, row.group),
                        (Role.PARTITION_KEY, row.partition_key)):
        if spec.has(role):
            values[spec.name_of(role)] = value
    values.update(zip(spec.row_columns, row.columns, strict=True))
    death["columns"] = dict.fromkeys(values)
    for name, value in values.items():
        if isinstance(value, (bytes, memoryview)):
            try:
                values[name] = bytes(value).decode("utf-8")
                death["columns"][name] = "utf-8"
            except UnicodeDecodeError:
                values[name] = base64.b64encode(value).decode("ascii")
                death["columns"][name] = "base64"
    envelope = json.dumps({"content-type": "application/json", "content-encoding": "utf-8"})
    return _dumps(values), dead_letter_headers(envelope, death)


def unparked_row(body: bytes | str, columns: dict[str, Any]) -> dict[str, Any]:
    """The raw columns of a row :func:`parked_row` parked, by name, as they were written:
    bytes where they were bytes; a JSON value the driver had parsed (a JSON column) as
    its text."""
    try:
        values = json.loads(body)
        if not isinstance(values, dict) or set(values) != set(columns):
            raise ValueError(f"the parked row holds columns {sorted(values)}, its death "
                             f"record names {sorted(columns)}")
        for name, written in columns.items():
            value = values[name]
            if written == "base64":
                values[name] = base64.b64decode(value, validate=True)
            elif written == "utf-8":
                values[name] = value.encode("utf-8")
            elif isinstance(value, (dict, list)):
                values[name] = json.dumps(value)
    except (ValueError, TypeError, AttributeError, binascii.Error) as exc:
        raise Undecodable(f"cannot read the parked row back: {exc}") from exc
    return values
