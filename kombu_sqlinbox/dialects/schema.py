"""A queue table's schema: its DDL, the checks of a table that exists (columns, types, a
generated id, a declared publish statement), and of its claim's plan (EXPLAIN)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, ClassVar

from sqlalchemy import Connection, TextClause, bindparam, inspect, text
from sqlalchemy import types as sqltypes
from sqlalchemy.exc import DBAPIError

from ..errors import SchemaMismatch
from ..tables import ColumnSpec, Role, TableSpec
from .publish import PublishFamily
from .selection import SelectionFamily


class SchemaFamily(SelectionFamily, PublishFamily):
    """Creating a queue table, and checking one."""

    def column_ddl(self, column: ColumnSpec) -> str:
        if column.role is Role.ID and column.generated:
            return f"{self.quote(column.name)} {self.generated_id_type}"
        return f"{self.quote(column.name)} {self.column_types[column.role]}"

    def index_columns(self, spec: TableSpec) -> dict[str, str]:
        """Indexes claims need, by name suffix: claim order, and (group, id) and
        (partition key, id) for the probes that find a group's or a key's first row."""
        indexes = {"claim": self.claim_order(spec)}
        for role, suffix in ((Role.GROUP, "group"), (Role.PARTITION_KEY, "key")):
            if spec.has(role):
                indexes[suffix] = (f"{self.quote(spec.name_of(role))}, "
                                   f"{self.quote(spec.name_of(Role.ID))}")
        return indexes

    def index_ddl(self, spec: TableSpec) -> list[str]:
        partial = ""
        if spec.has(Role.PROCESSED_AT):
            partial = f" WHERE {self.quote(spec.name_of(Role.PROCESSED_AT))} IS NULL"
        return [
            f"CREATE INDEX IF NOT EXISTS {self.index_name(spec, suffix)} "
            f"ON {self.table_ref(spec)} ({columns}){partial}"
            for suffix, columns in self.index_columns(spec).items()
        ]

    #: what asks the database for a statement's plan without running it
    explain_prefix: ClassVar[str] = "EXPLAIN"
    #: run before :meth:`explain` by :meth:`claim_plan_problem`: the planner then takes any
    #: index that serves the claim, however few rows the table has today
    plan_settings: ClassVar[tuple[str, ...]] = ()

    def explain(self, spec: TableSpec) -> TextClause:
        """EXPLAIN of the claim's row selection: the part an index must serve (below a
        floor at the epoch, which passes over nothing but has the floor's plan)."""
        f = self.fields(spec)
        floor = self.above_floor(spec)
        statement = text(
            f"{self.explain_prefix} SELECT r.{f['id']} FROM {f['table']} AS r "
            f"WHERE {self.ready_filter(spec)}{floor} "
            f"ORDER BY {self.claim_order(spec, 'r')} LIMIT :limit {self.lock_clause}")
        if floor:
            statement = statement.bindparams(bindparam("floor", value=0.0))
        return self.clocked(statement)

    def explained(self, statement: TextClause) -> TextClause:
        """``statement`` under :attr:`explain_prefix`, with its bound parameters: planned
        against the live schema (a missing column, an impossible type fails), not run."""
        return text(f"{self.explain_prefix} {statement.text}").bindparams(
            *statement._bindparams.values())

    def plan_lines(self, conn: Connection, statement: TextClause,
                   params: Mapping[str, Any]) -> list[str]:
        """The plan of an EXPLAIN, one line per row (``key=value | ...`` for a tabular
        plan)."""
        result = conn.execute(statement, dict(params))
        return [" | ".join(f"{key}={value}" for key, value in row._mapping.items())
                for row in result]

    def claim_plan_problem(self, conn: Connection, spec: TableSpec) -> str | None:
        """Why the claim's row selection would not walk the claim index in claim order
        (read from the plan, see :meth:`plan_problem`), or None when it would."""
        for setting in self.plan_settings:
            conn.exec_driver_sql(setting)
        plan = self.plan_lines(conn, self.explain(spec), {"limit": 10})
        index = self.index_name(spec).strip('"`')
        problem = self.plan_problem("\n".join(plan), index)
        return None if problem is None else f"{problem}; the plan:\n" + "\n".join(plan)

    def plan_problem(self, plan: str, index: str) -> str | None:
        """What in a claim's ``plan`` shows it does not use ``index`` for its order."""
        if index not in plan:
            return f"the claim does not use its index {index}"
        return None

    #: storage parameters of a queue table that deletes its finished rows, after its
    #: CREATE TABLE's column list (a table keeping them holds history: filled to the brim)
    table_storage = ""

    def create_ddl(self, spec: TableSpec) -> list[str]:
        """CREATE TABLE (and its claim index) for a declaration, in this database's types."""
        columns = ",\n    ".join(
            [*(self.column_ddl(c) for c in spec.columns),
             *(f"{self.quote(name)} {self.row_column_type}" for name in spec.row_columns
               if all(c.name != name for c in spec.columns))])
        key = ""
        id_column = spec.column(Role.ID)
        assert id_column is not None
        if not id_column.generated:
            key = f",\n    PRIMARY KEY ({self.quote(id_column.name)})"
        storage = "" if spec.has(Role.PROCESSED_AT) else self.table_storage
        create = (f"CREATE TABLE IF NOT EXISTS {self.table_ref(spec)} (\n    {columns}{key}\n)"
                  + storage)
        return [create, *self.index_ddl(spec)]

    def drop_ddl(self, spec: TableSpec) -> str:
        """DROP TABLE of a declaration (its indexes go with it)."""
        return f"DROP TABLE IF EXISTS {self.table_ref(spec)}"

    def add_column_ddl(self, spec: TableSpec, column: ColumnSpec) -> str:
        return f"ALTER TABLE {self.table_ref(spec)} ADD COLUMN {self.column_ddl(column)}"

    def type_problem(self, role: Role, reflected: sqltypes.TypeEngine[Any]) -> str | None:
        """Why a reflected column type cannot serve a role, or None when it can."""
        wanted: dict[Role, tuple[type[Any], ...]] = {
            Role.ID: (sqltypes.Integer,),
            Role.ATTEMPT: (sqltypes.Integer,),
            Role.PRIORITY: (sqltypes.Integer,),
            Role.PAYLOAD: (sqltypes._Binary, sqltypes.String),
            Role.HEADERS: (sqltypes.String, sqltypes.JSON),
            Role.GROUP: (sqltypes.String, sqltypes.Integer),
            Role.PARTITION_KEY: (sqltypes.String, sqltypes.Integer),
        }
        wanted.update(dict.fromkeys(
            (Role.LOCKED_UNTIL, Role.AVAILABLE_AT, Role.PROCESSED_AT), self.time_types()))
        if isinstance(reflected, wanted[role]):
            return None
        names = " or ".join(t.__name__ for t in wanted[role])
        return f"has type {reflected}, the {role.value} role needs {names}"

    def time_types(self) -> tuple[type[Any], ...]:
        return (sqltypes.DateTime,)

    #: what gives an id column a generator (``{table}``, ``{column}``); empty: no ALTER can
    id_generator_ddl: ClassVar[str] = ""

    def id_problem(self, conn: Connection, spec: TableSpec) -> str | None:
        """Why the database would not generate the id of a row the transport publishes
        (it gives none: the row would fail NOT NULL, or be stored without an id), or None."""
        name = spec.name_of(Role.ID)
        column = next(c for c in inspect(conn).get_columns(spec.table, schema=spec.schema)
                      if c["name"].lower() == name.lower())
        if self.id_generated(conn, spec, column):
            return None
        fix = self.id_generator_ddl.format(table=self.table_ref(spec), column=self.quote(name))
        return (f"table {spec.table!r}: column {name!r} (role id) is not generated by the "
                "database, and the transport publishes without an id; "
                + (f"give it a generator, for example:\n{fix};" if fix else
                   f"make the table again with {self.quote(name)} {self.generated_id_type} "
                   "and copy its rows"))

    def id_generated(self, conn: Connection, spec: TableSpec, column: Mapping[str, Any]
                     ) -> bool:
        """Whether the reflected id ``column`` gets a value the INSERT leaves out: an
        identity, AUTO_INCREMENT, a default (a sequence's)."""
        return bool(column.get("autoincrement") is True or column.get("identity")
                    or column.get("default") is not None)

    def ensure_table(self, conn: Connection, spec: TableSpec, create: bool) -> bool:
        """Create (when allowed) and check a table; returns whether its payload column is text.
        A claim floor kept from a table of that name before is forgotten."""
        self.forget_floor(spec)
        inspector = inspect(conn)
        if not inspector.has_table(spec.table, schema=spec.schema):
            if not create:
                ddl = ";\n".join(self.create_ddl(spec))
                raise SchemaMismatch(
                    f"table {spec.table!r} does not exist (create_tables is off); "
                    f"create it with:\n{ddl};"
                )
            for statement in self.create_ddl(spec):
                conn.exec_driver_sql(statement)
            inspector = inspect(conn)
        reflected = {c["name"]: c for c in inspector.get_columns(spec.table, schema=spec.schema)}
        folded = {name.lower(): column for name, column in reflected.items()}
        problems = []
        for column in spec.columns:
            found = reflected.get(column.name) or folded.get(column.name.lower())
            if found is None:
                problems.append(
                    f"table {spec.table!r}: column {column.name!r} (role {column.role.value}) "
                    f"is missing; add it with:\n{self.add_column_ddl(spec, column)};"
                )
                continue
            problem = self.type_problem(column.role, found["type"])
            if problem:
                problems.append(
                    f"table {spec.table!r}: column {column.name!r} (role {column.role.value}) "
                    f"{problem}; for example:\n{self.alter_type_ddl(spec, column)};"
                )
        for name in spec.row_columns:
            if name not in reflected and name.lower() not in folded:
                problems.append(
                    f"table {spec.table!r}: column {name!r} (row mode) is missing; add it "
                    f"with:\n{self.add_row_column_ddl(spec, name)};")
        if problems:
            raise SchemaMismatch("\n".join(problems))
        if spec.publish is not None:
            self.check_publish(conn, spec)
        if not spec.has(Role.PAYLOAD):
            return True
        payload = reflected.get(spec.name_of(Role.PAYLOAD)) or folded[
            spec.name_of(Role.PAYLOAD).lower()]
        return not isinstance(payload["type"], sqltypes._Binary)

    #: the SQL type of a row mode column the transport creates (a declared table has its own)
    row_column_type: ClassVar[str] = "TEXT"

    def add_row_column_ddl(self, spec: TableSpec, name: str) -> str:
        return (f"ALTER TABLE {self.table_ref(spec)} ADD COLUMN {self.quote(name)} "
                f"{self.row_column_type}")

    def check_publish(self, conn: Connection, spec: TableSpec) -> None:
        """The declared publish statement, planned (never run) against the schema: a wrong
        table, column or expression fails at start-up, not at the first publish."""
        try:
            with conn.begin_nested():
                conn.execute(text(f"EXPLAIN {spec.publish}"),
                             self.publish_params(spec, None, None))
        except DBAPIError as exc:
            raise SchemaMismatch(
                f"table {spec.table!r}: its publish statement does not fit the schema: "
                f"{exc.orig}\n{spec.publish}") from None

    def alter_type_ddl(self, spec: TableSpec, column: ColumnSpec) -> str:
        name = self.quote(column.name)
        bare = re.split(r"\s+(?:NOT NULL|NULL|DEFAULT)\b", self.column_types[column.role])[0]
        cast = f"{name}::text::{bare}" if bare == "BYTEA" else f"{name}::{bare}"
        return f"ALTER TABLE {self.table_ref(spec)} ALTER COLUMN {name} TYPE {bare} USING {cast}"

    #: whether DDL runs inside a transaction (and rolls back with it) rather than
    #: committing it: tables are then created in a caller's transaction, never on a second
    #: connection that could wait on that transaction's locks
    transactional_ddl: ClassVar[bool] = True
