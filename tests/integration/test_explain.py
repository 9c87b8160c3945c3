"""The claim's row selection uses the claim index on a big queue (PostgreSQL, MariaDB/MySQL),
and so does SQLite's read before a claim."""

from __future__ import annotations

import json
from functools import partial

import psycopg
import pytest
from sqlalchemy import URL, Connection, TextClause, create_engine, text

from kombu_sqlinbox import TableBuilder
from kombu_sqlinbox.dialects.base import DriverSql
from kombu_sqlinbox.limits import parsed
from kombu_sqlinbox.own_session import OwnSession

from .conftest import Connect
from .support import broker_of, quoted

READY_ROWS = 200_000
#: ten digits; five cross joins of them give 100,000 rows, six a million
DIGITS = " UNION ALL ".join(f"SELECT {d} AS d" for d in range(10))
ANALYZE = {"postgresql": "ANALYZE", "mysql": "ANALYZE TABLE"}


def bulk_insert_sql(database: str, table: str, queues: bool = False,
                    group: str | None = None) -> str:
    """One INSERT ... SELECT of READY_ROWS ready rows (no row-by-row round trips); with
    ``queues``, transient messages spread over 1,000 queues; with ``group``, every row in
    that FIFO group (column ``grp``)."""
    column = "queue, " if queues else "grp, " if group else ""
    if database == "postgresql":
        queue = "'q' || (n % 1000), " if queues else f"'{group}', " if group else ""
        return (f"INSERT INTO {table} ({column}payload, headers) "
                f"SELECT {queue}'x'::bytea, '{{}}' FROM generate_series(1, {READY_ROWS}) AS n")
    queue = "CONCAT('q', d0.d, d1.d, d2.d), " if queues else f"'{group}', " if group else ""
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


@pytest.mark.parametrize("database", ["sqlite"], indirect=True)
def test_sqlite_read_before_a_claim_walks_the_claim_index(connect: Connect,
                                                          database: str) -> None:
    conn = connect()
    conn.default_channel.queue_declare("jobs")
    broker = broker_of(conn)
    spec = broker.table("jobs").spec
    statement = broker.dialect.statements(spec).any_ready
    assert statement is not None
    index = broker.dialect.index_name(spec).strip('"`')
    with broker.engine.begin() as db:
        db.execute(text(bulk_insert_sql(database, quoted(broker.engine, spec.table))))
        db.execute(text("ANALYZE"))
        shown = "\n".join(broker.dialect.plan_lines(db, broker.dialect.explained(statement),
                                                    {}))
    assert broker.dialect.plan_problem(shown, index) is None, shown


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
        alone = routes.sql.claim_alone  # MariaDB's: a plain read, a DELETE by ids
        for claim in [routes.sql.claim[0], *([alone[0]] if alone is not None else [])]:
            result = db.execute(text(f"EXPLAIN {claim.text}"), {"queue": "q100", "limit": 10})
            if database == "postgresql":
                shown = "\n".join(str(row[0]) for row in result)
                assert index in shown and "Seq Scan" not in shown, shown
            else:
                rows = [dict(row._mapping) for row in result]
                assert rows[0]["key"] == index and rows[0]["type"] != "ALL", rows
            # a few rows of the queue's 200 (MariaDB's shows a sort, of what its range
            # read: ten rows)
            assert rows_read(db, database, claim, {"queue": "q100", "limit": 10}) <= 30
        assert alone is not None or database != "mysql"
        if alone is not None:  # its DELETE reads the rows of the ids it is given alone
            ids = list(db.execute(alone[0], {"queue": "q100", "limit": 10}).scalars())
            assert len(ids) == 10 and rows_read(db, database, alone[1], {"ids": ids}) == 10


def rows_read(conn: Connection, database: str, statement: TextClause,
              params: dict[str, object]) -> int:
    """Rows (SQLite: thousands of VM instructions) the database read to run ``statement``,
    from the executed plan: PostgreSQL's and MariaDB's actual rows per table scan."""
    if database == "sqlite":
        steps = [0]

        def step() -> int:
            steps[0] += 1
            return 0
        raw = conn.connection.dbapi_connection
        assert raw is not None
        raw.set_progress_handler(step, 1000)
        conn.execute(statement, params)
        raw.set_progress_handler(None, 0)
        return steps[0]
    if database == "postgresql":
        explain = f"EXPLAIN (ANALYZE, FORMAT JSON) {statement.text}"
        rows, loops, table = "Actual Rows", "Actual Loops", "Relation Name"
    else:
        explain, rows, loops, table = (f"ANALYZE FORMAT=JSON {statement.text}", "r_rows",
                                       "r_loops", "table_name")
    plan = conn.execute(text(explain).bindparams(*statement._bindparams.values()),
                        params).scalar_one()
    return rows_in(plan, rows, loops, table)


