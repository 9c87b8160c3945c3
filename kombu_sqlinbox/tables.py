"""Queue table declarations: which column plays which role.

A declaration is a :class:`TableSpec`. It can be written as a class
(:class:`InboxTable`) or with a builder (:class:`TableBuilder`); both forms yield
equal specs, so every statement the dialects generate is the same whichever is
used. The default layout the transport creates for a queue is itself a spec
(:func:`default_table`). The machinery is :mod:`kombu_sqlinbox.roles`, shared with the
outbox's table.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from enum import Enum
from typing import Any, ClassVar

from .errors import ConfigurationError
from .roles import (
    RoleAttribute,
    RoleColumn,
    RoleTable,
    RoleTableBuilder,
    check_identifier,
)


class Role(str, Enum):
    """What a column means to the transport; a missing optional role disables its behaviour."""

    ID = "id"
    PAYLOAD = "payload"
    HEADERS = "headers"
    GROUP = "group"
    PARTITION_KEY = "partition_key"
    ATTEMPT = "attempt"
    LOCKED_UNTIL = "locked_until"
    AVAILABLE_AT = "available_at"
    PRIORITY = "priority"
    PROCESSED_AT = "processed_at"


REQUIRED_ROLES = (Role.ID, Role.PAYLOAD)


@dataclass(frozen=True)
class ColumnSpec(RoleColumn[Role]):
    """One column and its role; ``generated`` (id) and ``fifo`` (group) qualify the role."""

    fifo: bool = False

    flags = {"generated": (Role.ID, "only the id role can be generated"),
             "fifo": (Role.GROUP, "only the group role takes fifo")}


@dataclass(frozen=True)
class TableSpec(RoleTable[Role, ColumnSpec]):
    """A whole declaration: the table name and its role-bearing columns."""

    required = REQUIRED_ROLES

    def lacking(self, missing: list[Enum]) -> str:
        return f"a queue table needs a column with role {missing[0].value}"

    def require(self, role: Role, setting: str, queue: str) -> ColumnSpec:
        """The column for ``role``, or a start-up error naming queue, setting and reason."""
        column = self.column(role)
        if column is None:
            raise ConfigurationError(
                f"queue {queue!r}: setting {setting} needs a column with role {role.value}, "
                f"and table {self.table!r} declares none"
            )
        return column


class Column(RoleAttribute[ColumnSpec]):
    """A role-bearing attribute of an :class:`InboxTable` class (the declarative form)."""

    column_type = ColumnSpec

    def __init__(
        self, role: Role | str, *, name: str | None = None, generated: bool = False,
        fifo: bool = False,
    ) -> None:
        super().__init__(Role(role), name, generated=generated, fifo=fifo)


class InboxTable:
    """Declarative form: subclass with ``table=`` and one :class:`Column` per role.

    ::

        class EmailJobs(InboxTable, table="email_jobs"):
            id = Column(Role.ID, generated=True)
            payload = Column(Role.PAYLOAD)
            attempt = Column(Role.ATTEMPT)
            locked_until = Column(Role.LOCKED_UNTIL)
    """

    __spec__: ClassVar[TableSpec]

    def __init_subclass__(cls, *, table: str, schema: str | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.__spec__ = TableSpec(table, Column.collect(cls), schema)


class TableBuilder(RoleTableBuilder[ColumnSpec, TableSpec]):
    """Typed builder form: ``TableBuilder("email_jobs").id("id", generated=True)...build()``."""

    column_type = ColumnSpec
    spec_type = TableSpec

    def id(self, name: str = "id", *, generated: bool = True) -> TableBuilder:
        return self._add(name, Role.ID, generated=generated)

    def payload(self, name: str = "payload") -> TableBuilder:
        return self._add(name, Role.PAYLOAD)

    def headers(self, name: str = "headers") -> TableBuilder:
        return self._add(name, Role.HEADERS)

    def group(self, name: str, *, fifo: bool = False) -> TableBuilder:
        return self._add(name, Role.GROUP, fifo=fifo)

    def partition_key(self, name: str) -> TableBuilder:
        return self._add(name, Role.PARTITION_KEY)

    def attempt(self, name: str = "attempt") -> TableBuilder:
        return self._add(name, Role.ATTEMPT)

    def locked_until(self, name: str = "locked_until") -> TableBuilder:
        return self._add(name, Role.LOCKED_UNTIL)

    def available_at(self, name: str = "available_at") -> TableBuilder:
        return self._add(name, Role.AVAILABLE_AT)

    def priority(self, name: str = "priority") -> TableBuilder:
        return self._add(name, Role.PRIORITY)

    def processed_at(self, name: str = "processed_at") -> TableBuilder:
        return self._add(name, Role.PROCESSED_AT)


def as_spec(declaration: TableSpec | type[InboxTable] | TableBuilder) -> TableSpec:
    """Accept any of the declaration forms wherever a spec is wanted."""
    if isinstance(declaration, TableSpec):
        return declaration
    if isinstance(declaration, TableBuilder):
        return declaration.build()
    if isinstance(declaration, type) and issubclass(declaration, InboxTable):
        return declaration.__spec__
    raise ConfigurationError(f"not a table declaration: {declaration!r}")


def default_table(table: str) -> TableSpec:
    """The layout the transport creates for a queue nobody declared."""
    return (
        TableBuilder(table)
        .id()
        .payload()
        .headers()
        .priority()
        .available_at()
        .locked_until()
        .attempt()
        .build()
    )


#: table names under the prefix that the routing tables take (:mod:`.routing`)
ROUTING_TABLES = ("queues", "bindings", "transient")


def check_name(name: str, what: str = "queue name", empty: bool = False) -> str:
    """Refuse a queue name (exchange, routing key) no table, registry row or binding can
    hold."""
    if not isinstance(name, str) or not (name or empty):
        raise ConfigurationError(f"{what} {name!r} is empty or not a string")
    if "\x00" in name or len(name) > 255:
        raise ConfigurationError(f"{what} {name!r} has a NUL byte or exceeds 255 characters")
    return name


def table_name_for_queue(queue: str, prefix: str = "sqlinbox_") -> str:
    """Map any kombu queue name onto a safe, stable table name.

    Names that are already plain identifiers keep their letters; anything else
    (dots, ``@``, quotes, a hostile name) is folded to ``_`` and suffixed with a
    hash of the original so that two different queues never share a table; so is a name
    the routing tables take (a queue named ``queues``).
    """
    check_name(queue)
    folded = re.sub(r"[^a-z0-9_]", "_", queue.lower())
    name = prefix + folded
    if folded != queue or len(name) > 63 or folded in ROUTING_TABLES:
        digest = hashlib.sha1(queue.encode("utf-8")).hexdigest()[:10]
        name = f"{name[: 63 - 11]}_{digest}"
    return check_identifier(name, "table")
