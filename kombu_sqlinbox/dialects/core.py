"""What every statement family of a dialect builds on: the capabilities it declares,
identifiers, and the database's time, with a test's clock bound into it."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from sqlalchemy import Connection, TextClause, bindparam
from sqlalchemy.engine import Engine

from ..clock import PARAMETER, Clock, clock_for
from ..tables import Role, TableSpec


@dataclass(frozen=True)
class Capabilities:
    """What a database offers beyond plain SQL, declared by its dialect (never guessed
    from its statements): the transport picks its claim forms, wake-ups and statement
    shapes from these, and the conformance suite checks each declared one works."""

    #: ``SELECT ... FOR UPDATE`` (:attr:`Dialect.lock_clause`) holds rows to the end of
    #: the transaction; the ``row_lock`` claim form keeps a row locked while it runs
    row_locks: bool = False
    #: the lock clause passes over rows another transaction holds instead of waiting
    skip_locked: bool = False
    #: session-level advisory locks on arbitrary keys (:meth:`Dialect.try_key_locks`),
    #: which the ``advisory`` claim form takes per partition key
    key_locks: bool = False
    #: publishes wake idle consumers in other processes through the database
    #: (:meth:`Dialect.wake`, :meth:`Dialect.listen`, :meth:`Dialect.take_notifications`)
    wakeups: bool = False
    #: ``UPDATE``/``INSERT ... RETURNING``: a claim is one statement and the outbox reads
    #: a generated id from its INSERT; without it a claim locks, then leases, and the id
    #: comes from the cursor's ``lastrowid``
    returning: bool = False

    def serves(self, claim_form: str) -> bool:
        """Whether the claim form of that name can run here (``lease`` runs everywhere)."""
        needs = {"row_lock": self.row_locks and self.skip_locked, "advisory": self.key_locks}
        return needs.get(claim_form, True)


class DialectCore:
    """The base of every statement family (see :class:`~kombu_sqlinbox.dialects.Dialect`)."""

    #: SQLAlchemy dialect names this class serves
    names: ClassVar[tuple[str, ...]] = ()
    #: the database's current time, as stored in time-role columns; every statement
    #: reads "now" from here (or from ``later``, ``eta_value``, ``outbox_ago``,
    #: ``age``, which build on it), so a pinned clock replaces it in one place
    now: str
    #: the database's time at the moment the expression is evaluated, after any lock wait
    #: of its statement (``now`` may be the statement's or transaction's start)
    instant: str
    #: ``now`` at a pinned moment: the bound ``:sqlinbox_now`` (epoch seconds, or NULL
    #: while the clock runs) as this database's time value
    pinned_now: ClassVar[str]
    #: ``available_at`` of a published row: the bound ``:eta`` (epoch seconds) or now
    eta_value: str
    #: what the database offers; a plug-in declares its own (the default: none)
    capabilities: ClassVar[Capabilities] = Capabilities()
    #: how a claim's selection locks the rows it takes: set with ``row_locks`` (empty
    #: where the database has a single writer and needs none)
    lock_clause: ClassVar[str] = ""
    #: SQL types of the default layout, by role (``{generated}`` ids differ)
    column_types: ClassVar[Mapping[Role, str]]
    generated_id_type: ClassVar[str]

    def __init__(self, engine: Engine | None = None) -> None:
        #: None where only the statements' text is wanted (DDL for a migration)
        self.engine = engine
        #: whether publishes wake consumers: the capability, unless the transport's
        #: ``notify`` option turned it off for this instance
        self.notify = self.capabilities.wakeups
        #: the clock installed for this database (:mod:`kombu_sqlinbox.clock`), if any
        self.clock: Clock | None = None if engine is None else clock_for(engine.url)
        if self.clock is not None:
            database_now = self.now
            self.now = f"COALESCE({self.pinned_now}, {database_now})"
            self.instant = f"COALESCE({self.pinned_now}, {self.instant})"
            self.eta_value = self.eta_value.replace(database_now, self.now)

    def clocked(self, statement: TextClause) -> TextClause:
        """``statement`` with the clock's time bound, read at each execution, where it
        uses it (unchanged without a clock)."""
        if self.clock is None or f":{PARAMETER}" not in statement.text:
            return statement
        return statement.bindparams(bindparam(PARAMETER, callable_=self.clock.value))

    def later(self, seconds: str) -> str:
        """SQL for the database's now plus the bound number of seconds ``seconds``."""
        raise NotImplementedError

    def age(self, moment: str) -> str:
        """SQL for the seconds from ``moment`` (a time expression) until now; negative for
        a moment ahead (a lease's end)."""
        raise NotImplementedError

    def epoch(self, moment: str) -> str:
        """SQL: a time as :attr:`now` gives it, in epoch seconds (a DOUBLE)."""
        raise NotImplementedError

    def estimate_of(self, select: str) -> TextClause | None:
        """The EXPLAIN of ``select`` whose plan gives the planner's estimate of the rows it
        returns (:meth:`estimated_rows`): what the dashboard shows of a table too large to
        count; None where the database gives none cheaply."""
        return None

    def estimated_rows(self, conn: Connection, statement: TextClause) -> int:
        """The rows :meth:`estimate_of`'s plan expects."""
        raise NotImplementedError

    def quote(self, name: str) -> str:
        return '"' + name + '"'

    def table_ref(self, spec: TableSpec) -> str:
        table = self.quote(spec.table)
        return f"{self.quote(spec.schema)}.{table}" if spec.schema else table

    def fields(self, spec: TableSpec) -> dict[str, str]:
        """Template values: ``{table}`` plus one quoted name per declared role."""
        values = {"table": self.table_ref(spec), "now": self.now}
        for column in spec.columns:
            values[column.role.value] = self.quote(column.name)
        return values

    def index_name(self, spec: TableSpec, suffix: str = "claim") -> str:
        name = f"{spec.table}_{suffix}"
        if len(name) > 63:
            digest = hashlib.sha1(spec.table.encode()).hexdigest()[:10]
            name = f"{spec.table[:46]}_{digest}_{suffix}"
        return self.quote(name)
