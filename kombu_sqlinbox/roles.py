"""Role-mapped table declarations, whatever the roles.

The transport's queue tables (:mod:`kombu_sqlinbox.tables`) and the outbox's table
(:mod:`celery_ext.declaration`) are declared alike: each column plays one role of an
enum, some roles are required, identifiers are checked before any SQL quotes them, and
a declaration is written as a spec, as a class with one attribute per column, or with
a builder. This is that machinery once; each kind of table brings its roles, its
required roles, its flags and its wording.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, ClassVar, Generic, TypeVar

from .errors import ConfigurationError

IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")

R = TypeVar("R", bound=Enum)
C = TypeVar("C", bound="RoleColumn[Any]")
S = TypeVar("S", bound="RoleTable[Any, Any]")
B = TypeVar("B", bound="RoleTableBuilder[Any, Any]")


def check_identifier(name: str, what: str) -> str:
    """Refuse any identifier that would need more than plain quoting to be safe (the whole
    name must match: ``$`` would let a trailing newline through)."""
    if not isinstance(name, str) or not IDENTIFIER.fullmatch(name):
        raise ConfigurationError(
            f"{what} {name!r} is not a valid identifier: use letters, digits and '_' "
            "(not starting with a digit), at most 63 characters"
        )
    return name


@dataclass(frozen=True)
class RoleColumn(Generic[R]):
    """One column and its role; ``generated`` says the database makes the id."""

    name: str
    role: R
    generated: bool = False

    #: what errors call this kind of column: "<kind>column ..."
    kind: ClassVar[str] = ""
    #: flag -> the one role it qualifies, and the refusal for any other role
    flags: ClassVar[dict[str, tuple[Enum, str]]] = {}

    def __post_init__(self) -> None:
        check_identifier(self.name, f"{self.kind}column for role {self.role.value}")
        for flag, (role, refusal) in self.flags.items():
            if getattr(self, flag) and self.role is not role:
                raise ConfigurationError(f"{self.kind}column {self.name!r}: {refusal}")


@dataclass(frozen=True)
class RoleTable(Generic[R, C]):
    """A whole declaration: the table, its optional schema and its role-bearing columns."""

    table: str
    columns: tuple[C, ...]
    schema: str | None = None
    _by_role: dict[R, C] = field(init=False, repr=False, compare=False, hash=False)

    #: what errors call this kind of table: "<kind>table ...", "<kind>schema ..."
    kind: ClassVar[str] = ""
    #: the roles every declaration maps, in the order missing ones are named
    required: ClassVar[tuple[Enum, ...]] = ()

    def __post_init__(self) -> None:
        check_identifier(self.table, f"{self.kind}table")
        if self.schema is not None:
            check_identifier(self.schema, f"{self.kind}schema")
        where = f"{self.kind}table {self.table!r}"
        by_role: dict[R, C] = {}
        for column in self.columns:
            if column.role in by_role:
                raise ConfigurationError(f"{where}: role {column.role.value} is declared twice")
            if any(other.name == column.name for other in by_role.values()):
                raise ConfigurationError(f"{where}: column {column.name!r} has two roles")
            by_role[column.role] = column
        missing = [role for role in self.required_roles() if role not in by_role]
        if missing:
            raise ConfigurationError(f"{where}: {self.lacking(missing)}")
        object.__setattr__(self, "_by_role", by_role)

    def required_roles(self) -> tuple[Enum, ...]:
        """The roles this declaration must map (a kind of table may need fewer in a mode)."""
        return self.required

    def lacking(self, missing: list[Enum]) -> str:
        """Why a declaration without the ``missing`` required roles is refused."""
        return f"declare a column for each of the roles {', '.join(r.value for r in missing)}"

    def column(self, role: R) -> C | None:
        return self._by_role.get(role)

    def has(self, role: R) -> bool:
        return role in self._by_role

    def name_of(self, role: R) -> str:
        """Column name for a role the caller has already checked is present."""
        return self._by_role[role].name


class RoleAttribute(Generic[C]):
    """A role-bearing attribute of a declaration class (the declarative form), named after
    the attribute unless given a name."""

    #: the column spec it stands for
    column_type: type[C]

    def __init__(self, role: Enum, name: str | None, **flags: bool) -> None:
        self.role = role
        self.name = name
        self.flags = flags

    def __set_name__(self, owner: type, attribute: str) -> None:
        if self.name is None:
            self.name = attribute

    def spec(self) -> C:
        assert self.name is not None
        return self.column_type(self.name, self.role, **self.flags)

    @classmethod
    def collect(cls, owner: type) -> tuple[C, ...]:
        """The columns a declaration class declares itself, in the order written."""
        return tuple(value.spec() for value in vars(owner).values() if isinstance(value, cls))


class RoleTableBuilder(Generic[C, S]):
    """Typed builder form: one method per role adds its column; :meth:`build` checks the
    whole declaration."""

    column_type: type[C]
    spec_type: type[S]

    def __init__(self, table: str, *, schema: str | None = None) -> None:
        self._table = table
        self._schema = schema
        self._columns: list[C] = []
        #: settings of the kind of table beyond its columns (keyword arguments of the spec)
        self._extra: dict[str, Any] = {}

    def _add(self: B, name: str, role: Enum, **flags: bool) -> B:
        self._columns.append(self.column_type(name, role, **flags))
        return self

    def build(self) -> S:
        return self.spec_type(self._table, tuple(self._columns), self._schema, **self._extra)
