"""The driver beneath every statement: the statements a consumer runs per claim as the
driver's own SQL (prepared where the server would plan each text anew), engines and
sessions, the values a driver hands back, and the error codes it raises."""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from sqlalchemy import Connection, TextClause, bindparam, event, text
from sqlalchemy.engine import CursorResult, Engine
from sqlalchemy.exc import DBAPIError
from sqlalchemy.types import NullType

from ..clock import PARAMETER, Clock
from ..errors import MessageTooLarge
from .core import DialectCore

#: a named parameter in a statement's text (``:name``; not a ``::`` cast)
NAMED_PARAMETER = re.compile(r"(?<![:\w]):(\w+)")
#: parameter styles a statement can be rewritten into for the driver's own cursor
POSITIONAL_MARKERS = {"qmark": "?", "format": "%s", "pyformat": "%s"}


def _driver_style(sql: str, paramstyle: str,
                  marker: str | None = None) -> tuple[str, tuple[str, ...]]:
    """``sql`` with its ``:name`` parameters as the driver's positional markers (or
    ``marker``, of the same style), and their names in order."""
    marker = marker or POSITIONAL_MARKERS[paramstyle]
    if marker.startswith("%"):
        sql = sql.replace("%", "%%")
    return NAMED_PARAMETER.sub(marker, sql), tuple(NAMED_PARAMETER.findall(sql))


#: the list parameters of statements: each renders as a parenthesized list of its values
EXPANDING = ("ids", "skip")


def _expanding(sql: str) -> TextClause:
    """The statement with its list parameters (``:ids``, ``:skip``) bound as expanding."""
    return text(sql).bindparams(*(bindparam(name, expanding=True) for name in EXPANDING
                                  if f":{name}" in sql))


#: a list parameter after ``IN`` or ``NOT IN`` (see :meth:`DriverSql.prepared`)
LIST_MEMBERSHIP = re.compile(rf"\b(NOT )?IN :({'|'.join(EXPANDING)})\b")
#: where a session's info says it runs statements prepared (:meth:`Dialect.prepare_session`):
#: the names of those it prepared
PREPARED = "sqlinbox_prepared"
#: where a session's info says when it last had its prepared statements planned anew
#: (monotonic seconds; :meth:`DriverFamily.execute`)
PLANS_MADE = "sqlinbox_plans_made"
#: seconds a session runs its prepared statements on the plans it cached: a plan made
#: while a queue's table was empty is made again at most this long after it filled
PLAN_REFRESH = 30.0


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


def plain_payload(payload: Any) -> bytes | str:
    """psycopg2 hands BYTEA over as a memoryview, which a prefork pool cannot pickle."""
    return bytes(payload) if isinstance(payload, memoryview) else payload  # type: ignore[no-any-return]


def json_text(headers: Any) -> str | None:
    """A JSON/JSONB headers column comes back from some drivers (psycopg) already parsed:
    hand on its text, as from a text column. Anything else (SQLite's dynamic typing lets
    a BLOB into any column) goes on as it is, for the decoder to read or park."""
    return json.dumps(headers) if isinstance(headers, (dict, list)) else headers


