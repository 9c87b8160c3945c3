"""What every dialect shares: quoting, statement caching, the settle and check machinery.

A dialect module holds every statement its database runs; this base only fills
the identifiers of a :class:`~kombu_sqlinbox.tables.TableSpec` into those
templates and executes them. A service adds a database by subclassing
:class:`Dialect` and registering it (:func:`kombu_sqlinbox.dialects.register`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, fields, replace
from functools import cached_property
from operator import itemgetter
from typing import Any, ClassVar

from sqlalchemy import Connection, Row, TextClause, bindparam, event, inspect, text
from sqlalchemy import types as sqltypes
from sqlalchemy.engine import CursorResult, Engine
from sqlalchemy.exc import DBAPIError

from ..clock import PARAMETER, Clock, clock_for
from ..errors import MessageTooLarge, SchemaMismatch
from ..roles import check_identifier
from ..rows import ClaimedRow as ClaimedRow  # built here; re-exported
from ..tables import ROUTING_TABLES, ColumnSpec, Role, TableSpec

logger = logging.getLogger(__name__)

#: attempt -> ids held with that attempt (the attempt is the lease's fencing token)
Tokens = Mapping[int, Sequence[int]]
#: seconds between readings of a table's whole claim floor (:meth:`Dialect.claim_floor`);
#: a row that became ready below the floor waits at most this long
FLOOR_REFRESH = 30.0
#: seconds between the floor's readings from where it stands (between whole readings):
#: a claim passes over the rows deleted in :data:`FLOOR_MARGIN` plus this above it
FLOOR_STEP = 1.0
#: seconds the floor stays below the oldest row it saw: a publish committing late (its
#: transaction's start is its ready time) or with a slightly past ETA stays above it
FLOOR_MARGIN = 10.0
#: beyond any priority a priority column holds (a SMALLINT's largest)
PRIORITY_BOUND = 32767
#: a claim that picks candidates before it locks them (MySQL) picks this many per row
#: wanted, so that rows other claims lock at that moment leave it enough
CANDIDATES = 2


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


@dataclass(frozen=True)
class Statements:
    """The compiled statements of one table; built once per (dialect, spec)."""

    insert: TextClause
    claim: tuple[TextClause, ...]
    claim_ids: tuple[TextClause, ...]
    #: the claim passing over rows of the partition keys in ``:skip`` (the plain claim on
    #: a table without partition keys)
    claim_skipping: tuple[TextClause, ...]
    #: on a FIFO table, the claim of the groups' heads found one group at a time, run
    #: when :attr:`claim` (which reads only the first ``:window`` ready rows) got too few;
    #: without and with ``:skip``
    claim_heads: tuple[TextClause, ...] | None
    claim_heads_skipping: tuple[TextClause, ...] | None
    candidates: TextClause
    extend: TextClause
    complete: TextClause
    delete: TextClause
    release: TextClause
    release_uncounted: TextClause
    retry: TextClause | None
    lock_row: TextClause
    still_held: TextClause
    size: TextClause
    purge: TextClause
    drop: TextClause
    #: the epoch seconds of the table's oldest ready time (now, when it is empty), where
    #: claims take a floor (:attr:`Dialect.floor_time`); read over the whole table, and
    #: from ``:floor`` up (see :meth:`Dialect.oldest_above`)
    floor: TextClause | None = None
    floor_above: TextClause | None = None
    #: one row if any may be ready, read before a claim where claiming takes a lock for
    #: the whole database (:meth:`Dialect.any_ready`)
    any_ready: TextClause | None = None
    #: :attr:`claim` with the completion of ``:ids`` at ``:attempt`` in the same statement,
    #: where the database runs both as one (:meth:`Dialect.completing_claim`)
    claim_completing: TextClause | None = None


@dataclass(frozen=True)
class RoutingStatements:
    """The statements on the routing tables of one table prefix (see
    :meth:`Dialect.build_routing`); list parameters are ``:ids``."""

    names: tuple[str, str, str]
    ddl: list[str]
    drop: list[str]
    declare: TextClause
    kind: TextClause
    message_ttl: TextClause
    expires: TextClause
    touch: TextClause
    registered: TextClause
    bind: TextClause
    unbind: TextClause
    unbind_exchange: TextClause
    bound: TextClause
    forget: tuple[TextClause, ...]
    route: TextClause
    put: TextClause
    claim: tuple[TextClause, ...]
    size: TextClause
    purge: TextClause
    expired_queues: TextClause
    expired_messages: TextClause
    orphans: TextClause
    #: the columns of each table that hold a name (of type :attr:`Dialect.name_type`; a
    #: topic binding's ``pattern``, made of one, of :attr:`Dialect.pattern_type`)
    name_columns: ClassVar[tuple[tuple[str, ...], ...]] = (
        ("name",), ("exchange", "queue", "routing_key", "type", "pattern"), ("queue",))
    #: what a transient messages' table of an earlier release lacks: column, ALTER TABLE
    upgrade: tuple[str, str]

    @staticmethod
    def tables(prefix: str) -> tuple[str, str, str]:
        """The queue registry, the bindings and the transient messages' table names."""
        queues, bindings, transient = (check_identifier(prefix + name, "table")
                                       for name in ROUTING_TABLES)
        return queues, bindings, transient


#: the priority column of the transient messages' table, and the order their claim takes
TRANSIENT_PRIORITY = "priority SMALLINT NOT NULL DEFAULT 0"
TRANSIENT_ORDER = "priority DESC, id"
#: a named parameter in a statement's text (``:name``; not a ``::`` cast)
NAMED_PARAMETER = re.compile(r"(?<![:\w]):(\w+)")
#: parameter styles a statement can be rewritten into for the driver's own cursor
POSITIONAL_MARKERS = {"qmark": "?", "format": "%s", "pyformat": "%s"}


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


def _driver_style(sql: str, paramstyle: str,
                  marker: str | None = None) -> tuple[str, tuple[str, ...]]:
    """``sql`` with its ``:name`` parameters as the driver's positional markers (or
    ``marker``, of the same style), and their names in order."""
    marker = marker or POSITIONAL_MARKERS[paramstyle]
    if marker.startswith("%"):
        sql = sql.replace("%", "%%")
    return NAMED_PARAMETER.sub(marker, sql), tuple(NAMED_PARAMETER.findall(sql))

#: rows past the claim's limit a FIFO claim reads in claim order before it looks for the
#: groups' heads one group at a time: many groups claim from the window, a long group
#: behind its head in work costs the window, not its length
FIFO_WINDOW = 16

#: the roles a claim returns (:meth:`Dialect.returned_columns`), those a table declares
RETURNED_ROLES = (Role.ID, Role.ATTEMPT, Role.PAYLOAD, Role.HEADERS, Role.GROUP,
                  Role.PARTITION_KEY, Role.PRIORITY, Role.AVAILABLE_AT)


def no_wakeups(directory: str, why: object) -> None:
    """Warn that the same-host signal cannot use ``directory`` (a dialect's
    :meth:`Dialect.signal_directory` refused it, or a consumer could not bind there), so
    that a consumer polling where it was expected to be woken says why."""
    logger.warning("sqlinbox: no same-host wake-ups through %s (%s); consumers poll",
                   directory, why)


def plain_payload(payload: Any) -> bytes | str:
    """psycopg2 hands BYTEA over as a memoryview, which a prefork pool cannot pickle."""
    return bytes(payload) if isinstance(payload, memoryview) else payload  # type: ignore[no-any-return]


def json_text(headers: Any) -> str | None:
    """A JSON/JSONB headers column comes back from some drivers (psycopg) already parsed:
    hand on its text, as from a text column. Anything else (SQLite's dynamic typing lets
    a BLOB into any column) goes on as it is, for the decoder to read or park."""
    return json.dumps(headers) if isinstance(headers, (dict, list)) else headers


#: the list parameters of statements: each renders as a parenthesized list of its values
EXPANDING = ("ids", "skip")
#: the parameters of the routing statements that carry a name (``:ids`` may too)
ROUTING_NAMES = ("name", "exchange", "queue", "routing_key", "type", "pattern")


def _expanding(sql: str) -> TextClause:
    """The statement with its list parameters (``:ids``, ``:skip``) bound as expanding."""
    return text(sql).bindparams(*(bindparam(name, expanding=True) for name in EXPANDING
                                  if f":{name}" in sql))


#: a list parameter after ``IN`` or ``NOT IN`` (see :meth:`DriverSql.prepared`)
LIST_MEMBERSHIP = re.compile(rf"\b(NOT )?IN :({'|'.join(EXPANDING)})\b")
#: where a session's info says it runs statements prepared (:meth:`Dialect.prepare_session`):
#: the names of those it prepared
PREPARED = "sqlinbox_prepared"


