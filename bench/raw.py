"""The transport's own SQL run straight through psycopg2 / pymysql / sqlite3.

The statements come from the dialect (``kombu_sqlinbox.dialects``), so the loop
runs exactly what the transport runs, minus kombu and SQLAlchemy: the ceiling
a transport of one commit per message could reach.
"""

from __future__ import annotations

import json
import re
import sqlite3
import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from sqlalchemy import TextClause, create_engine
from sqlalchemy.engine import make_url

from kombu_sqlinbox.dialects import Dialect, MySQLDialect, SQLiteDialect, Statements, dialect_for
from kombu_sqlinbox.dialects.base import CANDIDATES, FLOOR_MARGIN
from kombu_sqlinbox.tables import default_table, table_name_for_queue

from .registry import Cell, scenario
from .targets import Context, Target

BIND = re.compile(r"(?<![:\w]):(\w+)")
LEASE = 30.0
#: a payload and header envelope of the size kombu stores for the kombu-level messages
PAYLOAD = json.dumps({"i": 0, "sent": 0.0, "args": [0, "bench"], "kwargs": {"note": "x" * 48}})
HEADERS = json.dumps({
    "headers": {}, "content-type": "application/json", "content-encoding": "utf-8",
    "properties": {"body_encoding": None, "delivery_mode": 2, "priority": 0,
                   "routing": {"exchange": "bench", "routing_key": "bench"}},
})


