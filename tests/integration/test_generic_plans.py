"""A statement PostgreSQL planned once for any parameters (a generic plan, which it may
keep after five custom ones) while its queue's table was empty, as when a consumer starts
on a new queue, is planned again once the table has filled: a session running prepared
statements discards its cached plans every ``plan_refresh`` seconds. Kept, the plan of a
FIFO claim reads the whole backlog until an ANALYZE or VACUUM of the table (autovacuum
may be off, or late)."""

from __future__ import annotations

import json
import re
from dataclasses import fields
from typing import Any

import psycopg
import pytest
from kombu import Connection, Consumer, Queue
from sqlalchemy import Connection as Session
from sqlalchemy import TextClause, text
from sqlalchemy.engine import make_url

from kombu_sqlinbox import TableBuilder
from kombu_sqlinbox.broker import Broker
from kombu_sqlinbox.dialects.base import DriverSql
from kombu_sqlinbox.dialects.driver import EXPANDING
from kombu_sqlinbox.own_session import OwnSession
from kombu_sqlinbox.tables import TableSpec

from .support import broker_of, quoted, statements_run
from .test_explain import bulk_insert_sql, rows_in

#: a claim's runs on an empty table before it is checked: psycopg 3 prepares a statement
#: at its sixth run, and PostgreSQL may keep a generic plan after five custom ones
RUNS_WHILE_EMPTY = 12
#: rows a plan for the filled table reads at most (one made for the empty table reads
#: every row: 200,000)
FEW_ROWS = 1_000
#: statements of a table the transport runs through SQLAlchemy (the floor's readings, a
#: limited claim's candidates: psycopg2 sends them as text) or that read no queued row
NOT_PREPARED = {"insert", "drop", "purge", "size", "floor", "floor_above", "candidates"}

pytestmark = pytest.mark.parametrize("database", ["postgresql"], indirect=True)


def layout_spec(layout: str, prefix: str) -> TableSpec:
    """Queue "jobs" as a declared FIFO table, or one keeping its processed rows."""
    made = TableBuilder(f"{prefix}jobs").id().payload().headers()
    if layout == "fifo":
        made = made.group("grp", fifo=True)
    made = made.available_at().locked_until().attempt()
    return (made.processed_at() if layout == "processed" else made).build()


def fill(broker: Broker, spec: TableSpec, layout: str) -> None:
    """READY_ROWS ready rows (one FIFO group), with no ANALYZE after."""
    with broker.engine.begin() as db:
        db.execute(text(bulk_insert_sql("postgresql", quoted(broker.engine, spec.table),
                                        group="g0" if layout == "fifo" else None)))


def plan_tree(plan: Any) -> str:
    """An executed JSON plan's nodes, one a line: type, relation, rows x loops."""
    lines: list[str] = []

    def walk(node: dict[str, Any], depth: int) -> None:
        lines.append("  " * depth + " ".join(str(part) for part in (
            node.get("Node Type"), node.get("Relation Name") or "",
            node.get("Parent Relationship") or "",
            f"rows={node.get('Actual Rows')}x{node.get('Actual Loops')}") if part != ""))
        for child in node.get("Plans", []):
            walk(child, depth + 1)
    walk(plan[0]["Plan"], 0)
    return "\n".join(lines)


def explained(session: Session, name: str, values: tuple[Any, ...]) -> tuple[int, int, str]:
    """(rows read, buffer pages, plan) of the prepared statement ``name`` of ``session`` as
    its next run would run it (the plan it keeps, or a custom one), run by ``EXPLAIN
    ANALYZE`` (its parameters as literals: the prepared statement's own are unknown to
    another)."""
    raw = session.connection.dbapi_connection
    assert raw is not None
    markers = ", ".join("%s" for _ in values)
    cursor = psycopg.ClientCursor(raw) if isinstance(raw, psycopg.Connection) else raw.cursor()
    cursor.execute(f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) EXECUTE {name} ({markers})",
                   values)
    row = cursor.fetchone()
    cursor.close()
    assert row is not None
    found = row[0]
    plan = json.loads(found) if isinstance(found, str) else found
    top = plan[0]["Plan"]
    return (rows_in(plan), int(top.get("Shared Hit Blocks", 0))
            + int(top.get("Shared Read Blocks", 0)), plan_tree(plan))