def rows_in(plan: object, rows: str = "Actual Rows", loops: str = "Actual Loops",
            table: str = "Relation Name") -> int:
    """The rows an executed JSON plan read from tables (PostgreSQL's keys by default)."""
    found = 0

    def walk(node: object) -> None:
        nonlocal found
        if isinstance(node, dict):
            name = node.get(table)
            if isinstance(name, str) and not name.startswith("<"):
                found += int(float(node.get(rows) or 0) * float(node.get(loops) or 1))
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)
    walk(json.loads(plan) if isinstance(plan, str) else plan)
    return found


@pytest.mark.parametrize("database", ["postgresql", "mysql", "sqlite"], indirect=True)
def test_fifo_claim_reads_no_backlog_behind_a_head_in_work(
        connect: Connect, database: str, table_prefix: str) -> None:
    """One group of READY_ROWS rows whose head is in work: both FIFO claim statements (the
    window, then the groups' heads) read a few rows, not the rows waiting behind it."""
    spec = (TableBuilder(f"{table_prefix}jobs").id().payload().headers()
            .group("grp", fifo=True).available_at().locked_until().attempt().build())
    conn = connect(queues={"jobs": {"table": spec}})
    conn.default_channel.queue_declare("jobs")
    broker = broker_of(conn)
    spec = broker.table("jobs").spec
    table = quoted(broker.engine, spec.table)
    with broker.engine.begin() as db:
        db.execute(text(bulk_insert_sql(database, table, group="g0")))
    with broker.engine.begin() as db:
        db.execute(text(f"{ANALYZE.get(database, 'ANALYZE')} {table}"))
        (head,) = broker.dialect.claim(db, spec, 1, 3600.0)
    statements = broker.dialect.statements(spec)
    assert statements.claim_heads is not None
    params = {"limit": 1, "window": 17, "lease": 30.0, "ids": [], "skip": [], "floor": 0.0,
              "candidates": 2}
    for claim in (statements.claim[0], statements.claim_heads[0]):
        with broker.engine.connect() as db, db.begin() as transaction:
            read = rows_read(db, database, claim, params)
            transaction.rollback()
        assert read < 1000, f"{read} rows read behind head {head.id}: {claim.text}"
        if database == "postgresql":
            read = generic_rows_read(broker.engine.url, claim, params)
            assert read < 1000, f"{read} rows read behind head {head.id}, prepared: {claim.text}"
    if database == "postgresql":  # the claim carrying the head's ack, prepared
        assert statements.claim_completing is not None
        completing = {**params, "attempt": head.attempt, "ids": [head.id], "channel": "x"}
        read = generic_rows_read(broker.engine.url, statements.claim_completing, completing)
        assert read < 1000, f"{read} rows read behind head {head.id}, with its ack, prepared"
    with broker.engine.begin() as db:
        assert broker.dialect.claim(db, spec, 4, 30.0) == [], "a row behind the head was taken"


#: a unique key per row of a big table, computed in SQL
UNIQUE_KEYS = {"postgresql": "md5(id::text)", "mysql": "SHA2(id, 256)"}


@pytest.mark.parametrize("database", ["postgresql", "mysql"], indirect=True)
@pytest.mark.parametrize("keyed", [False, True], ids=["no keys", "every row keyed"])
def test_claim_candidates_and_floor_read_a_few_rows_of_a_big_queue(
        connect: Connect, database: str, keyed: bool) -> None:
    """READY_ROWS ready rows: the claim (PostgreSQL: its bands of priorities merged), the
    advisory form's candidates and the floor read from where it stands each read a few
    rows from the claim index, not the backlog; on PostgreSQL the claim and the
    settlements, prepared, too. The same with a unique key on every row: the key's index
    takes no claim's place."""
    conn = connect()
    conn.default_channel.queue_declare("jobs")
    broker = broker_of(conn)
    spec = broker.table("jobs").spec
    table = quoted(broker.engine, spec.table)
    with broker.engine.begin() as db:
        db.execute(text(bulk_insert_sql(database, table)))
        if keyed:
            broker.dialect.add_unique(db, spec)
    if keyed:
        with broker.engine.begin() as db:
            db.execute(text(f"UPDATE {table} SET sqlinbox_unique = {UNIQUE_KEYS[database]}"))
    with broker.engine.begin() as db:
        db.execute(text(f"{ANALYZE[database]} {table}"))
        floor = broker.dialect.claim_floor(db, spec)
    statements = broker.dialect.statements(spec)
    assert statements.floor_above is not None
    params = {"limit": 8, "lease": 30.0, "floor": floor, "candidates": 16}
    for statement in (statements.claim[0], statements.candidates, statements.floor_above):
        with broker.engine.connect() as db, db.begin() as transaction:
            read = rows_read(db, database, statement, params)
            transaction.rollback()
        assert read < 100, f"{read} rows read: {statement.text}"
    if database == "postgresql":
        with broker.engine.connect() as db:
            ids = list(db.execute(text(f"SELECT id FROM {table} ORDER BY id LIMIT 5")).scalars())
            last = list(db.execute(text(f"SELECT id FROM {table} ORDER BY id DESC LIMIT 5"))
                        .scalars())
        fenced = {"attempt": 0, "ids": ids, "lease": 30.0}
        assert statements.claim_completing is not None
        # the rows each must find: the claim's 8, the acked 5, none to extend (never leased);
        # the claim carrying acks of 5 rows at the queue's far end, 8 and 5
        for statement, values, found in ((statements.claim[0], params, 8),
                                         (statements.complete, fenced, 5),
                                         (statements.extend, fenced, 0),
                                         (statements.claim_completing,
                                          {**params, **fenced, "ids": last, "channel": "x"}, 13)):
            read = generic_rows_read(broker.engine.url, statement, values)
            assert found <= read < 100, f"{read} rows read, prepared: {statement.text}"


