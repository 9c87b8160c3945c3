"""The suite's harness: a run's tables and the dialect under test, what a check
expects, and the report of a run."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection, inspect, text
from sqlalchemy.engine import Engine

from ...errors import SchemaMismatch
from ...rows import ClaimedRow
from ...tables import TableBuilder, TableSpec
from ..base import Dialect

#: a lease no check outlives
LONG = 3600.0
#: an advisory-lock space of the suite's own
SPACE = 0x5EC7


class ConformanceError(AssertionError):
    """A dialect failed checks of the suite; ``report`` holds them all."""

    def __init__(self, report: Report) -> None:
        super().__init__(str(report))
        self.report = report


@dataclass(frozen=True)
class Failure:
    check: str
    message: str


@dataclass
class Report:
    """What a run found: the checks passed, skipped (capability not declared), failed."""

    dialect: str
    passed: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures

    def __str__(self) -> str:
        if self.ok:
            return f"{self.dialect}: {len(self.passed)} checks passed"
        lines = [f"{self.dialect}: {len(self.failures)} of "
                 f"{len(self.passed) + len(self.failures)} checks failed:"]
        lines += [f"- {failure.check}: {failure.message}" for failure in self.failures]
        return "\n".join(lines)


class CheckFailed(Exception):
    """One check found the dialect wrong; the message says how."""


def expect(condition: bool, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


class Suite:
    """One run: the engine, the dialect under test and the tables it made."""

    def __init__(self, engine: Engine, dialect: Dialect, patience: float) -> None:
        self.engine = engine
        self.dialect = dialect
        #: seconds any one wait of the suite may take (a lock, a wake-up)
        self.patience = patience
        self.prefix = f"conformance_{uuid.uuid4().hex[:8]}_"

    def name(self, suffix: str) -> str:
        """A table name of this run (every one is dropped at its end)."""
        return self.prefix + suffix

    def table(self, suffix: str, build: Callable[[TableBuilder], TableBuilder]) -> TableSpec:
        """A new table of the given layout, created by the dialect's own DDL."""
        spec = build(TableBuilder(self.name(suffix)).id().payload().attempt().locked_until()
                     ).build()
        with self.engine.begin() as conn:
            self.dialect.ensure_table(conn, spec, create=True)
        return spec

    def publish(self, spec: TableSpec, *rows: dict[str, Any]) -> list[int]:
        """Publish rows (keyword arguments of :meth:`Dialect.insert_params`); their ids."""
        with self.engine.begin() as conn:
            before = self.ids(conn, spec)
            self.dialect.publish(conn, spec, [self.dialect.insert_params(
                **{"payload": b"body", "headers": None, "priority": 0, "eta": None, **row})
                for row in rows])
            return sorted(set(self.ids(conn, spec)) - set(before))

    def ids(self, conn: Connection, spec: TableSpec) -> list[int]:
        f = self.dialect.fields(spec)
        return list(conn.execute(text(f"SELECT {f['id']} FROM {f['table']}")).scalars())

    def claim(self, spec: TableSpec, limit: int = 10, lease: float = LONG,
              **kwargs: Any) -> list[ClaimedRow]:
        with self.engine.begin() as conn:
            return self.dialect.claim(conn, spec, limit, lease, **kwargs)

    def settle(self, spec: TableSpec, statement: str, attempt: int, ids: Sequence[int],
               **extra: Any) -> int:
        with self.engine.begin() as conn:
            return self.dialect.settle(conn, getattr(self.dialect.statements(spec), statement),
                                       {attempt: list(ids)}, extra)

    def scalar(self, spec: TableSpec, statement: str) -> Any:
        with self.engine.begin() as conn:
            return conn.execute(getattr(self.dialect.statements(spec), statement)).scalar()

    def drop_all(self) -> None:
        with self.engine.begin() as conn:
            quote = self.dialect.quote
            for name in inspect(conn).get_table_names():
                if name.startswith(self.prefix):
                    conn.exec_driver_sql(f"DROP TABLE IF EXISTS {quote(name)}")


def ids_of(rows: Sequence[ClaimedRow]) -> list[int]:
    return [row.id for row in rows]


def refusal(suite: Suite, spec: TableSpec, accepted: str) -> str:
    """What ensure_table (not creating) says of a table that does not fit ``spec``; fails
    with ``accepted`` when it says nothing."""
    with suite.engine.begin() as conn:
        try:
            suite.dialect.ensure_table(conn, spec, create=False)
        except SchemaMismatch as exc:
            return str(exc)
    raise CheckFailed(accepted)