def prepared_as(session: Session, broker: Broker, statement: TextClause,
                params: dict[str, Any]) -> tuple[str, tuple[Any, ...]]:
    """The name ``session`` prepared ``statement`` under, as the transport runs it there,
    and the values its run binds: the transport's own (psycopg2), or psycopg 3's."""
    clock = broker.dialect.clock
    if session.dialect.driver == "psycopg2":
        driver = DriverSql.prepared(statement, "pyformat")
        assert driver.prepare is not None
        return driver.prepare.split()[1], driver.parameters(params, clock)
    driver = DriverSql.of(statement, "pyformat", {
        name: len(params[name]) for name in EXPANDING if f":{name}" in statement.text})
    numbers = iter(range(1, len(driver.values) + 1))
    sent = re.sub("%%|%s", lambda m: "%" if m[0] == "%%" else f"${next(numbers)}",
                  driver.sql)
    name = session.exec_driver_sql(
        "SELECT name FROM pg_prepared_statements WHERE statement = %(sql)s",
        {"sql": sent}).scalar_one()
    return str(name), driver.parameters(params, clock)


def generic_plans(session: Session, name: str) -> int:
    return int(session.exec_driver_sql(
        "SELECT generic_plans FROM pg_prepared_statements WHERE name = %(name)s",
        {"name": name}).scalar_one())


def driver_url(db_url: str, driver: str) -> str:
    """The broker URL of the database under test through ``driver``."""
    return "sqlinbox+" + make_url(db_url).set(
        drivername=f"postgresql+{driver}").render_as_string(hide_password=False)


