"""Dead letters as the operations commands see them, and how one is written back.

A dead letter is a row of a dead-letter queue with a death record; a requeue writes it
into the queue it died in as that queue writes rows: through its declared publish
statement, as the raw row of a queue in row mode, or as the transport publishes. Pure
apart from the dialect's statements: no connection here.
"""

from __future__ import annotations

import fnmatch
import uuid
from dataclasses import dataclass
from typing import Any

from sqlalchemy import TextClause

from .codec import (
    DEATH_HEADER,
    GROUP_HEADER,
    PARTITION_HEADER,
    ROW_TASK_NAMESPACE,
    Undecodable,
    convert_payload,
    encode_message,
    encode_plain,
    eta_epoch,
    stores_plain,
    unparked_row,
)
from .dialects import Dialect
from .errors import ConfigurationError
from .rows import QueueTable
from .tables import Role, TableSpec

#: why a row of a dead-letter queue without a death record is left alone
NO_RECORD = "no death record: not a dead letter"


@dataclass(frozen=True)
class DeadLetter:
    """A row of a dead-letter queue, read from its death record (a row without one, which
    other code wrote there, is not a dead letter: no command moves or deletes it)."""

    dead_letter_queue: str
    id: int
    #: the queue it died in, and why
    queue: str | None
    reason: str | None
    attempts: int | None
    at: float | None
    task: str | None
    task_id: str | None
    #: the kombu message as a consumer would get it; None when it does not decode
    message: dict[str, Any] | None
    undecodable: str | None = None

    @property
    def death(self) -> dict[str, Any]:
        return read_death((self.message or {}).get("headers") or {})[0]

    @property
    def origin(self) -> str | None:
        """The queue it first died in (it may have died again in dead-letter queues)."""
        record: Any = self.death
        origin = self.queue
        while isinstance(record := record.get("previous"), dict):
            origin = record.get("queue", origin)
        return origin

    @property
    def why(self) -> str:
        """Why it died, or why it is not a dead letter."""
        return self.reason or self.undecodable or ("-" if self.death else NO_RECORD)

    @property
    def parked(self) -> bool:
        """Whether it is a row of a queue in row mode, parked as its raw columns."""
        return isinstance(self.death.get("columns"), dict)

    def left(self, requeue: bool) -> str | None:
        """Why a purge (a requeue, ``requeue``) leaves it alone; None: it takes it."""
        if not self.death:
            return "without a death record"
        if requeue and not isinstance(self.queue, str):
            return "whose death record names no queue"
        return None


@dataclass(frozen=True)
class DeadFilter:
    """Which dead letters an operation takes: by origin queue, task name (a glob),
    reason (a substring, any case), age of the death in seconds, or one row's id."""

    queue: str | None = None
    task: str | None = None
    reason: str | None = None
    older_than: float | None = None
    newer_than: float | None = None
    row_id: int | None = None

    def __call__(self, dead: DeadLetter, now: float) -> bool:
        age = None if dead.at is None else now - dead.at
        return ((self.queue is None or dead.queue == self.queue)
                and (self.task is None or fnmatch.fnmatchcase(dead.task or "", self.task))
                and (self.reason is None or self.reason.lower() in dead.why.lower())
                and (self.older_than is None or (age is not None and age >= self.older_than))
                and (self.newer_than is None or (age is not None and age <= self.newer_than))
                and (self.row_id is None or dead.id == self.row_id))


#: the filter that takes every dead letter
EVERY = DeadFilter()


def typed(found: dict[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    """``found[key]`` if it is a ``kind`` (not a bool), else None: what a row written by
    other code holds there must not break the lists' filters and pages."""
    value = found.get(key)
    return value if isinstance(value, kind) and not isinstance(value, bool) else None


def read_death(headers: dict[str, Any]) -> tuple[dict[str, Any], str | None, str | None,
                                                int | None, float | None]:
    """A message's death record (empty: none), and its queue, reason, attempts and time
    (see :func:`typed`)."""
    death = headers.get(DEATH_HEADER)
    death = death if isinstance(death, dict) else {}
    return (death, typed(death, "queue", str), typed(death, "reason", str),
            typed(death, "attempts", int), typed(death, "at", (int, float)))


def row_task(spec: TableSpec, queue: str, death: dict[str, Any], message: dict[str, Any]
             ) -> tuple[str | None, str | None]:
    """The task a parked row of ``queue`` (in row mode, declared by ``spec``) ran as: its
    name (the declared one, or its task column's) and the task id its worker saw."""
    rows = spec.rows
    if rows is None:
        return None, None
    name = rows.name
    if rows.column is not None:
        try:
            name = unparked_row(message["body"], death["columns"]).get(rows.column)
        except Undecodable:
            name = None
    return (name if isinstance(name, str) else None,
            str(uuid.uuid5(ROW_TASK_NAMESPACE, f"{queue}/{death.get('id')}")))


def restored(dialect: Dialect, dead: DeadLetter, target: QueueTable
             ) -> tuple[TextClause, dict[str, Any]]:
    """The statement and values that write ``dead`` back into ``target``, with the death
    record it had before it died (if it died in a dead-letter queue)."""
    assert dead.message is not None
    message, death, spec = dead.message, dead.death, target.spec
    if dead.parked:
        values = unparked_row(message["body"], death["columns"])
        declared = {spec.name_of(role) for role in (
            Role.PAYLOAD, Role.GROUP, Role.PARTITION_KEY) if spec.has(role)}
        unknown = sorted(set(values) - declared - set(spec.row_columns))
        if unknown:
            raise ConfigurationError(
                f"its row has columns {', '.join(unknown)} that queue {dead.queue!r} does "
                "not declare")
        if spec.has(Role.PAYLOAD) and isinstance(
                payload := values.get(spec.name_of(Role.PAYLOAD)), (bytes, str)):
            values[spec.name_of(Role.PAYLOAD)] = convert_payload(payload, target.payload_is_text)
        return (dialect.restore_row(spec, list(values)),
                {f"c{at}": value for at, value in enumerate(values.values())})
    headers = message["headers"]
    if isinstance(death.get("previous"), dict):
        headers[DEATH_HEADER] = death["previous"]
    else:
        headers.pop(DEATH_HEADER, None)
    columns: tuple[Any, ...] = ()
    if stores_plain(spec):
        payload, columns, envelope = (*encode_plain(message, target), None)
    else:
        payload, envelope = encode_message(message, target)
    params = dialect.publish_params(
        spec, payload, envelope, _priority(message["properties"].get("priority")),
        eta_epoch(headers), _key(headers.get(GROUP_HEADER)), _key(headers.get(PARTITION_HEADER)),
        (headers.get("task"), headers.get("id")), columns)
    restore = dialect.restore(spec)
    return (dialect.insert_statement(spec) if restore is None else restore), params


def _key(value: Any) -> str | None:
    return None if value is None else str(value)


def _priority(value: Any) -> int:
    """The row's priority from the message's (what the transport stored: 0..255)."""
    return max(0, min(255, value)) if isinstance(value, int) else 0
