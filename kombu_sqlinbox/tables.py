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
from dataclasses import dataclass, field, replace
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
#: the bound parameters a custom publish statement may use (and row mode's columns, by name)
PUBLISH_PARAMETERS = ("payload", "headers", "group", "partition_key", "available_at",
                      "priority", "task_name", "task_id")
#: how SQLAlchemy finds a bound parameter in a statement's text (``::`` is a cast)
BOUND_PARAMETER = re.compile(r"(?<![:\w\\]):(\w+)(?!:)")
#: row mode: the payload column holds a JSON object of keyword arguments, or an array of
#: positional ones
ARGUMENT_FORMS = ("kwargs", "args")


@dataclass(frozen=True)
class ColumnSpec(RoleColumn[Role]):
    """One column and its role; ``generated`` (id) and ``fifo`` (group) qualify the role."""

    fifo: bool = False

    flags = {"generated": (Role.ID, "only the id role can be generated"),
             "fifo": (Role.GROUP, "only the group role takes fifo")}


@dataclass(frozen=True)
class RowTask:
    """Row mode: each row runs as a Celery task, rows written by any code (SQL, a trigger,
    another service). The task is ``name``, or the one the ``column`` holds; its arguments
    are the payload column's JSON (``"kwargs"``: an object, ``"args"``: an array) or the
    named columns as keyword arguments (a tuple of column names)."""

    name: str | None = None
    column: str | None = None
    arguments: str | tuple[str, ...] = "kwargs"

    def __post_init__(self) -> None:
        if (self.name is None) == (self.column is None):
            raise ConfigurationError("row mode: name the task, or the column holding it (one)")
        if self.name is not None and (not isinstance(self.name, str) or not self.name):
            raise ConfigurationError(f"row mode: task name {self.name!r} is not a name")
        if self.column is not None:
            check_identifier(self.column, "row mode: task column")
        arguments = self.arguments
        if not isinstance(arguments, str):
            arguments = tuple(arguments)
            if not arguments:
                raise ConfigurationError("row mode: name at least one argument column")
            for name in arguments:
                check_identifier(name, "row mode: argument column")
            if len(set(arguments)) != len(arguments):
                raise ConfigurationError(f"row mode: an argument column repeats: {arguments}")
            object.__setattr__(self, "arguments", arguments)
        elif arguments not in ARGUMENT_FORMS:
            raise ConfigurationError(
                f"row mode: arguments={arguments!r}: expected 'kwargs', 'args' or a tuple of "
                "column names")

    @property
    def from_columns(self) -> bool:
        return isinstance(self.arguments, tuple)

    @property
    def columns(self) -> tuple[str, ...]:
        """The columns a claim returns beside the roles: the task's, then the arguments'."""
        named = (self.column,) if self.column is not None else ()
        arguments = self.arguments if isinstance(self.arguments, tuple) else ()
        return (*named, *(name for name in arguments if name not in named))


@dataclass(frozen=True)
class TableSpec(RoleTable[Role, ColumnSpec]):
    """A whole declaration: the table name and its role-bearing columns; for a queue shared
    with other services also its own publish statement (``publish``), row mode
    (``rows``) and whether rows are stored without Celery's envelope (``plain``)."""

    publish: str | None = field(default=None, kw_only=True)
    rows: RowTask | None = field(default=None, kw_only=True)
    plain: bool = field(default=False, kw_only=True)
    #: the transport's own layout (:func:`default_table`), whose indexes have the names
    #: the transport gives them: its statements may name them (MySQL's index hints)
    own: bool = field(default=False, kw_only=True)

    required = REQUIRED_ROLES

    def __post_init__(self) -> None:
        super().__post_init__()
        where = f"table {self.table!r}"
        if self.publish is not None:
            if not isinstance(self.publish, str) or not re.match(
                    r"\s*INSERT\s", self.publish, re.IGNORECASE):
                raise ConfigurationError(
                    f"{where}: the publish statement must be an INSERT, got {self.publish!r}")
            clash = sorted(set(self.row_columns) & set(PUBLISH_PARAMETERS))
            if clash:
                raise ConfigurationError(
                    f"{where}: row mode column {clash[0]!r} has the name of a parameter of "
                    "the publish statement; a statement binds row columns by name")
            allowed = (*PUBLISH_PARAMETERS, *self.row_columns)
            unknown = sorted(set(BOUND_PARAMETER.findall(self.publish)) - set(allowed))
            if unknown:
                raise ConfigurationError(
                    f"{where}: the publish statement binds :{unknown[0]}; it may bind "
                    f"{', '.join(':' + name for name in allowed)}")

    def __json__(self) -> str:
        """What kombu's JSON writes for a declared table: its name. A worker's ``stats``
        reply (``celery inspect stats``, the dashboard's workers page, Flower) holds the
        transport options, which hold the declared tables."""
        return self.table

    def __hash__(self) -> int:
        """The hash of the table and its columns, computed once: statements and settlements
        are looked up by spec several times per claim, and hashing every column costs
        microseconds each time. Equal specs have equal tables and columns, so equal hashes."""
        cached: int | None = self.__dict__.get("_hash")
        if cached is None:
            cached = hash((self.table, self.schema, self.columns))
            object.__setattr__(self, "_hash", cached)
        return cached

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without its hash: another process hashes strings differently."""
        return {name: value for name, value in self.__dict__.items() if name != "_hash"}

    def required_roles(self) -> tuple[Enum, ...]:
        """Row mode taking its arguments from named columns needs no payload column."""
        if self.rows is not None and self.rows.from_columns:
            return (Role.ID,)
        return self.required

    @property
    def row_columns(self) -> tuple[str, ...]:
        """Columns a claim returns beside the roles (row mode's task and argument columns)."""
        return () if self.rows is None else self.rows.columns

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

    def __init_subclass__(cls, *, table: str, schema: str | None = None,
                          publish: str | None = None, rows: RowTask | None = None,
                          plain: bool = False, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.__spec__ = TableSpec(table, Column.collect(cls), schema, publish=publish,
                                 rows=rows, plain=plain)


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

    def publish_statement(self, sql: str) -> TableBuilder:
        """The INSERT every publish to the queue runs (see :data:`PUBLISH_PARAMETERS`)."""
        self._extra["publish"] = sql
        return self

    def task(self, name: str | None = None, *, column: str | None = None,
             arguments: str | tuple[str, ...] = "kwargs") -> TableBuilder:
        """Row mode (see :class:`RowTask`)."""
        self._extra["rows"] = RowTask(name, column, arguments)
        return self

    def plain(self) -> TableBuilder:
        """Store what is published without Celery's envelope, for readers that are not
        Celery."""
        self._extra["plain"] = True
        return self


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
    spec = (
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
    return replace(spec, own=True)


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


#: the end :func:`table_name_for_queue` gives a table whose name is not its queue's
HASHED_TABLE = re.compile(r"_[0-9a-f]{10}$")


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
