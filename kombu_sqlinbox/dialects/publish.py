"""The publish statement: a table's INSERT (the default one or a declared one), the values
it binds, and the same INSERT for many rows in the driver's own parameter style."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

from sqlalchemy import TextClause, text
from sqlalchemy.engine import Engine

from ..clock import PARAMETER, Clock
from ..tables import Role, TableSpec
from .driver import POSITIONAL_MARKERS, DriverFamily, _driver_style


@dataclass(frozen=True, eq=False)
class RowsInsert:
    """A table's publish statement for any number of rows, in the driver's own parameter
    style: ``head``, ``row`` once per row (comma separated), ``tail``. It runs on the
    driver's cursor, so a publish costs the database's round trip rather than SQLAlchemy's
    per-statement work, and a bulk publish is one statement per chunk of rows."""

    head: str
    row: str
    tail: str
    #: the parameter names each part takes, in order
    names: tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]
    #: values the dialect fixes (a NOTIFY channel)
    fixed: Mapping[str, Any]
    clock: Clock | None
    #: the most rows one statement may carry: the server's limit on bound parameters
    max_rows: int
    #: the largest statement the server accepts (None: no such limit)
    max_bytes: int | None
    #: the statement for many rows as one row of arrays, one array per value a row binds
    #: (:meth:`Dialect.array_insert`), and its parameter names: a short statement
    #: whatever the number of rows, which neither the driver nor the server parses row
    #: by row; None where the table or the database has none
    arrays: tuple[str, tuple[str, ...]] | None = None
    #: for a publish in a transaction of its own that waits for the disk: the rows' INSERT
    #: without the wake-up the statement carries, and the wake-up as a statement of its
    #: own with its values, sent once the INSERT committed (:meth:`Dialect.wake_apart`);
    #: None where the statement wakes nobody
    apart: tuple[RowsInsert, str, tuple[Any, ...]] | None = None

    def sql(self, rows: int) -> str:
        if rows == 1:
            return self.single
        if self.arrays is not None:
            return self.arrays[0]
        return self.head + ", ".join([self.row] * rows) + self.tail

    @cached_property
    def single(self) -> str:
        """The statement for one row, the one a lone publish sends (built once)."""
        return self.head + self.row + self.tail

    def parameters(self, rows: Sequence[Mapping[str, Any]]) -> tuple[Any, ...]:
        fixed = self.fixed
        if self.clock is not None:
            fixed = {**fixed, PARAMETER: self.clock.value()}
        if self.arrays is not None and len(rows) > 1:
            return tuple(fixed[name] if name in fixed else [row[name] for row in rows]
                         for name in self.arrays[1])
        head, row_names, tail = self.names
        values = [fixed[name] for name in head]
        for row in rows:
            values += [fixed[name] if name in fixed else row[name] for name in row_names]
        values += [fixed[name] for name in tail]
        return tuple(values)

    def chunks(self, rows: Sequence[Mapping[str, Any]]) -> list[Sequence[Mapping[str, Any]]]:
        """``rows`` split so that no statement exceeds the server's limits."""
        found: list[Sequence[Mapping[str, Any]]] = []
        start, size = 0, 0
        for at, row in enumerate(rows):
            weight = len(row.get("payload") or b"") + len(row.get("headers") or "") + 256
            if at > start and (at - start >= self.max_rows or (
                    self.max_bytes is not None and size + weight > self.max_bytes // 2)):
                found.append(rows[start:at])
                start, size = at, 0
            size += weight
        if start < len(rows):
            found.append(rows[start:])
        return found


class PublishFamily(DriverFamily):
    """Writing a message's row."""

    def __init__(self, engine: Engine | None = None) -> None:
        super().__init__(engine)
        self._rows_inserts: dict[tuple[TableSpec, str, str], RowsInsert | None] = {}

    def insert_params(
        self, payload: bytes | str | None, headers: str | None, priority: int,
        eta: float | None, group: str | None = None, partition_key: str | None = None,
        task: tuple[str | None, str | None] = (None, None), columns: Sequence[Any] = (),
    ) -> dict[str, Any]:
        """The values of a publish: the default statement's (``eta``: epoch seconds or
        None), those a declared publish statement may bind (``available_at``, ``task_name``,
        ``task_id``) and the row columns' (``x0``...; see :meth:`publish_params`)."""
        return {"payload": payload, "headers": headers, "priority": priority, "eta": eta,
                "available_at": eta, "group": group, "partition_key": partition_key,
                "task_name": task[0], "task_id": task[1],
                **{f"x{at}": value for at, value in enumerate(columns)}}

    def publish_params(
        self, spec: TableSpec, payload: bytes | str | None, headers: str | None,
        priority: int = 0, eta: float | None = None, group: str | None = None,
        partition_key: str | None = None, task: tuple[str | None, str | None] = (None, None),
        columns: Sequence[Any] = (),
    ) -> dict[str, Any]:
        """:meth:`insert_params` for a publish to ``spec``'s table: every row column bound
        (``NULL`` when not given), also by its name for a declared statement (the
        declaration refuses a name that clashes with another parameter)."""
        columns = [*columns, *[None] * (len(spec.row_columns) - len(columns))]
        params = self.insert_params(payload, headers, priority, eta, group, partition_key,
                                    task, columns)
        if spec.publish:
            params.update(zip(spec.row_columns, columns, strict=True))
        return params

    def insert_sql(self, spec: TableSpec) -> str:
        """The publish statement: the declared one, else the roles a message fills (and
        row mode's columns), the rest by default."""
        if spec.publish is not None:
            return spec.publish
        return self._insert(spec, self._publish_values(spec))

    def _publish_values(self, spec: TableSpec) -> list[tuple[str, str]]:
        """The default publish statement's (column, value) pairs."""
        f = self.fields(spec)
        values = {
            Role.PAYLOAD: ":payload",
            Role.HEADERS: ":headers",
            Role.PRIORITY: ":priority",
            Role.AVAILABLE_AT: self.eta_value,
            Role.GROUP: ":group",
            Role.PARTITION_KEY: ":partition_key",
        }
        # a row column that also plays a role (a FIFO group on an argument) takes the row's
        # value
        roles = [role for role in values
                 if spec.has(role) and spec.name_of(role) not in spec.row_columns]
        return [*((f[role.value], values[role]) for role in roles),
                *((self.quote(name), f":x{at}") for at, name in enumerate(spec.row_columns))]

    def _insert(self, spec: TableSpec, pairs: Sequence[tuple[str, str]]) -> str:
        columns = ", ".join(column for column, _ in pairs)
        placeholders = ", ".join(value for _, value in pairs)
        return f"INSERT INTO {self.fields(spec)['table']} ({columns}) VALUES ({placeholders})"

    def insert_statement(self, spec: TableSpec) -> TextClause:
        return text(self.insert_sql(spec))

    def insert_parts(self, spec: TableSpec) -> tuple[str, str, str, dict[str, Any]] | None:
        """The default publish statement as (head, one row's VALUES, tail, fixed values),
        which repeats the row for a multi-row INSERT; None for a declared publish
        statement, which is any SQL and runs one row at a time."""
        if spec.publish is not None:
            return None
        head, _, row = self.insert_sql(spec).partition(" VALUES ")
        return head + " VALUES ", row, "", {}

    def rows_insert(self, spec: TableSpec, paramstyle: str, driver: str = "") -> RowsInsert | None:
        """:meth:`insert_parts` for a driver of ``paramstyle`` (named ``driver``), built once
        per table; None where the statement is declared or the driver takes another
        parameter style."""
        key = (spec, paramstyle, driver)
        if key not in self._rows_inserts:
            parts = self.insert_parts(spec)
            found = None
            if parts is not None and paramstyle in POSITIONAL_MARKERS:
                found = self._rows_insert_of(spec, parts, paramstyle, driver)
                apart = self.wake_apart(spec)
                if apart is not None:
                    plain, wake, values = apart
                    sql, names = _driver_style(wake, paramstyle)
                    found = replace(found, apart=(
                        self._rows_insert_of(spec, plain, paramstyle, driver), sql,
                        tuple(values[name] for name in names)))
            self._rows_inserts[key] = found
        return self._rows_inserts[key]

    def _rows_insert_of(self, spec: TableSpec, parts: tuple[str, str, str, dict[str, Any]],
                        paramstyle: str, driver: str) -> RowsInsert:
        *texts, fixed = parts
        converted = [_driver_style(part, paramstyle) for part in texts]
        head, row, tail = (sql for sql, _ in converted)
        names = (converted[0][1], converted[1][1], converted[2][1])
        arrays = self.array_insert(spec, parts)
        return RowsInsert(head, row, tail, names, fixed, self.clock,
                          max(1, self.max_bind_params // max(1, len(names[1]))),
                          self.max_statement_bytes, None if arrays is None else
                          _driver_style(arrays, paramstyle, self.array_marker(driver)))

    def wake_apart(self, spec: TableSpec) -> tuple[tuple[str, str, str, dict[str, Any]],
                                                   str, dict[str, Any]] | None:
        """:meth:`insert_parts` without the wake-up they carry, and the wake-up as a
        statement of its own with its values (:attr:`RowsInsert.apart`); None where the
        publish statement carries none."""
        return None

    def array_insert(self, spec: TableSpec,
                     parts: tuple[str, str, str, dict[str, Any]]) -> str | None:
        """:meth:`insert_parts` for many rows as one row of arrays (:attr:`RowsInsert.arrays`);
        None where the database has no such statement."""
        return None

    def array_marker(self, driver: str) -> str | None:
        """The parameter marker ``driver`` sends an array in fastest (None: its usual)."""
        return None