def generic_rows_read(url: URL, statement: TextClause, params: dict[str, object]) -> int:
    """Rows PostgreSQL read to run ``statement`` prepared, as a consumer's LISTEN session
    runs it with psycopg2 (psycopg 3 prepares statements itself), in the plan made once for
    any parameters (a generic plan), which it may choose after a few runs."""
    engine = create_engine(url.set(drivername="postgresql+psycopg2"))
    with engine.connect() as db, db.begin() as transaction:
        read = prepared_rows_read(db, statement, params, generic=True)
        transaction.rollback()
    engine.dispose()
    return read


def prepared_rows_read(db: Connection, statement: TextClause, params: dict[str, object],
                       generic: bool) -> int:
    """Rows PostgreSQL read to run ``statement`` prepared on ``db`` (under whatever its
    session or transaction set), in the plan made for any parameters (``generic``) or
    for these; the statement runs, and the plan mode and the statement are gone after."""
    prepared = DriverSql.prepared(statement, "pyformat")
    assert prepared.prepare is not None
    mode = "force_generic_plan" if generic else "force_custom_plan"
    db.exec_driver_sql(f"SET plan_cache_mode = {mode}")
    db.exec_driver_sql(prepared.prepare)
    explain = f"EXPLAIN (ANALYZE, FORMAT JSON) {prepared.sql}"
    values = prepared.parameters(params, None)
    if db.dialect.driver == "psycopg":  # which binds on the server: no parameters there
        explain = psycopg.ClientCursor(db.connection.dbapi_connection).mogrify(explain, values)
        values = None
    plan = db.exec_driver_sql(explain, values).scalar_one()
    db.exec_driver_sql(f"DEALLOCATE {prepared.sql.split()[1]}")
    db.exec_driver_sql("RESET plan_cache_mode")
    return rows_in(plan)


#: table statistics a queue table is often left with (autovacuum analyzes a new table
#: while it is still empty; a burst is analyzed while its rows are in work), applied
#: to a table of READY_ROWS ready rows
STALE_STATISTICS = {
    "taken while empty": ("ANALYZE {table}", "{fill}"),
    "taken while every row was leased": (
        "{fill}", "UPDATE {table} SET locked_until = now() + interval '1 hour'",
        "ANALYZE {table}", "UPDATE {table} SET locked_until = NULL"),
}