class DriverFamily(DialectCore):
    """Running statements through the driver; its engines, sessions and errors."""

    #: run first in a transaction whose commit need not wait for the disk: fenced work
    #: (claims, settlements, sweeps) and the publishes of a queue that allows it. It sets
    #: whatever else the transport's own statements need there (PostgreSQL: the
    #: planner's settings under which they read their indexes, whatever the tables'
    #: statistics say)
    relaxed_commit: ClassVar[str | None] = None
    #: the same for a whole session of the transport's own (the LISTEN connection's and
    #: the lease keeper's, which run only fenced work)
    relaxed_session: ClassVar[str | None] = None
    #: where a driver connection switches to autocommit without a round trip
    #: (:attr:`autocommit_switch`): one round trip that begins a transaction and runs
    #: :attr:`relaxed_commit` in it, which a driver beginning on its own sends as two
    relaxed_begin: ClassVar[str | None] = None
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
    #: what has a session plan its prepared statements anew at their next runs (they
    #: stay prepared), where the server caches their plans (None: nothing to discard)
    discard_plans: ClassVar[str | None] = None
    #: drivers that prepare statements themselves, on any connection (not only on a
    #: session of :meth:`prepare_session`'s)
    preparing_drivers: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, engine: Engine | None = None) -> None:
        super().__init__(engine)
        #: statements as the driver's SQL (:meth:`execute`), by paramstyle and list lengths
        self._driver_sql: dict[tuple[TextClause, str, tuple[int, ...]], DriverSql] = {}
        #: seconds between a session's :attr:`discard_plans`
        self.plan_refresh = PLAN_REFRESH

    def execute(self, conn: Connection, statement: TextClause,
                params: Mapping[str, Any]) -> CursorResult[Any]:
        """Run one of the statements a consumer runs per claim (the claim, settlements,
        lease extensions) as the driver's own SQL: SQLAlchemy's compiling and parameter
        processing of a ``text()`` cost several times the driver's work, once per claim
        and per ack. Errors, connection invalidation and events stay SQLAlchemy's. List
        parameters are never empty here; a driver with named parameters takes the usual
        path, and so does a statement binding a parameter of a declared type (a name as
        MySQL's UTF-8 bytes), whose processing is SQLAlchemy's. A session running
        prepared statements has them planned anew every :attr:`plan_refresh` seconds
        (:attr:`discard_plans`)."""
        paramstyle = conn.dialect.paramstyle
        typed = any(not isinstance(bound.type, NullType)
                    for bound in statement._bindparams.values())
        if paramstyle not in POSITIONAL_MARKERS or typed:
            return conn.execute(statement, dict(params))
        info = conn.info
        prepared: set[str] | None = info.get(PREPARED)
        if self.discard_plans is not None and (
                prepared is not None or conn.dialect.driver in self.preparing_drivers):
            self._refresh_plans(conn, info)
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

    def _refresh_plans(self, conn: Connection, info: dict[Any, Any]) -> None:
        """Discard the session's cached plans once :attr:`plan_refresh` seconds passed
        since it last did (or since it was first seen here, with none to discard yet)."""
        now = time.monotonic()
        if now - info.setdefault(PLANS_MADE, now) >= self.plan_refresh:
            conn.exec_driver_sql(str(self.discard_plans))
            info[PLANS_MADE] = now

    def prepare_session(self, conn: Connection) -> None:
        """Run :meth:`execute`'s statements on ``conn`` as prepared statements from now
        on, where the database plans a statement each time it comes as text and a
        prepared one once: a consumer's claim is planned on every round otherwise. Only
        for a session of its own (the LISTEN connection): a prepared statement lives
        in its session, which a pooler sharing server sessions would not keep."""

    def prepare_engine(self, engine: Engine, sqlite_begin: str = "IMMEDIATE") -> None:
        """Set up an engine of ours (the transport's, the outbox's): per-connection settings
        and, where the database needs it, how transactions begin."""
        event.listen(engine, "connect", lambda dbapi, record: self.on_connect(dbapi))

    def on_connect(self, dbapi_connection: Any) -> None:
        """Session settings every new connection gets."""

    def is_transient(self, exc: BaseException) -> bool:
        """A deadlock, serialization failure or busy database: retry the same work."""
        return False

    def is_unique_violation(self, exc: BaseException) -> bool:
        """A unique (or primary) key refused a row: the same work was done before. Other
        constraints (NOT NULL, foreign key, CHECK) are ordinary errors, not duplicates."""
        return False

    def sent_bytes(self, value: bytes | str) -> int:
        """How many bytes of the statement a bound value takes as the driver sends it
        (what :attr:`max_statement_bytes` counts)."""
        return len(value.encode("utf-8") if isinstance(value, str) else value)

    def check_message_size(self, queue: str, payload: bytes | str | None,
                           headers: str | None) -> None:
        """Refuse a message the server would refuse as a statement (by dropping the
        connection, on MySQL) before it is sent, counted as the driver sends it."""
        limit = self.max_statement_bytes
        if limit is None:
            return
        size = self.sent_bytes(payload or b"") + self.sent_bytes(headers or "")
        if size > limit - 1024:
            raise MessageTooLarge(
                f"queue {queue!r}: a message of {size} bytes as sent exceeds the server's "
                f"max_allowed_packet ({limit} bytes); raise it "
                "(SET GLOBAL max_allowed_packet = ...) or send smaller messages"
            )

    def driver_error_code(self, exc: BaseException) -> Any:
        orig = exc.orig if isinstance(exc, DBAPIError) else None
        if orig is None:
            return None
        code = getattr(orig, "pgcode", None) or getattr(orig, "sqlstate", None)
        return code or (orig.args[0] if orig.args else None)