class RawQueue:
    """One queue table driven through a bare DBAPI connection, in the transport's session setup."""

    def __init__(self, target: Target, table: str) -> None:
        url = make_url(target.url)
        engine = create_engine(url)
        self.dialect: Dialect = dialect_for(engine)
        engine.dispose()
        self.spec = default_table(table)
        self.statements: Statements = self.dialect.statements(self.spec)
        self.backend = url.get_backend_name()
        self.conn = self._connect(url)
        self._sql: dict[tuple[str, int], tuple[str, dict[str, Any]]] = {}
        cursor = self.conn.cursor()
        self.begin(cursor)
        for ddl in self.dialect.create_ddl(self.spec):
            cursor.execute(ddl)
        self.conn.commit()

    def _connect(self, url: Any) -> Any:
        conn: Any
        if self.backend == "postgresql":
            import psycopg2

            conn = psycopg2.connect(host=url.host, port=url.port or 5432, user=url.username,
                                    password=url.password or "", dbname=url.database)
        elif self.backend in ("mysql", "mariadb"):
            import pymysql

            conn = pymysql.connect(host=url.host, port=url.port or 3306, user=url.username,
                                   password=url.password or "", database=url.database)
            conn.cursor().execute("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
        else:
            conn = sqlite3.connect(url.database, isolation_level=None)
        if isinstance(self.dialect, (MySQLDialect, SQLiteDialect)):
            # the transport's session setup: UTC on MySQL; WAL and busy timeout on SQLite
            self.dialect.on_connect(conn)
        return conn

    def begin(self, cursor: Any) -> None:
        if self.backend == "sqlite":
            cursor.execute("BEGIN IMMEDIATE")

    def sql(self, statement: TextClause, ids: int = 0) -> tuple[str, dict[str, Any]]:
        """The dialect's statement in the driver's bind style, ``IN :ids`` spread over ``ids``,
        and the values the dialect bound into it (such as a NOTIFY channel)."""
        key = (statement.text, ids)
        found = self._sql.get(key)
        if found is None:
            text = statement.text
            if ids:
                text = text.replace(":ids", "(" + ", ".join(f":ids{n}" for n in range(ids)) + ")")
            if self.backend != "sqlite":
                text = BIND.sub(r"%(\1)s", text.replace("%", "%%"))
            bound = {k: v for k, v in statement.compile().params.items() if v is not None}
            found = self._sql[key] = (text, bound)
        return found

    def execute(self, cursor: Any, statement: TextClause, params: dict[str, Any],
                ids: Sequence[int] = ()) -> None:
        sql, bound = self.sql(statement, len(ids))
        cursor.execute(sql, {**bound, **params, **{f"ids{n}": v for n, v in enumerate(ids)}})

    def publish(self, count: int, per_commit: int) -> float:
        """``count`` rows, ``per_commit`` per transaction. On SQLite, whose connection is
        in autocommit mode, one row per commit is a lone INSERT (a transaction of its
        own, as durable as BEGIN, INSERT, COMMIT), as the transport sends it."""
        cursor = self.conn.cursor()
        sql, bound = self.sql(self.statements.insert)
        params = {**bound, **self.dialect.insert_params(PAYLOAD.encode(), HEADERS, 0, None)}
        lone = per_commit == 1 and self.backend == "sqlite"
        started = time.perf_counter()
        for _ in range(0, count, per_commit):
            if lone:
                cursor.execute(sql, params)
                continue
            self.begin(cursor)
            for _ in range(per_commit):
                cursor.execute(sql, params)
            self.conn.commit()
        return time.perf_counter() - started

    def publish_bulk(self, count: int) -> float:
        """``count`` rows in one multi-row INSERT and one commit: the ceiling of a bulk
        publish (on PostgreSQL with the one NOTIFY the transport sends with it)."""
        sql, params = self.bulk_sql(count)
        cursor = self.conn.cursor()
        started = time.perf_counter()
        self.begin(cursor)
        cursor.execute(sql, params)
        self.conn.commit()
        return time.perf_counter() - started

    def bulk_sql(self, count: int) -> tuple[str, dict[str, Any]]:
        """The dialect's insert with its VALUES list repeated ``count`` times, each row's
        parameters suffixed with its position."""
        insert = self.dialect.insert_sql(self.spec)
        head, _, values = insert.partition(" VALUES ")
        names = BIND.findall(values)
        rows = ", ".join(BIND.sub(rf":\1_{n}", values) for n in range(count))
        sql = f"{head} VALUES {rows}"
        params: dict[str, Any] = {}
        if self.backend == "postgresql" and self.dialect.notify:
            params["channel"] = self.dialect.channel(self.spec)
            sql = (f"WITH published AS ({sql} RETURNING 1) SELECT pg_notify(:channel, '') "
                   "WHERE EXISTS (SELECT 1 FROM published)")
        one = self.dialect.insert_params(PAYLOAD.encode(), HEADERS, 0, None)
        for n in range(count):
            params.update({f"{name}_{n}": one[name] for name in names})
        if self.backend != "sqlite":
            sql = BIND.sub(r"%(\1)s", sql.replace("%", "%%"))
        return sql, params

    def consume(self, count: int, batch: int) -> tuple[int, float]:
        """Claim ``batch`` rows, delete them by fencing token, commit; until the table is empty."""
        cursor = self.conn.cursor()
        taken = 0
        started = time.perf_counter()
        floor = self.floor(cursor)
        while taken < count:
            self.begin(cursor)
            rows = self.claim(cursor, batch, floor)
            tokens: dict[int, list[int]] = defaultdict(list)
            for row in rows:
                tokens[row[1]].append(row[0])
            for attempt, ids in tokens.items():
                self.execute(cursor, self.statements.delete, {"attempt": attempt}, ids)
            self.conn.commit()
            if not rows:
                break
            taken += len(rows)
        return taken, time.perf_counter() - started

    def floor(self, cursor: Any) -> dict[str, float]:
        """The claim floor's parameter where claims take one (``Dialect.claim_floor``),
        read once per :meth:`consume`: rows only leave the table while it runs, so the
        oldest ready time does not go down."""
        if self.statements.floor is None:
            return {}
        self.execute(cursor, self.statements.floor, {})
        (oldest,) = cursor.fetchone()
        return {"floor": float(oldest) - FLOOR_MARGIN}

    def claim(self, cursor: Any, limit: int, floor: dict[str, float]) -> list[tuple[int, int]]:
        """(id, attempt) of the claimed rows, as ``Dialect.claim`` does it for this database
        (``floor``: from :meth:`floor`)."""
        first, *lease = self.statements.claim
        self.execute(cursor, first, {"limit": limit, "lease": LEASE,
                                     "candidates": limit * CANDIDATES, **floor})
        rows = [(row[0], row[1]) for row in cursor.fetchall()]
        if lease and rows:  # MySQL: SELECT ... FOR UPDATE SKIP LOCKED, then lease those ids
            self.execute(cursor, lease[0], {"lease": LEASE}, [row[0] for row in rows])
            rows = [(row_id, attempt + 1) for row_id, attempt in rows]
        return rows

    def close(self) -> None:
        cursor = self.conn.cursor()
        self.begin(cursor)
        self.execute(cursor, self.statements.drop, {})
        self.conn.commit()
        self.conn.close()


@scenario("raw", {"publish": "publish msg/s", "consume_10": "consume pf10",
                  "consume_100": "consume pf100"}, {"raw"}, rank=20)
def raw(target: Target, ctx: Context) -> dict[str, Cell]:
    """publish: one row per commit; consume_10: one row per commit; consume_100: 100 per commit."""
    table = RawQueue(target, table_name_for_queue(ctx.queue_name("raw"), ctx.prefix))
    try:
        published = ctx.sizes.publish
        cells = {"publish": Cell.rate(published, table.publish(published, 1), per_commit=1)}
        table.consume(published, 100)
        for column, batch in (("consume_10", 1), ("consume_100", 100)):
            count = ctx.sizes.consume
            table.publish(count, 100)
            taken, seconds = table.consume(count, batch)
            cells[column] = Cell.rate(taken, seconds, per_commit=batch)
            cells[column].text += f" ({batch}/commit)"
        return cells
    finally:
        table.close()