@dataclass(frozen=True)
class DriverSql:
    """A statement in the driver's positional style for given lengths of its list
    parameters, and where each marker's value comes from: a parameter's name, with the
    position in its list for a list parameter. A prepared one is an ``EXECUTE`` of the
    statement :attr:`prepare` names."""

    sql: str
    values: tuple[tuple[str, int | None], ...]
    #: the ``PREPARE`` a session runs once before ``sql``
    prepare: str | None = None

    @classmethod
    def of(cls, statement: TextClause, paramstyle: str,
           lengths: Mapping[str, int]) -> DriverSql:
        sql = statement.text
        for name, length in lengths.items():
            sql = re.sub(rf"(?<![:\w]):{name}\b",
                         "(" + ", ".join(f":{name}__{at}" for at in range(length)) + ")", sql)
        sql, names = _driver_style(sql, paramstyle)
        values = []
        for name in names:
            listed, _, at = name.rpartition("__")
            values.append((listed, int(at)) if listed in lengths else (name, None))
        return cls(sql, tuple(values))

    @classmethod
    def prepared(cls, statement: TextClause, paramstyle: str) -> DriverSql:
        """The statement as the server's prepared statement: its PREPARE, then an EXECUTE
        binding each parameter once. A list parameter is one array (``= ANY``, ``<> ALL``),
        so one prepared statement serves every length. Its name is its text's digest."""
        sql = LIST_MEMBERSHIP.sub(
            lambda m: f"<> ALL(:{m[2]})" if m[1] else f"= ANY(:{m[2]})", statement.text)
        names = tuple(dict.fromkeys(NAMED_PARAMETER.findall(sql)))
        numbered = NAMED_PARAMETER.sub(lambda m: f"${names.index(m[1]) + 1}", sql)
        name = "sqlinbox_" + hashlib.sha1(numbered.encode()).hexdigest()[:20]
        markers = ", ".join(POSITIONAL_MARKERS[paramstyle] for _ in names)
        return cls(f"EXECUTE {name} ({markers})" if names else f"EXECUTE {name}",
                   tuple((name, None) for name in names), f"PREPARE {name} AS {numbered}")

    def parameters(self, params: Mapping[str, Any], clock: Clock | None) -> tuple[Any, ...]:
        return tuple(
            (clock.value() if clock is not None and name == PARAMETER else params[name])
            if at is None else params[name][at] for name, at in self.values)


