"""Outbox table declarations: which column plays which role.

The outbox describes its table the way the transport describes an inbox table
(:mod:`kombu_sqlinbox.tables`): a class with one :class:`OutboxColumn` per role
(:class:`OutboxTable`), or a typed builder (:class:`OutboxTableBuilder`). Both
produce the same :class:`OutboxSpec`, so the statements and their cost do not
depend on the form. :func:`default_outbox_table` is the layout the outbox creates
when the table is missing; a service maps its own table by naming its columns. The
machinery is :mod:`kombu_sqlinbox.roles`, shared with the inbox tables.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, ClassVar

from kombu_sqlinbox.errors import ConfigurationError
from kombu_sqlinbox.roles import RoleAttribute, RoleColumn, RoleTable, RoleTableBuilder

__all__ = [
    "OutboxColumn", "OutboxRole", "OutboxSpec", "OutboxTable", "OutboxTableBuilder",
    "as_outbox_spec", "default_outbox_table",
]

DEFAULT_TABLE = "celery_outbox"


class OutboxRole(str, Enum):
    """What a column means to the outbox."""

    ID = "id"
    TASK_ID = "task_id"
    TASK_NAME = "task_name"
    EXCHANGE = "exchange"
    ROUTING_KEY = "routing_key"
    HEADERS = "headers"
    PROPERTIES = "properties"
    BODY = "body"
    CREATED_AT = "created_at"
    PROCESSED_AT = "processed_at"
    #: when republish last sent the record again (NULL: never); it resends a record at
    #: most once per grace period
    REPUBLISHED_AT = "republished_at"


#: task id and name are for people reading the table; the rest is needed to send again
OPTIONAL_ROLES = frozenset({OutboxRole.TASK_ID, OutboxRole.TASK_NAME})


@dataclass(frozen=True)
class OutboxColumnSpec(RoleColumn[OutboxRole]):
    """One column and its role; ``generated`` says the database makes the record id."""

    kind = "outbox "
    flags = {"generated": (OutboxRole.ID, "only the id can be generated")}


@dataclass(frozen=True)
class OutboxSpec(RoleTable[OutboxRole, OutboxColumnSpec]):
    """A whole outbox declaration: table, optional schema and the role-bearing columns.

    A generated id is an integer the database assigns; otherwise the outbox supplies a
    UUID (32 hex characters) and the column must hold text.
    """

    kind = "outbox "
    required = tuple(role for role in OutboxRole if role not in OPTIONAL_ROLES)

    def column_names(self) -> dict[str, str]:
        """Role value -> column name, for every declared role."""
        return {column.role.value: column.name for column in self.columns}

    @property
    def generated_id(self) -> bool:
        return any(c.generated for c in self.columns)


class OutboxColumn(RoleAttribute[OutboxColumnSpec]):
    """A role-bearing attribute of an :class:`OutboxTable` class (the declarative form)."""

    column_type = OutboxColumnSpec

    def __init__(self, role: OutboxRole | str, *, name: str | None = None,
                 generated: bool = False) -> None:
        super().__init__(OutboxRole(role), name, generated=generated)


class OutboxTable:
    """Declarative form: subclass with ``table=`` and one :class:`OutboxColumn` per role.

    ::

        class Outbox(OutboxTable, table="orders_outbox"):
            id = OutboxColumn("id", generated=True)
            task = OutboxColumn("task_name")
            ...
    """

    __spec__: ClassVar[OutboxSpec]

    def __init_subclass__(cls, *, table: str, schema: str | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.__spec__ = OutboxSpec(table, OutboxColumn.collect(cls), schema)


class OutboxTableBuilder(RoleTableBuilder[OutboxColumnSpec, OutboxSpec]):
    """Typed builder form: ``OutboxTableBuilder("orders_outbox").id().body()...build()``."""

    column_type = OutboxColumnSpec
    spec_type = OutboxSpec

    def id(self, name: str = "id", *, generated: bool = True) -> OutboxTableBuilder:
        return self._add(name, OutboxRole.ID, generated=generated)

    def task_id(self, name: str = "task_id") -> OutboxTableBuilder:
        return self._add(name, OutboxRole.TASK_ID)

    def task_name(self, name: str = "task_name") -> OutboxTableBuilder:
        return self._add(name, OutboxRole.TASK_NAME)

    def exchange(self, name: str = "exchange") -> OutboxTableBuilder:
        return self._add(name, OutboxRole.EXCHANGE)

    def routing_key(self, name: str = "routing_key") -> OutboxTableBuilder:
        return self._add(name, OutboxRole.ROUTING_KEY)

    def headers(self, name: str = "headers") -> OutboxTableBuilder:
        return self._add(name, OutboxRole.HEADERS)

    def properties(self, name: str = "properties") -> OutboxTableBuilder:
        return self._add(name, OutboxRole.PROPERTIES)

    def body(self, name: str = "body") -> OutboxTableBuilder:
        return self._add(name, OutboxRole.BODY)

    def created_at(self, name: str = "created_at") -> OutboxTableBuilder:
        return self._add(name, OutboxRole.CREATED_AT)

    def processed_at(self, name: str = "processed_at") -> OutboxTableBuilder:
        return self._add(name, OutboxRole.PROCESSED_AT)

    def republished_at(self, name: str = "republished_at") -> OutboxTableBuilder:
        return self._add(name, OutboxRole.REPUBLISHED_AT)


def default_outbox_table(table: str = DEFAULT_TABLE, schema: str | None = None) -> OutboxSpec:
    """The layout the outbox creates when its table is missing."""
    return (
        OutboxTableBuilder(table, schema=schema).id().task_id().task_name().exchange()
        .routing_key().headers().properties().body().created_at().processed_at()
        .republished_at().build()
    )


Declaration = OutboxSpec | OutboxTableBuilder | type[OutboxTable] | str


def as_outbox_spec(declaration: Declaration) -> OutboxSpec:
    """Any declaration form; a bare table name means the default layout under that name."""
    if isinstance(declaration, OutboxSpec):
        return declaration
    if isinstance(declaration, str):
        return default_outbox_table(declaration)
    if isinstance(declaration, OutboxTableBuilder):
        return declaration.build()
    if isinstance(declaration, type) and issubclass(declaration, OutboxTable):
        return declaration.__spec__
    raise ConfigurationError(f"not an outbox table declaration: {declaration!r}")