@pytest.mark.parametrize("database", ["postgresql"], indirect=True)
@pytest.mark.parametrize("statistics", sorted(STALE_STATISTICS))
@pytest.mark.parametrize("fifo", [False, True], ids=["default layout", "FIFO, head in work"])
def test_claims_read_a_few_rows_of_a_big_queue_whatever_its_statistics(
        connect: Connect, database: str, table_prefix: str, statistics: str,
        fifo: bool) -> None:
    """With statistics that have PostgreSQL's planner read the whole backlog for a claim,
    every claim statement of the table (the FIFO ones behind a head in work too) still
    reads a few rows, custom and generic plans alike, on both kinds of connection the
    transport claims on: a session of its own (the LISTEN connection's, in autocommit)
    and a fenced transaction of the pool."""
    options: dict[str, object] = {}
    if fifo:
        options["queues"] = {"jobs": {"table": TableBuilder(f"{table_prefix}jobs").id()
                                      .payload().headers().group("grp", fifo=True)
                                      .available_at().locked_until().attempt().build()}}
    conn = connect(**options)
    conn.default_channel.queue_declare("jobs")
    broker = broker_of(conn)
    spec = broker.table("jobs").spec
    table = quoted(broker.engine, spec.table)
    fill = bulk_insert_sql(database, table, group="g0" if fifo else None)
    for step in STALE_STATISTICS[statistics]:
        with broker.engine.begin() as db:
            db.execute(text(step.format(table=table, fill=fill)))
    with broker.engine.begin() as db:
        if fifo:
            broker.dialect.claim(db, spec, 1, 3600.0)  # the group's head, in work
        floor = broker.dialect.claim_floor(db, spec)
        last = list(db.execute(text(f"SELECT id FROM {table} ORDER BY id DESC LIMIT 5"))
                    .scalars())
    statements = broker.dialect.statements(spec)
    assert statements.claim_completing is not None
    params = {"limit": 8, "lease": 30.0, "floor": floor, "window": 17, "candidates": 16}
    # the acks the completing claim carries: fenced out behind the FIFO head (its group
    # stays blocked for the next statements), landing on the default layout
    acks = {"attempt": 99 if fifo else 0, "ids": last, "channel": "x"}
    claims = {"the claim": (statements.claim[0], params),
              "the claim carrying acks": (statements.claim_completing, {**params, **acks})}
    if statements.claim_heads is not None:
        claims["the claim of the groups' heads"] = (statements.claim_heads[0], params)
    if not fifo:
        with broker.engine.connect() as db, db.begin() as transaction:
            unset = prepared_rows_read(db, statements.claim[0], params, generic=False)
            transaction.rollback()
        assert unset > READY_ROWS // 2, f"these statistics no longer mislead ({unset} rows)"
    own = OwnSession(broker.database)
    session = own.connect()
    try:
        for name, (statement, values) in claims.items():
            for generic in (False, True):
                read = {"its own session": prepared_rows_read(session, statement, values,
                                                              generic),
                        "the pool": broker.database.run_fenced(partial(
                            prepared_rows_read, statement=statement, params=values,
                            generic=generic))}
                for where, rows in read.items():
                    assert rows < 100, (f"{name} on {where} read {rows} rows "
                                        f"({'generic' if generic else 'custom'} plan)")
    finally:
        own.drop()


#: a limit key per four rows in a row of a big table, as the envelope's header, in SQL
KEYED_HEADERS = {"postgresql": """'{"headers": {"limit_key": "k' || (id / 4) || '"}}'""",
                 "mysql": """CONCAT('{"headers": {"limit_key": "k', id DIV 4, '"}}')"""}


@pytest.mark.parametrize("database", ["postgresql", "mysql"], indirect=True)
def test_limited_claim_candidates_read_a_few_rows_of_a_big_queue(
        connect: Connect, database: str) -> None:
    """READY_ROWS ready rows, four of each limit key in a row, the first keys' slots all
    held by rows in work: a limited claim's candidates read a few rows from the claim
    index, each with its key's slots; where the scan reads them (MariaDB/MySQL), by the
    slots' primary key (not every slot), passing over the full keys' rows."""
    conn = connect(queues={"jobs": {"concurrency_limits": {"*": 2}}})
    conn.default_channel.queue_declare("jobs")
    broker = broker_of(conn)
    table_ = broker.table("jobs")
    spec = table_.spec
    table = quoted(broker.engine, spec.table)
    broker.limits.ensure()
    slots = quoted(broker.engine, broker.limits.name)
    with broker.engine.begin() as db:
        db.execute(text(bulk_insert_sql(database, table)))
    with broker.engine.begin() as db:
        db.execute(text(f"UPDATE {table} SET headers = {KEYED_HEADERS[database]}"))
    with broker.engine.begin() as db:
        db.execute(text(f"{ANALYZE[database]} {table}"))
    # the first five keys in line: two rows of each in work, holding both slots
    held = broker.limits.claim(table_, 10)
    keys = {json.loads(str(row.headers))["headers"]["limit_key"] for row in held}
    assert len(keys) == 5, keys
    with broker.engine.begin() as db:
        assert db.execute(text(f"SELECT COUNT(*) FROM {slots}")).scalar_one() == 10
        floor = broker.dialect.claim_floor(db, spec)
    reads = broker.dialect.limited_claim(spec, broker.limits.prefix)
    candidates = reads.candidates
    params: dict[str, object] = {"limit": 32, "floor": floor, "full": [], "most": 2,
                                 "queue_table": spec.table}
    with broker.engine.connect() as db, db.begin() as transaction:
        found = db.execute(candidates, params).all()
        read = rows_read(db, database, candidates, params)
        transaction.rollback()
    # where the scan reads the slots, the full keys' rows are passed over; every row
    # brings its key's slots: the full keys' two each
    passed_over = broker.dialect.slots_in_scan
    assert len(found) == 32 and not (passed_over and keys & {row[1] for row in found}), found
    assert all(len(parsed(row[2])) == 2 for row in found if row[1] in keys), found
    # the rows taken, the full keys' three left each, and the candidates with their slots
    assert read < 300, f"{read} rows read: {candidates.text}"
