"""The claim's row selection uses the claim index on a big queue (PostgreSQL, MariaDB/MySQL)."""

from __future__ import annotations

import pytest
from sqlalchemy import Connection, text

from .conftest import Connect
from .support import broker_of, quoted

READY_ROWS = 200_000
#: ten digits; five cross joins of them give 100,000 rows, six a million
DIGITS = " UNION ALL ".join(f"SELECT {d} AS d" for d in range(10))


def bulk_insert_sql(database: str, table: str, queues: bool = False) -> str:
    """One INSERT ... SELECT of READY_ROWS ready rows (no row-by-row round trips); with
    ``queues``, transient messages spread over 1,000 queues."""
    column = "queue, " if queues else ""
    if database == "postgresql":
        queue = "'q' || (n % 1000), " if queues else ""
        return (f"INSERT INTO {table} ({column}payload, headers) "
                f"SELECT {queue}'x'::bytea, '{{}}' FROM generate_series(1, {READY_ROWS}) AS n")
    queue = "CONCAT('q', d0.d, d1.d, d2.d), " if queues else ""
    joins = ", ".join(f"({DIGITS}) AS d{n}" for n in range(6))
    return (f"INSERT INTO {table} ({column}payload, headers) "
            f"SELECT {queue}'x', '{{}}' FROM {joins} LIMIT {READY_ROWS}")


def plan_lines(conn: Connection, database: str, statement: object) -> list[str]:
    result = conn.execute(statement, {"limit": 10})  # type: ignore[call-overload]
    if database == "postgresql":
        return [str(row[0]) for row in result]
    return [" | ".join(f"{key}={value}" for key, value in row._mapping.items())
            for row in result]


@pytest.mark.parametrize("database", ["postgresql", "mysql"], indirect=True)
def test_claim_selection_uses_the_claim_index(connect: Connect, database: str) -> None:
    conn = connect()
    conn.default_channel.queue_declare("jobs")
    broker = broker_of(conn)
    spec = broker.table("jobs").spec
    index = broker.dialect.index_name(spec).strip('"`')
    with broker.engine.begin() as db:
        table = quoted(broker.engine, spec.table)
        db.execute(text(bulk_insert_sql(database, table)))
    with broker.engine.begin() as db:
        analyze = "ANALYZE" if database == "postgresql" else "ANALYZE TABLE"
        db.execute(text(f"{analyze} {table}"))
        assert db.execute(text(f"SELECT COUNT(*) FROM {table}")).scalar_one() == READY_ROWS
        plan = plan_lines(db, database, broker.dialect.explain(spec))
    shown = "\n".join(plan)
    assert index in shown, shown
    if database == "postgresql":
        assert "Seq Scan" not in shown, shown
        assert "Sort" not in shown, shown
    else:
        (row,) = plan
        assert "type=ALL" not in row, row
        assert f"key={index}" in row, row
        assert "filesort" not in row, row


@pytest.mark.parametrize("database", ["postgresql", "mysql"], indirect=True)
def test_transient_claim_uses_its_queue_index(connect: Connect, database: str) -> None:
    conn = connect()
    conn.default_channel.queue_declare("reply", durable=False, auto_delete=True)
    routes = broker_of(conn).routes
    table = quoted(routes.database.engine, routes.sql.names[2])
    index = routes.sql.names[2] + "_claim"
    with routes.database.engine.begin() as db:
        db.execute(text(bulk_insert_sql(database, table, queues=True)))
    with routes.database.engine.begin() as db:
        db.execute(text(f"{'ANALYZE' if database == 'postgresql' else 'ANALYZE TABLE'} {table}"))
        claim = routes.sql.claim[0]
        result = db.execute(text(f"EXPLAIN {claim.text}"), {"queue": "q7", "limit": 10})
        if database == "postgresql":
            shown = "\n".join(str(row[0]) for row in result)
            assert index in shown and "Seq Scan" not in shown, shown
        else:
            rows = [dict(row._mapping) for row in result]
            assert rows[0]["key"] == index and rows[0]["type"] != "ALL", rows