@pytest.mark.parametrize("driver", ["psycopg2", "psycopg"])
@pytest.mark.parametrize("layout", ["fifo", "processed"])
def test_a_claim_planned_while_its_table_was_empty_is_planned_again_once_it_filled(
        db_url: str, table_prefix: str, driver: str, layout: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A consumer's claims on its LISTEN session: the FIFO claim, and a limited queue's
    claim in one statement on a table keeping its processed rows. Made on the empty
    table, the generic plan read every row of the filled one (FIFO: 200,000 rows, 800,000
    buffer pages, for 34 rows and 146 pages)."""
    options: dict[str, Any] = {"table": layout_spec(layout, table_prefix)}
    if layout == "processed":
        options["concurrency_limits"] = {"*": 2}
    runs: list[tuple[Session, TextClause, dict[str, Any]]] = []
    with Connection(driver_url(db_url, driver), transport_options={
            "table_prefix": table_prefix, "polling_interval": 0.05,
            "queues": {"jobs": options}}) as conn:
        conn.default_channel.queue_declare("jobs")
        broker = broker_of(conn)
        table = broker.table("jobs")
        dialect = broker.dialect
        claim = (dialect.limited_claim(table.spec, broker.limits.prefix).whole
                 if layout == "processed" else dialect.statements(table.spec).claim[0])
        assert claim is not None
        execute = dialect.execute

        def recorded(session: Session, statement: TextClause,
                     params: dict[str, Any]) -> Any:
            if statement is claim:
                runs.append((session, statement, dict(params)))
            return execute(session, statement, params)
        monkeypatch.setattr(dialect, "execute", recorded)
        discarded = statements_run(broker.engine, lambda sql: sql == dialect.discard_plans)
        with Consumer(conn, [Queue("jobs")], accept=["json"]), discarded as discards:
            for _ in range(RUNS_WHILE_EMPTY):
                assert broker.claim(table, 5) == []
            session = runs[-1][0]
            assert all(run[0] is session for run in runs), "the claims left their session"
            name, _ = prepared_as(session, broker, claim, runs[-1][2])
            assert generic_plans(session, name) > 0, (
                "no generic plan was made while the table was empty: nothing to plan again")
            assert discards == [], "plans discarded before plan_refresh passed"
            fill(broker, table.spec, layout)
            monkeypatch.setattr(dialect, "plan_refresh", 0.0)
            assert broker.claim(table, 5), "no row claimed from the filled table"
            assert discards, "the session's plans were not discarded"
            rows, pages, plan = explained(session, *prepared_as(session, broker, claim,
                                                                runs[-1][2]))
    assert rows < FEW_ROWS, f"{rows} rows, {pages} buffer pages read:\n{plan}"


def every_prepared(broker: Broker, spec: TableSpec) -> dict[str, TextClause]:
    """Each statement of the table the transport prepares, by its field's name (and the
    limited claim's in one statement)."""
    statements = broker.dialect.statements(spec)
    found: dict[str, TextClause] = {}
    for field in fields(statements):
        value = getattr(statements, field.name)
        if field.name in NOT_PREPARED or value is None:
            continue
        for n, item in enumerate(value if isinstance(value, tuple) else (value,)):
            found[f"{field.name}[{n}]" if isinstance(value, tuple) else field.name] = item
    reads = broker.dialect.limited_claim(spec, broker.limits.prefix)
    for name in ("whole", "whole_completing"):
        if getattr(reads, name) is not None:
            found[f"limited {name}"] = getattr(reads, name)
    return found


@pytest.mark.parametrize("layout", ["fifo", "processed"])
def test_every_prepared_statement_planned_while_empty_is_planned_again_once_it_filled(
        db_url: str, table_prefix: str, layout: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every statement the transport prepares for the table (claims, settlements, lease
    extensions), run through the dialect on a psycopg2 session that prepares them (as the
    LISTEN connection's and the lease keeper's do), in transactions rolled back: after
    their runs on the empty table (some plans kept generic) and the table filled, once
    plan_refresh passed, each reads about what a custom plan reads. Kept, the FIFO
    claims and the claim carrying acks read every row (200,000), as did the claim by ids
    and the limited queue's claims in one statement on the table keeping processed
    rows."""
    with Connection(driver_url(db_url, "psycopg2"), transport_options={
            "table_prefix": table_prefix,
            "queues": {"jobs": {"table": layout_spec(layout, table_prefix)}}}) as conn:
        conn.default_channel.queue_declare("jobs")
        broker = broker_of(conn)
        broker.limits.ensure()
        own = OwnSession(broker.database)
        try:
            bad, report = planned_again(broker, own.connect(), layout, monkeypatch)
        finally:
            own.drop()
    assert not bad, "\n".join(bad + report)


def planned_again(broker: Broker, session: Session, layout: str,
                  monkeypatch: pytest.MonkeyPatch) -> tuple[list[str], list[str]]:
    """The statements that read much more than their custom plans once the table filled
    (with their plans), and what each read."""
    dialect = broker.dialect
    spec = broker.table("jobs").spec
    with broker.engine.begin() as db:
        floor = dialect.claim_floor(db, spec)
    params: dict[str, Any] = {
        "limit": 8, "lease": 30.0, "floor": floor, "window": 17, "candidates": 16,
        "attempt": 1, "ids": [1, 2, 3, 4, 5], "skip": ["elsewhere"], "delay": 5.0,
        "channel": "x", "id": 1, "wanted": 8, "queue_table": spec.table, "prefixes": ["*"],
        "limits": [2]}
    statements = every_prepared(broker, spec)

    def rolled_back(statement: TextClause) -> None:
        session.exec_driver_sql("BEGIN")
        try:
            dialect.execute(session, statement, params)
        finally:
            session.exec_driver_sql("ROLLBACK")
            session.rollback()

    for statement in statements.values():
        for _ in range(RUNS_WHILE_EMPTY):
            rolled_back(statement)
    fill(broker, spec, layout)
    with broker.engine.begin() as db:
        held = dialect.claim(db, spec, 5, 3600.0)  # in work: the settlements find them
        dialect.forget_floor(spec)
        params.update(attempt=held[0].attempt, ids=[row.id for row in held], id=held[0].id,
                      floor=dialect.claim_floor(db, spec))
    with monkeypatch.context() as patched:
        patched.setattr(dialect, "plan_refresh", 0.0)
        rolled_back(statements["extend"])  # the first statement once plan_refresh passed
    bad, report = [], []
    for name, statement in statements.items():
        prepared, values = prepared_as(session, broker, statement, params)
        session.exec_driver_sql("BEGIN")
        kept = explained(session, prepared, values)
        session.exec_driver_sql("SET LOCAL plan_cache_mode = force_custom_plan")
        custom = explained(session, prepared, values)
        session.exec_driver_sql("ROLLBACK")
        session.rollback()
        report.append(f"{name}: {kept[0]} rows, {kept[1]} pages "
                      f"({custom[0]}, {custom[1]} custom)")
        if kept[0] > max(FEW_ROWS, 5 * custom[0]) or kept[1] > max(200, 5 * custom[1]):
            bad.append(f"{name}: {kept[0]} rows, {kept[1]} pages\n{kept[2]}")
    return bad, report
