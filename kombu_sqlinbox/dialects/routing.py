"""Routing: bindings, the queue registry, transient queues.

Remote control and events need what kombu's virtual channel keeps in one process: which
queue is bound to which exchange. Three tables under the table prefix hold it
(:class:`RoutingStatements`); every value is bound, every time is epoch seconds.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from sqlalchemy import Connection, TextClause, bindparam, text
from sqlalchemy import types as sqltypes
from sqlalchemy.engine import Engine

from ..roles import check_identifier
from ..tables import ROUTING_TABLES, Role
from .core import DialectCore
from .driver import _expanding


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
    #: the claim on a connection in autocommit, each statement committed as it runs,
    #: where the server's DELETE returns rows: a plain read of the first ids (committed
    #: rows: it waits for no lock, not even a caller's uncommitted publish, which a
    #: DELETE of the queue's first rows would), then their DELETE by id, returning the
    #: rows this claim took (a claim racing it may take some first); None: :attr:`claim`
    claim_alone: tuple[TextClause, TextClause] | None
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
#: the parameters of the routing statements that carry a name (``:ids`` may too)
ROUTING_NAMES = ("name", "exchange", "queue", "routing_key", "type", "pattern")


class RoutingFamily(DialectCore):
    """The routing tables' statements, built once per table prefix."""

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

    def __init__(self, engine: Engine | None = None) -> None:
        super().__init__(engine)
        self._routing: dict[str, RoutingStatements] = {}

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

    def upsert(self, table: str, keys: Sequence[str], values: Sequence[str],
               added: Sequence[str] = ()) -> str:
        """INSERT of ``keys + values + added`` from same-named parameters; on a key
        conflict the values are updated and the ``added`` counts added to the row's
        (none: the row is left alone)."""
        columns = [*keys, *values, *added]
        updates = ", ".join([*(f"{c} = excluded.{c}" for c in values),
                             *(f"{c} = {table}.{c} + excluded.{c}" for c in added)])
        action = f"DO UPDATE SET {updates}" if updates else "DO NOTHING"
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
        alone = self.transient_claim_alone(messages, fresh)
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
            claim_alone=None if alone is None else (
                self.clocked(self.named(alone[0], ids=False)), self.named(alone[1], ids=False)),
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

    def transient_claim_alone(self, messages: str,
                              fresh: str) -> tuple[TextClause, TextClause] | None:
        """:attr:`RoutingStatements.claim_alone`, when the server's DELETE returns rows
        (SQLAlchemy's ``delete_returning``, known from the first connection)."""
        return None

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
