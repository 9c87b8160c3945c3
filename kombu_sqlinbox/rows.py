"""The values every layer passes around: a queue's table, a claimed row, a held row.

A leaf: it knows tables and options, nothing of the dialects, the claim forms or the
broker, so each of those can be built and tested on its own.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, NamedTuple, Protocol, TypeVar

from sqlalchemy import Connection

from .options import QueueOptions
from .tables import Role, TableSpec

T = TypeVar("T")


class ClaimRunner(Protocol):
    """How a lease claim's transaction is run: :meth:`.Database.run_fenced`, or
    :meth:`Wakeup.claim` on the LISTEN connection."""

    def __call__(self, work: Callable[[Connection], T]) -> T: ...


class ClaimedRow(NamedTuple):
    """A row taken by a claim: what delivery needs, plus the fencing token (attempt). A
    tuple: one is made per message, and a frozen dataclass costs several times as much."""

    id: int
    attempt: int
    payload: bytes | str
    headers: str | None
    group: Any
    partition_key: Any
    #: the values of the declaration's row columns (row mode: task and arguments)
    columns: tuple[Any, ...] = ()


class Settlement(Enum):
    """What happens to a held row when it leaves this process (the statement's name)."""

    COMPLETE = "complete"  # ack: delete, or mark processed
    RELEASE = "release"  # requeue in place; the delivery counted
    RELEASE_UNCOUNTED = "release_uncounted"  # never delivered: give the attempt back
    RETRY = "retry"  # in place, hidden for a delay

    #: by identity, as members compare: Enum's own hash is a Python call, and settlements
    #: are grouped by kind on every ack
    __hash__ = object.__hash__


class Claims(Protocol):
    """A queue's claim form, as those holding the queue's rows use it (the forms of
    :mod:`.claims` are its implementations)."""

    def claim(self, table: QueueTable, limit: int, skip: Sequence[Any] = ()) -> list[ClaimedRow]:
        ...

    def held_for(self, table: QueueTable, row: ClaimedRow) -> Held:
        ...

    def settle(self, how: Settlement, held: Held, delay: float = 0.0) -> None:
        ...

    def run_held(self, held: Held, work: Callable[[Connection], T]) -> T:
        ...

    def completed(self, held: Held) -> None:
        ...

    def settled(self, rows: Iterable[Held]) -> None:
        ...


@dataclass(frozen=True, eq=False)
class QueueTable:
    """A queue as the transport uses it: its table, its settings, how its payload is stored."""

    queue: str
    spec: TableSpec
    options: QueueOptions
    payload_is_text: bool
    created_by_transport: bool
    claims: Claims
    #: the queue lives in the shared table of transient messages (:mod:`.routing`)
    transient: bool = False
    #: row mode: each argument column whose type converts what it is given, and why a
    #: value would not come back as it was sent (:mod:`.exact`)
    exact: tuple[tuple[str, Callable[[Any], str | None]], ...] = ()
    #: row mode: the argument columns written the argument's JSON text (:mod:`.exact`)
    as_json: frozenset[str] = frozenset()

    @property
    def fifo(self) -> bool:
        group = self.spec.column(Role.GROUP)
        return group is not None and group.fifo


@dataclass(frozen=True)
class Held:
    """A row this process holds: its queue table and fencing token (plus its key)."""

    table: QueueTable
    id: int
    attempt: int
    key: str | None = None


class Queued(NamedTuple):
    """A settlement waiting to be written; ``seq`` orders it for :meth:`.LeaseKeeper.flush`.
    A tuple: one is made per ack, and a frozen dataclass costs several times as much."""

    seq: int
    how: Settlement
    held: Held
    delay: float
    at: float  # when it was queued (monotonic)


#: settlements written together: one queue's acks, or its requeues, ...
Group = tuple[QueueTable, Settlement]


def grouped(batch: Iterable[Queued]) -> dict[Group, list[Queued]]:
    """Settlements by group, each group in queue order."""
    groups: dict[Group, list[Queued]] = defaultdict(list)
    for queued in batch:
        groups[(queued.held.table, queued.how)].append(queued)
    return groups