class Dialect:
    """Base of the per-database dialects. Subclasses supply the SQL text."""

    #: SQLAlchemy dialect names this class serves
    names: ClassVar[tuple[str, ...]] = ()
    #: the database's current time, as stored in time-role columns; every statement
    #: reads "now" from here (or from ``later``, ``eta_value``, ``outbox_ago``,
    #: ``age``, which build on it), so a pinned clock replaces it in one place
    now: str
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
    #: run first in a transaction whose commit need not wait for the disk: fenced work
    #: (claims, settlements, sweeps) and the publishes of a queue that allows it. It sets
    #: whatever else the transport's own statements need there (PostgreSQL: the
    #: planner's settings under which they read their indexes, whatever the tables'
    #: statistics say)
    relaxed_commit: ClassVar[str | None] = None
    #: the same for a whole session of the transport's own (the LISTEN connection's and
    #: the lease keeper's, which run only fenced work)
    relaxed_session: ClassVar[str | None] = None
    #: create_engine() arguments this database's engines get unless the user sets them
    engine_defaults: ClassVar[Mapping[str, Any]] = {}
    #: the largest statement the server accepts, when it has such a limit
    max_statement_bytes: int | None = None
    #: what begins a transaction of ours on a bare driver connection (None: the driver
    #: begins one itself)
    begin_write: ClassVar[str | None] = None
    #: the driver connection is in autocommit mode: a single publish statement is a
    #: transaction of its own (as durable as BEGIN, INSERT, COMMIT), with no BEGIN or
    #: COMMIT to send (SQLite; a server's pooled connections stay out of autocommit, see
    #: :attr:`autocommit_switch`)
    autocommit_write: ClassVar[bool] = False
    #: a durable publish switches the driver connection to autocommit for its one
    #: statement, which the server commits before it replies (its reply says the row
    #: landed, as a COMMIT's would): one round trip instead of BEGIN, INSERT, COMMIT. Only
    #: where the switch itself sends nothing to the server
    autocommit_switch: ClassVar[bool] = False
    #: where switching costs a round trip each way: publishes run on connections of their
    #: own, switched to autocommit once when they open (:attr:`.Database.publish_pool`),
    #: so a publish is one statement the server commits, whatever its durability
    autocommit_kept: ClassVar[bool] = False
    #: the most parameters one statement may bind
    max_bind_params: ClassVar[int] = 65535
    #: ``:floor`` (epoch seconds) as a time value where claims read past the rows below
    #: a floor (:meth:`claim_floor`): an MVCC database, whose deleted rows stay in the
    #: claim index while any snapshot older than their deletion is open (None: a claim
    #: reads from the index's start)
    floor_time: ClassVar[str | None] = None

    def __init__(self, engine: Engine | None = None) -> None:
        #: None where only the statements' text is wanted (DDL for a migration)
        self.engine = engine
        #: whether publishes wake consumers: the capability, unless the transport's
        #: ``notify`` option turned it off for this instance
        self.notify = self.capabilities.wakeups
        self._statements: dict[TableSpec, Statements] = {}
        self._rows_inserts: dict[tuple[TableSpec, str, str], RowsInsert | None] = {}
        self._routing: dict[str, RoutingStatements] = {}
        #: statements as the driver's SQL (:meth:`execute`), by paramstyle and list lengths
        self._driver_sql: dict[tuple[TextClause, str, tuple[int, ...]], DriverSql] = {}
        #: per table: its claim floor, the monotonic times it was read last and whole
        self._floors: dict[TableSpec, tuple[float, float, float]] = {}
        #: seconds between whole readings of a claim floor, and between readings from it
        self.floor_refresh = FLOOR_REFRESH
        self.floor_step = FLOOR_STEP
        #: the clock installed for this database (:mod:`kombu_sqlinbox.clock`), if any
        self.clock: Clock | None = None if engine is None else clock_for(engine.url)
        if self.clock is not None:
            database_now = self.now
            self.now = f"COALESCE({self.pinned_now}, {database_now})"
            self.eta_value = self.eta_value.replace(database_now, self.now)

    def clocked(self, statement: TextClause) -> TextClause:
        """``statement`` with the clock's time bound, read at each execution, where it
        uses it (unchanged without a clock)."""
        if self.clock is None or f":{PARAMETER}" not in statement.text:
            return statement
        return statement.bindparams(bindparam(PARAMETER, callable_=self.clock.value))

    def _clock_all(self, statements: Statements) -> Statements:
        """Every statement of a table :meth:`clocked`."""
        if self.clock is None:
            return statements

        def clock(value: Any) -> Any:
            if isinstance(value, tuple):
                return tuple(self.clocked(item) for item in value)
            return None if value is None else self.clocked(value)
        return replace(statements, **{field.name: clock(getattr(statements, field.name))
                                      for field in fields(statements)})

    # -- identifiers -------------------------------------------------------
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

    # -- statement fragments shared by every dialect ----------------------
    def ready_filter(self, spec: TableSpec, alias: str = "r", heads: bool = True,
                     gone: str = "") -> str:
        """Rows of ``alias`` that may be claimed now: not leased, due, not processed and,
        in a FIFO group, the group's head (no earlier unfinished row in the group; not
        checked without ``heads``, for rows known to be heads; rows whose ids the query
        ``gone`` returns count as finished)."""
        f = self.fields(spec)
        col = f"{alias}." if alias else ""
        conditions = [
            f"({col}{f['locked_until']} IS NULL OR {col}{f['locked_until']} < {self.now})"]
        if spec.has(Role.AVAILABLE_AT):
            conditions.append(f"{col}{f['available_at']} <= {self.now}")
        if spec.has(Role.PROCESSED_AT):
            conditions.append(f"{col}{f['processed_at']} IS NULL")
        if heads and self.fifo(spec):
            conditions.append(self.head_of(spec, Role.GROUP, alias, gone))
        return " AND ".join(conditions)

    @staticmethod
    def fifo(spec: TableSpec) -> bool:
        """Whether the table's group column orders its rows (``fifo=True``)."""
        group = spec.column(Role.GROUP)
        return group is not None and group.fifo

    def unfinished(self, spec: TableSpec, alias: str) -> str:
        """`` AND`` the row of ``alias`` is not processed, where the table keeps processed
        rows (else nothing)."""
        if not spec.has(Role.PROCESSED_AT):
            return ""
        return f" AND {alias}.{self.quote(spec.name_of(Role.PROCESSED_AT))} IS NULL"

    def head_of(self, spec: TableSpec, role: Role, alias: str = "r", gone: str = "") -> str:
        """The row is the first unfinished one of its group (or partition key), or has
        none: a probe of the ``(group, id)`` index per row, never a join that reads the
        table. Rows whose ids the query ``gone`` returns count as finished."""
        f = self.fields(spec)
        col = f"{alias}." if alias else ""
        unfinished = self.unfinished(spec, "ahead")
        if gone:
            unfinished += f" AND ahead.{f['id']} NOT IN ({gone})"
        key = f[role.value]
        return (f"({col}{key} IS NULL OR {col}{f['id']} = (SELECT ahead.{f['id']} "
                f"FROM {f['table']} AS ahead WHERE ahead.{key} = {col}{key}{unfinished} "
                f"ORDER BY ahead.{key}, ahead.{f['id']} LIMIT 1))")

    def selection(self, spec: TableSpec, by_ids: bool, skipping: bool = False,
                  heads: bool = False, gone: str = "") -> str:
        """Which rows a claim takes: the first ``:limit`` ready ones in claim order, or the
        ready ones among ``:ids`` (rows whose keys an advisory claim has locked).
        ``skipping`` passes over rows of the partition keys in ``:skip`` (keys in work in
        the claiming consumer, whose rows it would only hold back).

        On a FIFO table the ordered claim looks only at the first ``:window`` ready rows:
        rows queued behind a head in work would otherwise be read, and passed over, by
        every claim. ``heads`` instead takes the ready rows among the groups' heads,
        found one group at a time (:meth:`fifo_heads`): the fallback when the window had
        too few heads."""
        f = self.fields(spec)
        if by_ids:
            return f"WHERE r.{f['id']} IN :ids AND " + self.ready_filter(spec)
        skip = ""
        if skipping:
            key = f"r.{f['partition_key']}"
            skip = f" AND ({key} IS NULL OR {key} NOT IN :skip)"
        join, among, order = "", "", self.claim_order(spec, "r")
        if heads:
            join, among, order = self.among(
                f"r.{f['id']}", f"SELECT h.id FROM ({self.fifo_heads(spec)}) AS h", order)
        elif self.fifo(spec):
            join, among, order = self.among(f"r.{f['id']}", (
                f"SELECT w.{f['id']} FROM (SELECT w.{f['id']} FROM {f['table']} AS w "
                f"WHERE {self.ready_filter(spec, 'w', False)}{self.above_floor(spec, 'w')} "
                f"ORDER BY {self.claim_order(spec, 'w')} LIMIT :window) AS w"), order)
        return (f"{join}WHERE {among}{self.ready_filter(spec, heads=not heads, gone=gone)}"
                f"{self.above_floor(spec)}{skip} "
                f"ORDER BY {order} LIMIT :limit")

    def above_floor(self, spec: TableSpec, alias: str = "r") -> str:
        """The claim's condition that skips the index entries below the table's floor
        (see :meth:`claim_floor`) without reading their rows; empty where claims take
        no floor."""
        if self.floor_time is None or not spec.has(Role.AVAILABLE_AT):
            return ""
        return (f" AND {alias}.{self.quote(spec.name_of(Role.AVAILABLE_AT))} >= "
                f"{self.floor_time.format('floor')}")

    def ordered_select(self, spec: TableSpec, columns: Sequence[str], selection: str,
                       lock: str = "") -> str:
        """``SELECT`` of ``columns`` from the rows of ``spec`` (as ``r``) that ``selection``
        picks, under the lock clause ``lock`` (leading space) if any."""
        return (f"SELECT {', '.join(columns)} FROM {self.table_ref(spec)} AS r"
                f"{self.index_hint(spec)} {selection}{lock}")

    def oldest_above(self, spec: TableSpec) -> str:
        """The ready times (as ``available_at``) whose least is the oldest of the rows at
        or above ``:floor`` (ready, leased or due later): the first of the default
        priority (0, nearly every row) in claim order, an index range that starts at the
        floor and stops at that row, and the oldest of each other band of priorities,
        read whole (each an index range of its own: their rows are few)."""
        f = self.fields(spec)
        ready = f"r.{f['available_at']}"
        first = (f"SELECT {ready} FROM {f['table']} AS r{self.index_hint(spec)} WHERE {{}}"
                 f"{ready} >= {(self.floor_time or '').format('floor')} "
                 f"ORDER BY {self.claim_order(spec, 'r')} LIMIT 1")
        if not spec.has(Role.PRIORITY):
            return first.format("")
        priority = f"r.{f['priority']}"
        # a range, not an inequality: a planner without statistics reads a range through
        # the index
        others = [f"SELECT MIN({ready}) FROM {f['table']} AS r{self.index_hint(spec)} "
                  f"WHERE {priority} BETWEEN {low} AND {high}"
                  for low, high in ((1, PRIORITY_BOUND), (-PRIORITY_BOUND, -1))]
        return " UNION ALL ".join(
            f"({query})" for query in [first.format(f"{priority} = 0 AND "), *others])

    def index_hint(self, spec: TableSpec, index: str = "claim") -> str:
        """What makes a statement read ``spec``'s table through its index of that
        :meth:`index_columns` suffix (``PRIMARY``: its primary key), whatever the table's
        statistics say; empty where the planner needs no telling."""
        return ""

    def among(self, row_id: str, ids: str, order: str) -> tuple[str, str, str]:
        """A join and a condition (each empty or ending in a space) keeping the rows whose
        ``row_id`` the query ``ids`` returns, and the claim ``order`` to sort them by:
        those few ids must drive the claim, not a walk of the claim index in ``order``
        checking each row."""
        return "", f"{row_id} IN ({ids}) AND ", order

    #: a condition few rows meet, as this database's planner is told so (a rare NULL
    #: group must be found through the group index, however few groups its statistics saw)
    rare: ClassVar[str] = "{}"

    def fifo_heads(self, spec: TableSpec) -> str:
        """The ids of a FIFO table's heads: the first unfinished row of each group
        (:meth:`group_heads`), then the first ``:limit`` ready rows without a group (each
        a head of its own), by id."""
        f = self.fields(spec)
        ungrouped = self.rare.format(f"r.{f['group']} IS NULL")
        return (f"{self.group_heads(spec)} UNION ALL SELECT * FROM (SELECT r.{f['id']} "
                f"FROM {f['table']} AS r WHERE {ungrouped} AND "
                f"{self.ready_filter(spec, heads=False)} "
                f"ORDER BY r.{f['group']}, r.{f['id']} LIMIT :limit) AS n")

    def group_heads(self, spec: TableSpec) -> str:
        """The first unfinished row of each group, as ``id``: a loose index scan of the
        ``(group, id)`` index (a recursive CTE stepping from each group to the next, then
        to its first row), a probe or two per group, however long the groups are."""
        f = self.fields(spec)
        group, row_id = f["group"], f["id"]
        unfinished = self.unfinished(spec, "x")
        first = f"SELECT x.{{}} FROM {f['table']} AS x WHERE x.{group} {{}}{unfinished} "
        next_group = first.format(group, "> g.g") + f"ORDER BY x.{group} LIMIT 1"
        head = first.format(row_id, "= g.g") + f"ORDER BY x.{group}, x.{row_id} LIMIT 1"
        lowest = f"SELECT MIN(x.{group}) FROM {f['table']} AS x" + (
            f" WHERE {unfinished[len(' AND '):]}" if unfinished else "")
        return (f"WITH RECURSIVE g (g) AS ({lowest} "
                f"UNION ALL SELECT ({next_group}) FROM g WHERE g.g IS NOT NULL) "
                f"SELECT ({head}) AS id FROM g WHERE g.g IS NOT NULL")

    def claim_order(self, spec: TableSpec, alias: str = "") -> str:
        """Priority first (AMQP: higher first), then the time a row became ready, then id."""
        f = self.fields(spec)
        col = f"{alias}." if alias else ""
        order = []
        if spec.has(Role.PRIORITY):
            order.append(f"{col}{f['priority']} DESC")
        if spec.has(Role.AVAILABLE_AT):
            order.append(col + f["available_at"])
        order.append(col + f["id"])
        return ", ".join(order)

    def returned_columns(self, spec: TableSpec, alias: str = "") -> str:
        """What a claim returns: each declared column :meth:`claimed` reads, labelled with
        its role (id, attempt, payload, headers, group, partition key, priority, ready
        time), then row mode's columns labelled ``x0``, ``x1``..."""
        f = self.fields(spec)
        col = f"{alias}." if alias else ""
        roles = [f"{col}{f[role.value]} AS {self.quote(role.value)}"
                 for role in RETURNED_ROLES if spec.has(role)]
        # row mode's columns, labelled by position (a name could clash with a role's)
        extra = [f"{col}{self.quote(name)} AS {self.quote(f'x{at}')}"
                 for at, name in enumerate(spec.row_columns)]
        return ", ".join(roles + extra)

    def statements(self, spec: TableSpec) -> Statements:
        cached = self._statements.get(spec)
        if cached is None:
            cached = self._statements[spec] = self._clock_all(self.build_statements(spec))
        return cached

    def build_statements(self, spec: TableSpec) -> Statements:
        claim = self.claim_statements(spec, self.selection(spec, False))
        skipping = claim
        if spec.has(Role.PARTITION_KEY):
            skipping = self.claim_statements(spec, self.selection(spec, False, skipping=True))
        heads = heads_skipping = None
        if self.fifo(spec):
            heads = heads_skipping = self.claim_statements(spec, self.selection(
                spec, False, heads=True))
            if spec.has(Role.PARTITION_KEY):
                heads_skipping = self.claim_statements(spec, self.selection(
                    spec, False, skipping=True, heads=True))
        return self.assemble(spec, claim, self.claim_statements(spec, self.selection(spec, True)),
                             skipping, (heads, heads_skipping))

    def claim_statements(self, spec: TableSpec, selection: str) -> tuple[TextClause, ...]:
        """The claim of the rows ``selection`` picks: lease them, bump the attempt, return
        them (see :meth:`returned_columns`), in as few round trips as the database allows."""
        raise NotImplementedError

    def later(self, seconds: str) -> str:
        """SQL for the database's now plus the bound number of seconds ``seconds``."""
        raise NotImplementedError

    def age(self, moment: str) -> str:
        """SQL for the seconds from ``moment`` (a time expression) until now; negative for
        a moment ahead (a lease's end)."""
        raise NotImplementedError

    def assemble(self, spec: TableSpec, claim: tuple[TextClause, ...],
                 claim_ids: tuple[TextClause, ...],
                 claim_skipping: tuple[TextClause, ...],
                 claim_heads: tuple[tuple[TextClause, ...] | None,
                                    tuple[TextClause, ...] | None]) -> Statements:
        """A table's statements around its dialect-written claim. Statements on held
        rows have the same shape everywhere, fenced by (attempt, ids)."""
        f = self.fields(spec)
        fence = f"WHERE {f['attempt']} = :attempt AND {f['id']} IN :ids"
        # a row given back (released, retried, completed in place) has no lease: an
        # extension written after its settlement must not lease it again
        extend = (f"UPDATE {f['table']} SET {f['locked_until']} = {self.later(':lease')} "
                  f"{fence} AND {f['locked_until']} IS NOT NULL")
        retry = None
        if spec.has(Role.AVAILABLE_AT):
            retry = _expanding(
                f"UPDATE {f['table']} SET {f['locked_until']} = NULL, "
                f"{f['available_at']} = {self.later(':delay')} {fence}")
        one_row = (f"SELECT r.{f['id']} FROM {f['table']} AS r "
                   f"WHERE r.{f['id']} = :id AND r.{f['attempt']} = :attempt ")
        delete = f"DELETE FROM {f['table']} {fence}"
        complete = delete
        if spec.has(Role.PROCESSED_AT):
            complete = (
                f"UPDATE {f['table']} SET {f['processed_at']} = {self.now}, "
                f"{f['locked_until']} = NULL {fence}"
            )
        release = f"UPDATE {f['table']} SET {f['locked_until']} = NULL {fence}"
        uncounted = (
            f"UPDATE {f['table']} SET {f['locked_until']} = NULL, "
            f"{f['attempt']} = {f['attempt']} - 1 {fence}"
        )
        waiting = f"WHERE {f['locked_until']} IS NULL OR {f['locked_until']} < {self.now}"
        if spec.has(Role.PROCESSED_AT):
            waiting = f"WHERE ({waiting[6:]}) AND {f['processed_at']} IS NULL"
        key = f"r.{f['partition_key']}" if spec.has(Role.PARTITION_KEY) else "NULL"
        key_head = (" AND " + self.head_of(spec, Role.PARTITION_KEY)
                    if spec.has(Role.PARTITION_KEY) else "")
        floor = floor_above = None
        if self.floor_time is not None and spec.has(Role.AVAILABLE_AT):
            # never above the present: with only rows due later in the table, a floor at
            # their ready time would hide every row published until the next whole reading
            least = f"MIN({f['available_at']})"
            oldest = f"CASE WHEN {least} < {self.now} THEN {least} ELSE {self.now} END"
            floor = text(f"SELECT {self.epoch(oldest)} FROM {f['table']}")
            floor_above = text(f"SELECT {self.epoch(oldest)} FROM "
                               f"({self.oldest_above(spec)}) AS m")
        candidates = self.ordered_select(spec, [f"r.{f['id']}", key], (
            f"WHERE {self.ready_filter(spec)}{self.above_floor(spec)}"
            f"{key_head} ORDER BY {self.claim_order(spec, 'r')} LIMIT :limit"))
        return Statements(
            insert=self.insert_statement(spec),
            claim=claim,
            claim_ids=claim_ids,
            claim_skipping=claim_skipping,
            claim_heads=claim_heads[0],
            claim_heads_skipping=claim_heads[1],
            candidates=text(candidates),
            extend=_expanding(extend),
            retry=retry,
            lock_row=text(one_row + self.lock_clause),
            still_held=text(one_row),
            complete=_expanding(complete),
            delete=_expanding(delete),
            release=_expanding(release),
            release_uncounted=_expanding(uncounted),
            size=text(f"SELECT COUNT(*) FROM {f['table']} {waiting}"),
            purge=text(f"DELETE FROM {f['table']} {waiting}"),
            drop=text(self.drop_ddl(spec)),
            floor=floor,
            floor_above=floor_above,
            any_ready=self.any_ready(spec),
            claim_completing=self.completing_claim(spec, claim, complete),
        )

    def completing_claim(self, spec: TableSpec, claim: tuple[TextClause, ...],
                         complete: str) -> TextClause | None:
        """The claim ``claim`` and the fenced ``complete`` of the rows a consumer acked, as
        one statement returning the claimed rows and the completed count (``completed``, last
        on each row; a row of NULLs with it when none was claimed): a busy consumer's acks
        then cost no round trip of their own. On a FIFO table it also wakes the table's
        consumers, as :meth:`wake` after a settlement. None where the database has no
        such statement."""
        return None

    def any_ready(self, spec: TableSpec) -> TextClause | None:
        """A read that finds a row a claim could take, if there is one, run before the
        claim so that an idle consumer's rounds take no write lock; None where an empty
        claim locks nothing (a server's claim locks only the rows it takes)."""
        return None

    # -- operations --------------------------------------------------------
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

    def index_name(self, spec: TableSpec, suffix: str = "claim") -> str:
        name = f"{spec.table}_{suffix}"
        if len(name) > 63:
            digest = hashlib.sha1(spec.table.encode()).hexdigest()[:10]
            name = f"{spec.table[:46]}_{digest}_{suffix}"
        return self.quote(name)

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
                *texts, fixed = parts
                converted = [_driver_style(part, paramstyle) for part in texts]
                head, row, tail = (sql for sql, _ in converted)
                names = (converted[0][1], converted[1][1], converted[2][1])
                arrays = self.array_insert(spec, parts)
                found = RowsInsert(head, row, tail, names, fixed, self.clock,
                                   max(1, self.max_bind_params // max(1, len(names[1]))),
                                   self.max_statement_bytes, None if arrays is None else
                                   _driver_style(arrays, paramstyle, self.array_marker(driver)))
            self._rows_inserts[key] = found
        return self._rows_inserts[key]

    def array_insert(self, spec: TableSpec,
                     parts: tuple[str, str, str, dict[str, Any]]) -> str | None:
        """:meth:`insert_parts` for many rows as one row of arrays (:attr:`RowsInsert.arrays`);
        None where the database has no such statement."""
        return None

    def array_marker(self, driver: str) -> str | None:
        """The parameter marker ``driver`` sends an array in fastest (None: its usual)."""
        return None

    def publish(self, conn: Connection, spec: TableSpec, params: Sequence[dict[str, Any]]) -> None:
        conn.execute(self.statements(spec).insert, list(params))

    def execute(self, conn: Connection, statement: TextClause,
                params: Mapping[str, Any]) -> CursorResult[Any]:
        """Run one of the statements a consumer runs per claim (the claim, settlements,
        lease extensions) as the driver's own SQL: SQLAlchemy's compiling and parameter
        processing of a ``text()`` cost several times the driver's work, once per claim
        and per ack. Errors, connection invalidation and events stay SQLAlchemy's. List
        parameters are never empty here; a driver with named parameters takes the usual
        path."""
        paramstyle = conn.dialect.paramstyle
        if paramstyle not in POSITIONAL_MARKERS:
            return conn.execute(statement, dict(params))
        prepared: set[str] | None = conn.info.get(PREPARED)
        if prepared is not None:
            return self._execute_prepared(conn, statement, params, prepared)
        lengths = {name: len(params[name]) for name in EXPANDING
                   if f":{name}" in statement.text}
        key = (statement, paramstyle, tuple(lengths.values()))
        driver = self._driver_sql.get(key)
        if driver is None:
            driver = self._driver_sql[key] = DriverSql.of(statement, paramstyle, lengths)
        return conn.exec_driver_sql(driver.sql, driver.parameters(params, self.clock))

    def _execute_prepared(self, conn: Connection, statement: TextClause,
                          params: Mapping[str, Any], prepared: set[str]) -> CursorResult[Any]:
        """:meth:`execute` on a session of :meth:`prepare_session`'s: the statement is
        prepared on its first run there, and executed by name from then on."""
        key = (statement, PREPARED, ())
        driver = self._driver_sql.get(key)
        if driver is None:
            driver = self._driver_sql[key] = DriverSql.prepared(statement,
                                                                conn.dialect.paramstyle)
        assert driver.prepare is not None  # a prepared statement's
        if driver.prepare not in prepared:
            conn.exec_driver_sql(driver.prepare)
            prepared.add(driver.prepare)
        return conn.exec_driver_sql(driver.sql, driver.parameters(params, self.clock))

    def prepare_session(self, conn: Connection) -> None:
        """Run :meth:`execute`'s statements on ``conn`` as prepared statements from now
        on, where the database plans a statement each time it comes as text and a
        prepared one once: a consumer's claim is planned on every round otherwise. Only
        for a session of its own (the LISTEN connection): a prepared statement lives
        in its session, which a pooler sharing server sessions would not keep."""

    def claim(
        self, conn: Connection, spec: TableSpec, limit: int, lease: float,
        ids: Sequence[int] | None = None, skip: Sequence[Any] = (),
    ) -> list[ClaimedRow]:
        """Lease up to ``limit`` ready rows (or the ready ones of ``ids``; none of the
        partition keys in ``skip``) in the caller's transaction: in one ``UPDATE ...
        RETURNING`` where the database has it, else by locking the rows, then leasing them.
        On a FIFO table a claim that found too few heads in its window goes on with the
        heads found group by group (see :meth:`selection`), in the same transaction."""
        statements = self.claim_statements_for(spec, ids, skip)
        params = self.claim_parameters(conn, spec, limit, lease, ids=list(ids or ()),
                                       skip=list(skip))
        rows = self.claim_rows(conn, statements, params)
        if ids is None:
            rows = self._with_heads(conn, spec, rows, params, skip)
        return self.claimed(spec, rows, leased=self.capabilities.returning)

    def _with_heads(self, conn: Connection, spec: TableSpec, rows: list[Row[Any]],
                    params: dict[str, Any], skip: Sequence[Any]) -> list[Row[Any]]:
        """``rows``, and on a FIFO table whose claim found fewer than ``:limit`` heads in
        its window, the heads found group by group (see :meth:`selection`)."""
        compiled = self.statements(spec)
        heads = compiled.claim_heads_skipping if skip else compiled.claim_heads
        wanted = params["limit"] - len(rows)
        if heads is None or wanted <= 0:
            return rows
        return rows + self.claim_rows(conn, heads, {**params, "limit": wanted})

    def claim_parameters(self, conn: Connection, spec: TableSpec, limit: int, lease: float,
                         **given: Any) -> dict[str, Any]:
        """What a claim statement of ``spec`` binds, plus ``given``."""
        return {"limit": limit, "lease": lease, "window": limit + FIFO_WINDOW,
                "floor": self.claim_floor(conn, spec), "candidates": limit * CANDIDATES,
                **given}

    def complete_and_claim(self, conn: Connection, spec: TableSpec, limit: int, lease: float,
                           attempt: int, ids: Sequence[int]) -> tuple[int, list[ClaimedRow]]:
        """Complete the rows ``ids`` held at ``attempt`` and lease up to ``limit`` ready
        rows, in one statement (:attr:`Statements.claim_completing`, which the table must
        have): how many rows were completed, and the claimed ones."""
        statement = self.statements(spec).claim_completing
        assert statement is not None, "the table has no completing claim"
        params = self.claim_parameters(conn, spec, limit, lease, attempt=attempt,
                                       ids=list(ids))
        rows = list(self.execute(conn, statement, params).all())
        completed = int(rows[0].completed)
        claimed = self._with_heads(conn, spec, [row for row in rows if row.id is not None],
                                   params, ())
        return completed, self.claimed(spec, claimed)

    def claim_rows(self, conn: Connection, statements: tuple[TextClause, ...],
                   params: dict[str, Any]) -> list[Row[Any]]:
        """The rows one claim statement (or select and lease) took."""
        if self.capabilities.returning:
            (claim,) = statements
            return list(self.execute(conn, claim, params).all())
        select, lease_rows = statements
        rows = list(self.execute(conn, select, params).all())
        if rows:
            self.execute(conn, lease_rows, {"ids": [row.id for row in rows],
                                            "lease": params["lease"]})
        return rows

    def claim_floor(self, conn: Connection, spec: TableSpec) -> float | None:
        """The ready time (epoch seconds) below which a claim of ``spec`` looks for no row.

        A queue deletes the rows it has done with in claim order, so they pile up at the
        head of the claim index; while a snapshot older than their deletion stays open
        anywhere in the database (a transaction left idle, a long report), neither vacuum
        nor InnoDB's purge can remove them, and a claim reading from the index's start
        visits every one. Below the floor it passes over them in the index alone. The
        floor is the oldest ready time of any row in the table (ready, leased, or due
        later) or the present, whichever is sooner (a row due later must not hide those
        published before it is due), less :data:`FLOOR_MARGIN`, read over the whole table
        every :attr:`floor_refresh` seconds: a row falls below it only by committing more than
        the margin after its ready time (a transaction's start, for a publish inside one)
        or with an ETA further than the margin in the past, and then waits for the next
        whole reading. That reading walks the dead rows too; in between, every
        :attr:`floor_step` seconds, the floor is read again from where it stands
        (:meth:`oldest_above`), which walks only those above it: the floor follows the
        queue's head, and a claim passes over the rows deleted in the margin and the step."""
        statements = self.statements(spec)
        if statements.floor is None or statements.floor_above is None:
            return None
        now = time.monotonic()
        known = self._floors.get(spec)
        if known is None or now - known[2] >= self.floor_refresh:
            oldest = float(conn.execute(statements.floor).scalar_one())
            known = self._floors[spec] = (oldest - FLOOR_MARGIN, now, now)
        elif now - known[1] >= self.floor_step:
            oldest = float(conn.execute(statements.floor_above, {"floor": known[0]}).scalar_one())
            known = self._floors[spec] = (max(known[0], oldest - FLOOR_MARGIN), now, known[2])
        return known[0]

    def forget_floor(self, spec: TableSpec) -> None:
        """Read the floor of ``spec`` again at its next claim (its table was emptied or
        made anew)."""
        self._floors.pop(spec, None)

    def claim_statements_for(self, spec: TableSpec, ids: Sequence[int] | None,
                             skip: Sequence[Any]) -> tuple[TextClause, ...]:
        """The claim to run: by ids, passing over keys, or plain (no empty ``NOT IN``)."""
        statements = self.statements(spec)
        if ids is not None:
            return statements.claim_ids
        return statements.claim_skipping if skip else statements.claim

    @staticmethod
    def claimed(spec: TableSpec, rows: Sequence[Row[Any]], leased: bool = True) -> list[ClaimedRow]:
        """The rows of :meth:`returned_columns`, read by label, in claim order (RETURNING
        gives none): -priority, ready time, id. Rows selected before their lease
        (``leased=False``) carry the attempt the lease then raised. Labels are resolved
        to positions once per claim, and the rows sorted by those positions (the
        priority's pass last, descending: sorts are stable): reading each row by name,
        or building a sort key for each, costs a good part of a consume."""
        if not rows:
            return []
        position = {label: at for at, label in enumerate(rows[0]._fields)}

        def read(label: str) -> Callable[[Row[Any]], Any]:
            at = position.get(label)
            return (lambda row: None) if at is None else itemgetter(at)

        ready = [position[Role.AVAILABLE_AT.value]] if spec.has(Role.AVAILABLE_AT) else []
        ordered = sorted(rows, key=itemgetter(*ready, position[Role.ID.value]))
        if spec.has(Role.PRIORITY):
            ordered.sort(key=itemgetter(position[Role.PRIORITY.value]), reverse=True)
        row_id, attempt, payload, headers, group, partition_key = (read(label) for label in (
            "id", "attempt", "payload", "headers", "group", "partition_key"))
        extra = [read(f"x{at}") for at in range(len(spec.row_columns))]
        raised = 0 if leased else 1
        return [ClaimedRow(
            id=row_id(row), attempt=attempt(row) + raised, payload=plain_payload(payload(row)),
            headers=json_text(headers(row)), group=group(row),
            partition_key=partition_key(row),
            columns=tuple(plain_payload(value(row)) for value in extra) if extra else ())
            for row in ordered]

    def settle(self, conn: Connection, statement: TextClause, tokens: Tokens,
               extra: Mapping[str, Any] | None = None) -> int:
        """Run a fenced statement once per attempt value; returns the rows it touched."""
        touched = 0
        for attempt, ids in tokens.items():
            if ids:
                params = {"attempt": attempt, "ids": list(ids), **(extra or {})}
                touched += self.execute(conn, statement, params).rowcount
        return touched

    def extend(self, conn: Connection, spec: TableSpec, tokens: Tokens, lease: float) -> int:
        return self.settle(conn, self.statements(spec).extend, tokens, {"lease": lease})

    # -- declarations and checks -------------------------------------------
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

    # -- engines ---------------------------------------------------------------
    def prepare_engine(self, engine: Engine, sqlite_begin: str = "IMMEDIATE") -> None:
        """Set up an engine of ours (the transport's, the outbox's): per-connection settings
        and, where the database needs it, how transactions begin."""
        event.listen(engine, "connect", lambda dbapi, record: self.on_connect(dbapi))

    def on_connect(self, dbapi_connection: Any) -> None:
        """Session settings every new connection gets."""

    # -- operations (``celery sqlinbox``) ---------------------------------------
    def queue_stats(self, spec: TableSpec) -> TextClause:
        """One pass over a queue table's unfinished rows, each counted in exactly one
        state: ``in_work`` (a live lease), ``delayed`` (not due yet), ``ready`` (claimable
        now), ``blocked`` (due, behind an unfinished earlier row of its FIFO group). Also
        ``lapsed`` (leases that ran out unsettled: a dead worker's rows, claimable again
        and counted ready or blocked), ``oldest_ready_age`` (seconds), ``lease_left``
        (seconds until the soonest live lease ends) and ``blocked_groups`` (FIFO groups
        whose head is in work with rows behind it)."""
        f = self.fields(spec)
        live = f"r.{f['locked_until']} >= {self.now}"
        free = f"(r.{f['locked_until']} IS NULL OR r.{f['locked_until']} < {self.now})"
        due = (f"r.{f['available_at']} <= {self.now}" if spec.has(Role.AVAILABLE_AT)
               else "1 = 1")
        group = spec.column(Role.GROUP)
        fifo = group is not None and group.fifo
        head = self.head_of(spec, Role.GROUP) if fifo else "1 = 1"
        unfinished = (f"r.{f['processed_at']} IS NULL" if spec.has(Role.PROCESSED_AT)
                      else "1 = 1")
        ready = f"{free} AND {due} AND {head}"
        soonest_end = f"MIN(CASE WHEN {live} THEN r.{f['locked_until']} END)"
        oldest_ready = (self.age(f"MIN(CASE WHEN {ready} THEN r.{f['available_at']} END)")
                        if spec.has(Role.AVAILABLE_AT) else "NULL")
        blocked_groups = "0"
        if fifo:
            behind = (f" AND b.{f['processed_at']} IS NULL" if spec.has(Role.PROCESSED_AT)
                      else "")
            blocked_groups = (
                f"(SELECT COUNT(DISTINCT r.{f['group']}) FROM {f['table']} AS r "
                f"WHERE {live} AND EXISTS (SELECT 1 FROM {f['table']} AS b "
                f"WHERE b.{f['group']} = r.{f['group']} AND b.{f['id']} > r.{f['id']}"
                f"{behind}))")
        figures = {
            "ready": f"COALESCE(SUM(CASE WHEN {ready} THEN 1 ELSE 0 END), 0)",
            "delayed": f"COALESCE(SUM(CASE WHEN {free} AND NOT ({due}) THEN 1 ELSE 0 END), 0)",
            "in_work": f"COALESCE(SUM(CASE WHEN {live} THEN 1 ELSE 0 END), 0)",
            "blocked": (f"COALESCE(SUM(CASE WHEN {free} AND {due} AND NOT ({head}) "
                        "THEN 1 ELSE 0 END), 0)"),
            "lapsed": (f"COALESCE(SUM(CASE WHEN r.{f['locked_until']} < {self.now} "
                       "THEN 1 ELSE 0 END), 0)"),
            "oldest_ready_age": oldest_ready,
            "lease_left": f"-({self.age(soonest_end)})",
            "blocked_groups": blocked_groups,
        }
        # labels quoted: "delayed" is a reserved word in MySQL
        return text("SELECT " + ", ".join(f"{sql} AS {self.quote(name)}"
                                          for name, sql in figures.items())
                    + f" FROM {f['table']} AS r WHERE {unfinished}")

    def stored_columns(self, spec: TableSpec) -> str:
        """A stored message's columns as operations read it: id, payload, headers (NULL
        where the table keeps its envelope in the payload), attempt."""
        f = self.fields(spec)
        headers = f"r.{f['headers']}" if spec.has(Role.HEADERS) else "NULL"
        return (f"r.{f['id']} AS id, r.{f['payload']} AS payload, {headers} AS headers, "
                f"r.{f['attempt']} AS attempt")

    def stored_page(self, spec: TableSpec) -> TextClause:
        """Up to ``:limit`` stored messages not in work, by id, after ``:after`` and up to
        ``:upto``."""
        row_id = f"r.{self.fields(spec)['id']}"
        return text(self._stored(spec, f"{row_id} > :after AND {row_id} <= :upto",
                                 "LIMIT :limit"))

    def stored_locked(self, spec: TableSpec) -> TextClause:
        """The stored messages ``:ids`` still not in work, by id, locked for a move
        (skipping rows another move holds): exactly the rows a page showed, whatever
        committed between them meanwhile."""
        return _expanding(self._stored(spec, f"r.{self.fields(spec)['id']} IN :ids",
                                       self.lock_clause))

    def _stored(self, spec: TableSpec, where: str, tail: str) -> str:
        """The stored messages ``where`` picks that are not in work (nor processed), by
        id, then ``tail``."""
        f = self.fields(spec)
        unfinished = (f" AND r.{f['processed_at']} IS NULL" if spec.has(Role.PROCESSED_AT)
                      else "")
        return (f"SELECT {self.stored_columns(spec)} FROM {f['table']} AS r WHERE {where} "
                f"AND (r.{f['locked_until']} IS NULL OR r.{f['locked_until']} < {self.now})"
                f"{unfinished} ORDER BY r.{f['id']} {tail}")

    def stored_one(self, spec: TableSpec) -> TextClause:
        """The stored message with id ``:id``, whatever its state."""
        f = self.fields(spec)
        return text(f"SELECT {self.stored_columns(spec)} FROM {f['table']} AS r "
                    f"WHERE r.{f['id']} = :id")

    def last_id(self, spec: TableSpec) -> TextClause:
        f = self.fields(spec)
        return text(f"SELECT MAX({f['id']}) FROM {f['table']}")

    def remove(self, spec: TableSpec) -> TextClause:
        """Delete the rows ``:ids`` (a move's first half)."""
        f = self.fields(spec)
        return _expanding(f"DELETE FROM {f['table']} WHERE {f['id']} IN :ids")

    def restore(self, spec: TableSpec) -> TextClause | None:
        """The default publish statement with the attempt count bound too (``:attempt``):
        a dead letter put back keeps its deliveries, or starts again from 0. None for a
        declared publish statement: a requeue runs it as a publish does."""
        if spec.publish is not None:
            return None
        return text(self._insert(spec, self._publish_values(spec) + self._attempt(spec)))

    def restore_row(self, spec: TableSpec, columns: Sequence[str]) -> TextClause:
        """The insert of a row as other code wrote it: ``columns`` (bound as ``:c0``,
        ``:c1``...) and the attempt count (``:attempt``)."""
        pairs = [(self.quote(name), f":c{at}") for at, name in enumerate(columns)]
        return text(self._insert(spec, pairs + self._attempt(spec)))

    def _attempt(self, spec: TableSpec) -> list[tuple[str, str]]:
        return [(self.quote(spec.name_of(Role.ATTEMPT)), ":attempt")] if spec.has(
            Role.ATTEMPT) else []

    # -- wake-ups and advisory locks (databases that declare them override) ----
    def channel(self, spec: TableSpec) -> str:
        raise NotImplementedError

    def wake(self, conn: Connection, spec: TableSpec) -> None:
        """Wake the table's idle consumers in other processes when ``conn`` commits."""

    def listen(self, dbapi_connection: Any, channels: Iterable[str]) -> None:
        raise NotImplementedError

    def keeps_notifications(self, dbapi_connection: Any) -> bool:
        """Whether notifications that arrive on a LISTEN connection while it runs a
        statement are still there for :meth:`take_notifications` (else the connection
        must only wait)."""
        return False

    def signal_directory(self) -> str | None:
        """Where processes of this database on one host meet for wake-ups without the
        server (a directory; None: the database has no such place, or the one it has is
        unusable, which :func:`no_wakeups` says)."""
        return None

    def take_notifications(self, dbapi_connection: Any) -> bool:
        raise NotImplementedError

    def try_key_locks(self, conn: Connection, space: int, keys: Sequence[str]) -> list[bool]:
        """Try a session-level lock per key without waiting; True where taken."""
        raise NotImplementedError

    def release_key_locks(self, conn: Connection, space: int, keys: Sequence[str]) -> None:
        raise NotImplementedError

    # -- errors ------------------------------------------------------------
    def is_transient(self, exc: BaseException) -> bool:
        """A deadlock, serialization failure or busy database: retry the same work."""
        return False

    def is_unique_violation(self, exc: BaseException) -> bool:
        """A unique (or primary) key refused a row: the same work was done before. Other
        constraints (NOT NULL, foreign key, CHECK) are ordinary errors, not duplicates."""
        return False

    def check_message_size(self, queue: str, size: int) -> None:
        limit = self.max_statement_bytes
        if limit is not None and size > limit - 1024:
            raise MessageTooLarge(
                f"queue {queue!r}: a message of {size} bytes exceeds the server's "
                f"max_allowed_packet ({limit} bytes); raise it "
                "(SET GLOBAL max_allowed_packet = ...) or send smaller messages"
            )

    def driver_error_code(self, exc: BaseException) -> Any:
        orig = exc.orig if isinstance(exc, DBAPIError) else None
        if orig is None:
            return None
        code = getattr(orig, "pgcode", None) or getattr(orig, "sqlstate", None)
        return code or (orig.args[0] if orig.args else None)

    # -- routing: bindings, the queue registry, transient queues -------------------
    # Remote control and events need what kombu's virtual channel keeps in one process:
    # which queue is bound to which exchange. Three tables under the table prefix hold it
    # (:class:`RoutingStatements`); every value is bound, every time is epoch seconds.
    #: column types of the routing tables: a name, seconds, a message body
    name_type: ClassVar[str] = "TEXT"
    seconds_type: ClassVar[str] = "DOUBLE PRECISION"
    body_type: ClassVar[str] = "BLOB"
    #: the type of a topic binding's pattern: the regular expression kombu makes of a
    #: binding key is longer than the key (each character may be escaped)
    pattern_type: ClassVar[str] = "TEXT"
    #: how the transient messages' table is created (PostgreSQL: without WAL)
    transient_table_kind: ClassVar[str] = "TABLE"
    #: a bound number of seconds, typed where the database must be told
    seconds_param: ClassVar[str] = ":{}"

    def epoch(self, moment: str) -> str:
        """SQL: a time as :attr:`now` gives it, in epoch seconds (a DOUBLE)."""
        raise NotImplementedError

    def routing_problems(self, conn: Connection,
                         names: Sequence[str]) -> list[tuple[str, str]]:
        """What in the existing routing tables ``names`` keeps them from working as these
        statements expect, by table (the text types here compare names exactly)."""
        return []

    def name_text(self, column: str) -> str:
        """SQL: a name column of the routing tables (:attr:`name_type`) read as text."""
        return column

    #: how a name is bound where :attr:`name_type` needs more than the driver's string
    #: (``None``: as it is)
    name_bind: ClassVar[sqltypes.TypeEngine[Any] | None] = None

    def named(self, statement: TextClause, ids: bool = True) -> TextClause:
        """``statement`` with the parameters that carry a name (``:ids`` too, unless
        ``ids`` is false: they are then message ids) bound as :attr:`name_bind`."""
        if self.name_bind is None:
            return statement
        names = (*ROUTING_NAMES, *(("ids",) if ids else ()))
        return statement.bindparams(*(
            bindparam(name, type_=self.name_bind, expanding=name == "ids")
            for name in names if re.search(rf":{name}\b", statement.text)))

    def matches(self, value: str, pattern: str) -> str:
        """SQL: ``value`` matches the regular expression ``pattern`` (a topic binding)."""
        return f"{value} REGEXP {pattern}"

    def upsert(self, table: str, keys: Sequence[str], values: Sequence[str]) -> str:
        """INSERT of ``keys + values`` from same-named parameters; on a key conflict
        the values are updated (none: the row is left alone)."""
        columns = [*keys, *values]
        updates = ", ".join(f"{c} = excluded.{c}" for c in values)
        action = f"DO UPDATE SET {updates}" if values else "DO NOTHING"
        return (f"INSERT INTO {table} ({', '.join(columns)}) "
                f"VALUES ({', '.join(':' + c for c in columns)}) "
                f"ON CONFLICT ({', '.join(keys)}) {action}")

    def delete_some(self, table: str, condition: str) -> str:
        """DELETE of at most ``:limit`` rows of ``table`` meeting ``condition``."""
        return (f"DELETE FROM {table} WHERE id IN "
                f"(SELECT id FROM {table} WHERE {condition} LIMIT :limit)")

    def routing_statements(self, prefix: str) -> RoutingStatements:
        cached = self._routing.get(prefix)
        if cached is None:
            cached = self._routing[prefix] = self.build_routing(prefix)
        return cached

    def build_routing(self, prefix: str) -> RoutingStatements:
        names = RoutingStatements.tables(prefix)
        queues, bindings, messages = (self.quote(name) for name in names)
        now = self.epoch(self.now)
        ttl = self.seconds_param.format("ttl")
        fresh = f"(expires_at IS NULL OR expires_at > {now})"
        # a message's expiry: the sooner of its own TTL and its queue's
        expiry = (f"CASE WHEN {ttl} IS NULL AND q.message_ttl IS NULL THEN NULL "
                  f"WHEN {ttl} IS NULL THEN {now} + q.message_ttl "
                  f"WHEN q.message_ttl IS NULL OR {ttl} < q.message_ttl THEN {now} + {ttl} "
                  f"ELSE {now} + q.message_ttl END")
        matching = (f"b.exchange = :exchange AND (b.type = 'fanout' OR (b.type = 'direct' "
                    f"AND b.routing_key = :routing_key) OR (b.type = 'topic' AND "
                    f"{self.matches(':routing_key', 'b.pattern')}))")
        route = (f"INSERT INTO {messages} (queue, payload, headers, expires_at, priority) "
                 f"SELECT m.queue, :payload, :headers, {expiry}, :priority FROM "
                 f"(SELECT DISTINCT b.queue FROM {bindings} AS b WHERE {matching}) AS m "
                 f"JOIN {queues} AS q ON q.name = m.queue AND q.transient = 1")
        put = (f"INSERT INTO {messages} (queue, payload, headers, expires_at, priority) "
               f"SELECT q.name, :payload, :headers, {expiry}, :priority FROM {queues} AS q "
               f"WHERE q.name = :queue AND q.transient = 1")
        expires = self.seconds_param.format("expires")
        lock = self.lock_clause.replace(" OF r", "")

        def sql(statement: str) -> TextClause:
            return self.clocked(self.named(_expanding(statement)))

        declare = self.upsert(queues, ["name"], ["transient", "expires", "message_ttl",
                                                 "expires_at"])
        name = self.name_text("name")
        bound = ", ".join(self.name_text(f"b.{column}")
                          for column in ("routing_key", "pattern", "queue", "type"))
        return RoutingStatements(
            names=names,
            ddl=self.routing_ddl(queues, bindings, messages, names),
            drop=[f"DROP TABLE IF EXISTS {table}" for table in (messages, bindings, queues)],
            declare=sql(declare.replace(":expires_at", f"{now} + {expires}")),
            kind=sql(f"SELECT transient FROM {queues} WHERE name = :name"),
            message_ttl=sql(f"SELECT message_ttl FROM {queues} WHERE name = :name"),
            expires=sql(f"SELECT expires FROM {queues} WHERE name = :name"),
            touch=sql(f"UPDATE {queues} SET expires_at = {now} + expires "
                      "WHERE name IN :ids AND expires IS NOT NULL"),
            registered=sql(f"SELECT {name} FROM {queues} WHERE name IN :ids"),
            bind=sql(self.upsert(bindings, ["exchange", "queue", "routing_key"],
                                 ["type", "pattern"])),
            unbind=sql(f"DELETE FROM {bindings} WHERE exchange = :exchange "
                       "AND queue = :queue AND routing_key = :routing_key"),
            unbind_exchange=sql(f"DELETE FROM {bindings} WHERE exchange = :exchange"),
            bound=sql(f"SELECT {bound}, COALESCE(q.transient, 0) FROM {bindings} AS b "
                      f"LEFT JOIN {queues} AS q ON q.name = b.queue "
                      "WHERE b.exchange = :exchange"),
            forget=tuple(sql(statement) for statement in (
                f"DELETE FROM {bindings} WHERE queue IN :ids",
                f"DELETE FROM {messages} WHERE queue IN :ids",
                f"DELETE FROM {queues} WHERE name IN :ids")),
            route=self.clocked(self.named(self.route_statement(route, messages))),
            put=self.clocked(self.named(self.route_statement(put, messages))),
            claim=tuple(self.clocked(self.named(statement, ids=False))
                        for statement in self.transient_claim(messages, fresh)),
            size=sql(f"SELECT COUNT(*) FROM {messages} WHERE queue = :queue AND {fresh}"),
            purge=sql(f"DELETE FROM {messages} WHERE queue = :queue"),
            expired_queues=sql(f"SELECT {name}, transient FROM {queues} "
                               f"WHERE expires_at < {now} ORDER BY expires_at LIMIT :limit {lock}"),
            expired_messages=sql(self.delete_some(messages, f"expires_at < {now}")),
            orphans=sql(self.delete_some(messages, (
                f"NOT EXISTS (SELECT 1 FROM {queues} AS q WHERE q.name = {messages}.queue)"))),
            upgrade=("priority", f"ALTER TABLE {messages} ADD COLUMN {TRANSIENT_PRIORITY}"),
        )

    def route_statement(self, insert: str, messages: str) -> TextClause:
        """A publish into the transient messages' table (waking their consumers where the
        database has wake-ups: :meth:`transient_channel`)."""
        return text(insert)

    def transient_claim(self, messages: str, fresh: str) -> tuple[TextClause, ...]:
        """Take (delete) up to ``:limit`` unexpired messages of ``:queue``, higher priority
        first, then oldest, returning ``id, payload, headers, priority``: one DELETE ...
        RETURNING where the database has it, else a locking SELECT, then a DELETE of its
        ids."""
        pick = (f"SELECT id FROM {messages} WHERE queue = :queue AND {fresh} "
                f"ORDER BY {TRANSIENT_ORDER} LIMIT :limit "
                f"{self.lock_clause.replace(' OF r', '')}")
        return (text(f"DELETE FROM {messages} WHERE id IN ({pick}) "
                     "RETURNING id, payload, headers, priority"),)

    def routing_ddl(self, queues: str, bindings: str, messages: str,
                    names: tuple[str, str, str]) -> list[str]:
        """The routing tables: the queue registry, the bindings, the transient messages."""
        name, seconds = self.name_type, self.seconds_type
        return [
            f"CREATE TABLE IF NOT EXISTS {queues} (name {name} NOT NULL PRIMARY KEY, "
            f"transient SMALLINT NOT NULL, expires {seconds}, message_ttl {seconds}, "
            f"expires_at {seconds})",
            f"CREATE INDEX IF NOT EXISTS {self.quote(names[0] + '_expiry')} "
            f"ON {queues} (expires_at)",
            f"CREATE TABLE IF NOT EXISTS {bindings} (exchange {name} NOT NULL, "
            f"queue {name} NOT NULL, routing_key {name} NOT NULL, type {name} NOT NULL, "
            f"pattern {self.pattern_type} NOT NULL, PRIMARY KEY (exchange, queue, routing_key))",
            f"CREATE INDEX IF NOT EXISTS {self.quote(names[1] + '_queue')} "
            f"ON {bindings} (queue)",
            f"CREATE {self.transient_table_kind} IF NOT EXISTS {messages} "
            f"(id {self.generated_id_type}, queue {name} NOT NULL, "
            f"payload {self.body_type} NOT NULL, headers {self.column_types[Role.HEADERS]}, "
            f"expires_at {seconds}, {TRANSIENT_PRIORITY})",
            f"CREATE INDEX IF NOT EXISTS {self.quote(names[2] + '_claim')} "
            f"ON {messages} (queue, {TRANSIENT_ORDER})",
            f"CREATE INDEX IF NOT EXISTS {self.quote(names[2] + '_expiry')} "
            f"ON {messages} (expires_at)",
        ]

    def transient_channel(self, prefix: str, queue: str) -> str:
        """The wake-up channel of a transient queue (see :meth:`channel`)."""
        return prefix + "t_" + hashlib.md5(queue.encode("utf-8")).hexdigest()[:24]

    # -- outbox (celery_ext.outbox) ------------------------------------------------
    # Every statement of the transactional outbox. Its table arrives as role -> column
    # name (validated by celery_ext.declaration); names are quoted here, values bound.
    #: SQL types of the default outbox layout by role; "id" is the type of an id the
    #: outbox supplies (a UUID), a generated id takes ``generated_id_type``
    outbox_column_types: ClassVar[Mapping[str, str]] = {}
    #: whether the record of a publish outside a caller's transaction is written in
    #: autocommit mode (one round trip instead of BEGIN, INSERT, COMMIT); only where
    #: switching a pooled connection to autocommit costs no round trip of its own
    outbox_autocommit: ClassVar[bool] = False
    #: ``engine_for`` arguments of an engine the outbox makes from a URL
    outbox_engine_options: ClassVar[Mapping[str, Any]] = {}

    def outbox_fields(
        self, table: str, schema: str | None, columns: dict[str, str],
    ) -> dict[str, str]:
        """Template values: ``{table}``, ``{now}`` and one quoted name per declared role."""
        ref = self.quote(table) if schema is None else f"{self.quote(schema)}.{self.quote(table)}"
        return {"table": ref, "now": self.now,
                **{role: self.quote(name) for role, name in columns.items()}}

    def outbox_ago(self) -> str:
        """The database's time ``:older_than`` seconds ago, comparable with its time columns."""
        raise NotImplementedError

    def outbox_returning(self, f: dict[str, str]) -> str:
        """What makes an INSERT return the generated record id (empty: read ``lastrowid``)."""
        return f" RETURNING {f['id']}" if self.capabilities.returning else ""

    def outbox_prune_sql(self, f: dict[str, str]) -> str:
        """Delete up to ``:limit`` records processed before ``:older_than`` seconds ago."""
        return (
            f"DELETE FROM {f['table']} WHERE {f['id']} IN (SELECT {f['id']} FROM {f['table']} "
            f"WHERE {f['processed_at']} < {self.outbox_ago()} LIMIT :limit)"
        )

    def outbox_statements(
        self, table: str, schema: str | None, columns: dict[str, str], generated_id: bool,
    ) -> dict[str, TextClause]:
        """Every outbox statement for one table: insert, mark, processed, due, claim, unclaim,
        prune, status, drop."""
        f = self.outbox_fields(table, schema, columns)
        values = [role for role in ("id", "task_id", "task_name", "exchange", "routing_key",
                                    "headers", "properties", "body") if role in columns]
        if generated_id:
            values.remove("id")
        insert = (
            f"INSERT INTO {f['table']} ({', '.join(f[r] for r in values)}, {f['created_at']}) "
            f"VALUES ({', '.join(':' + r for r in values)}, {self.now})"
        )
        if generated_id:
            insert += self.outbox_returning(f)
        unprocessed = f"{f['processed_at']} IS NULL"
        oldest = f"MIN(CASE WHEN {unprocessed} THEN {f['created_at']} END)"
        statements = {
            "insert": text(insert),
            "mark": text(
                f"UPDATE {f['table']} SET {f['processed_at']} = {self.now} "
                f"WHERE {f['id']} = :id AND {unprocessed}"),
            "processed": text(
                f"SELECT CASE WHEN {unprocessed} THEN 0 ELSE 1 END FROM {f['table']} "
                f"WHERE {f['id']} = :id"),
            # republish: the records due (unprocessed, last sent longer than :older_than
            # ago) after the run's last id, locked so that a republisher running at the
            # same moment skips them ...
            "due": text(
                f"SELECT r.{f['id']}, r.{f['exchange']}, r.{f['routing_key']}, "
                f"r.{f['headers']}, r.{f['properties']}, r.{f['body']} FROM {f['table']} AS r "
                f"WHERE r.{unprocessed} AND COALESCE(r.{f['republished_at']}, "
                f"r.{f['created_at']}) <= {self.outbox_ago()} AND r.{f['id']} > :after "
                f"ORDER BY r.{f['id']} LIMIT :limit {self.lock_clause}"),
            # ... and claimed in the same transaction, before they are sent
            "claim": _expanding(
                f"UPDATE {f['table']} SET {f['republished_at']} = {self.now} "
                f"WHERE {f['id']} IN :ids"),
            # claimed records a broker error kept from being sent: due again at once
            "unclaim": _expanding(
                f"UPDATE {f['table']} SET {f['republished_at']} = NULL WHERE {f['id']} IN :ids"),
            "prune": text(self.outbox_prune_sql(f)),
            "status": text(
                f"SELECT COALESCE(SUM(CASE WHEN {unprocessed} THEN 1 ELSE 0 END), 0), "
                f"COALESCE(SUM(CASE WHEN {unprocessed} THEN 0 ELSE 1 END), 0), "
                f"{self.age(oldest)} FROM {f['table']}"),
            "drop": text(f"DROP TABLE IF EXISTS {f['table']}"),
        }
        return {name: self.clocked(statement) for name, statement in statements.items()}

    def outbox_insert(self, conn: Connection, statement: TextClause,
                      params: Mapping[str, Any]) -> Any:
        """Write one record and return the id the database generated for it (from RETURNING,
        or the cursor's ``lastrowid`` where the INSERT returns nothing)."""
        result = conn.execute(statement, dict(params))
        return result.scalar_one() if self.capabilities.returning else result.lastrowid

    def outbox_insert_autocommit(self, engine: Engine, sql: str,
                                 params: Mapping[str, Any]) -> Any:
        """Write one record alone in autocommit mode (``sql``: the INSERT compiled for the
        driver): one round trip instead of BEGIN, INSERT and COMMIT. Only where
        :attr:`outbox_autocommit` says the drivers switch autocommit without a round trip
        of their own. Returns the generated id, None where the outbox supplied it."""
        with engine.connect() as conn:
            dbapi = conn.connection.dbapi_connection
            assert dbapi is not None
            dbapi.autocommit = True
            try:
                result = conn.exec_driver_sql(sql, dict(params))
                return result.scalar_one() if result.returns_rows else None
            finally:
                if not conn.invalidated:
                    dbapi.autocommit = False

    def outbox_reads_first(self, conn: Connection) -> Connection:
        """``conn`` set up for a transaction that reads before it may write (the table
        check): where beginning can take the write lock, it does not."""
        return conn

    def outbox_locks_first(self, conn: Connection) -> Connection:
        """``conn`` set up for a transaction that must hold the write lock before it reads
        (the republish claim): where that is a choice, two such transactions take turns
        instead of both reading."""
        return conn

    def outbox_lock_wait(self, conn: Connection, seconds: float
                         ) -> AbstractContextManager[None]:
        """Around a transaction of ``conn`` (begun inside): how long it waits for the write
        lock, where the database has a single writer that the caller's own transaction may
        hold; unchanged elsewhere."""
        return nullcontext()

    def outbox_lock_timed_out(self, exc: BaseException) -> bool:
        """Whether ``exc`` ended a wait for the single writer's lock
        (:meth:`outbox_lock_wait`)."""
        return False

    def outbox_index_name(self, table: str) -> str:
        digest = hashlib.sha1(table.encode()).hexdigest()[:10]
        return self.quote(f"{table[:40]}_{digest}_outbox")

    def outbox_column_ddl(self, role: str, name: str, generated_id: bool) -> str:
        if role == "id":
            kind = self.generated_id_type if generated_id else (
                self.outbox_column_types["id"] + " PRIMARY KEY")
            return f"{self.quote(name)} {kind}"
        return f"{self.quote(name)} {self.outbox_column_types[role]}"

    def outbox_add_column_ddl(self, table: str, schema: str | None, role: str, name: str,
                              generated_id: bool) -> str:
        """ALTER TABLE adding a missing outbox column (shown to the user, not run)."""
        ref = self.outbox_fields(table, schema, {})["table"]
        return f"ALTER TABLE {ref} ADD COLUMN {self.outbox_column_ddl(role, name, generated_id)}"

    def outbox_create_ddl(
        self, table: str, schema: str | None, columns: dict[str, str], generated_id: bool,
    ) -> list[str]:
        """CREATE TABLE for the outbox, and its index on (processed_at, id), which serves the
        republish scan (unprocessed, by id) and pruning (processed before a moment)."""
        f = self.outbox_fields(table, schema, columns)
        body = ",\n    ".join(
            self.outbox_column_ddl(role, name, generated_id) for role, name in columns.items())
        return [
            f"CREATE TABLE IF NOT EXISTS {f['table']} (\n    {body}\n)",
            f"CREATE INDEX IF NOT EXISTS {self.outbox_index_name(table)} ON {f['table']} "
            f"({f['processed_at']}, {f['id']})",
        ]

