"""Queues shared with other services, on each database: rows inserted with SQL come out
of a row-mode queue as Celery task messages; a plain queue stores a kombu message's body
alone; a declared publish statement writes every row, also in a bound transaction, and
one that does not fit the schema fails at start-up."""

from __future__ import annotations

import base64
import json
from datetime import date, time
from decimal import Decimal

import pytest
from kombu import Connection
from sqlalchemy import text
from sqlalchemy.engine import Engine

from celery_ext.binding import bind
from kombu_sqlinbox import ConfigurationError, Role, SchemaMismatch, TableBuilder, TableSpec
from kombu_sqlinbox.dialects import dialect_for

from .conftest import Connect
from .support import death, get, get_within, publish, quoted, settled

#: what a driver returns for a payload, a headers column, a time: every variant
pytestmark = pytest.mark.drivers


def events(prefix: str) -> TableSpec:
    """Row mode from named columns (the transport creates them as text)."""
    return (TableBuilder(f"{prefix}events").id().attempt().locked_until().available_at()
            .task("rows.handle", arguments=("order_id", "kind")).build())


def insert(engine: Engine, table: str, **values: object) -> None:
    columns = ", ".join(quoted(engine, name) for name in values)
    params = ", ".join(f":{name}" for name in values)
    with engine.begin() as conn:
        conn.execute(text(f"INSERT INTO {quoted(engine, table)} ({columns}) VALUES ({params})"),
                     values)


def test_a_row_inserted_with_sql_is_delivered_as_its_task_and_keeps_its_id_when_redelivered(
        connect: Connect, engine: Engine, table_prefix: str) -> None:
    conn = connect(queues={"events": {"table": events(table_prefix)}})
    conn.default_channel.queue_declare("events")
    insert(engine, f"{table_prefix}events", order_id="7", kind="paid")

    first = get_within(conn, "events")
    assert first.headers["task"] == "rows.handle"
    assert first.content_type == "application/json"
    assert first.payload[:2] == [[], {"order_id": "7", "kind": "paid"}]
    first.requeue()
    settled(conn)
    again = get_within(conn, "events")
    assert again.headers["id"] == first.headers["id"]
    assert again.delivery_info["redelivered"] is True
    again.ack()
    settled(conn)
    assert get(conn, "events") is None


def test_a_task_published_to_a_row_mode_queue_is_written_as_its_row(
        connect: Connect, engine: Engine, table_prefix: str) -> None:
    conn = connect(queues={"events": {"table": events(table_prefix)}})
    publish(conn, "events", [[], {"order_id": "8", "kind": "placed"}, {}],
            headers={"task": "rows.handle", "id": "ignored"})
    with engine.connect() as db:
        stored = db.execute(text(
            f"SELECT order_id, kind FROM {quoted(engine, f'{table_prefix}events')}")).all()
    assert [tuple(row) for row in stored] == [("8", "placed")]
    assert get_within(conn, "events").payload[1] == {"order_id": "8", "kind": "placed"}


def test_a_plain_queue_stores_the_body_alone_for_readers_that_are_not_celery(
        connect: Connect, engine: Engine, table_prefix: str) -> None:
    spec = (TableBuilder(f"{table_prefix}feed").id().payload().headers().attempt()
            .locked_until().plain().build())
    conn = connect(queues={"feed": {"table": spec}})
    conn.default_channel.queue_declare("feed")
    with engine.connect() as caller:
        caller.begin()
        with bind(caller):  # written in the caller's transaction: gone with its rollback
            conn.Producer().publish({"sku": "rolled back"}, routing_key="feed")
        caller.rollback()
    publish(conn, "feed", {"sku": "A-1", "qty": 3}, headers={"ignored": "yes"})
    with engine.connect() as db:
        payload, headers = db.execute(text(
            f"SELECT payload, headers FROM {quoted(engine, f'{table_prefix}feed')}")).one()
    assert json.loads(bytes(payload)) == {"sku": "A-1", "qty": 3}
    assert headers is None, "no envelope"
    assert get_within(conn, "feed").payload == {"sku": "A-1", "qty": 3}


def source_table(connect: Connect, engine: Engine, prefix: str) -> str:
    """The default layout of queue ``audit``, created by the transport, plus a column
    ``source`` only a declared publish statement fills."""
    connect().default_channel.queue_declare("audit")
    table = quoted(engine, f"{prefix}audit")
    with engine.begin() as conn:
        conn.execute(text(f"ALTER TABLE {table} ADD COLUMN source VARCHAR(64)"))
    return table


def test_the_declared_publish_statement_writes_every_row_also_in_a_bound_transaction(
        connect: Connect, engine: Engine, table_prefix: str) -> None:
    table = source_table(connect, engine, table_prefix)
    statement = (f"INSERT INTO {table} (payload, headers, source) "
                 "VALUES (:payload, :headers, :task_name)")
    spec = (TableBuilder(f"{table_prefix}audit").id().payload().headers().priority()
            .available_at().locked_until().attempt().publish_statement(statement).build())
    conn = connect(queues={"audit": {"table": spec}})
    producer = conn.Producer()
    with engine.connect() as caller:
        caller.begin()
        with bind(caller):
            producer.publish({"n": 1}, routing_key="audit", headers={"task": "rolled.back"})
        caller.rollback()
        caller.begin()
        with bind(caller):
            producer.publish({"n": 2}, routing_key="audit", headers={"task": "kept"})
        caller.commit()
    producer.publish({"n": 3}, routing_key="audit", headers={"task": "alone"})
    with engine.connect() as db:
        sources = db.execute(text(f"SELECT source FROM {table} ORDER BY id")).scalars().all()
    assert sources == ["kept", "alone"]
    message = get_within(conn, "audit")
    assert (message.payload, message.headers["task"]) == ({"n": 2}, "kept")


def test_a_publish_statement_that_does_not_fit_the_schema_fails_at_start_up(
        connect: Connect, engine: Engine, table_prefix: str) -> None:
    table = source_table(connect, engine, table_prefix)
    spec = (TableBuilder(f"{table_prefix}audit").id().payload().headers().priority()
            .available_at().locked_until().attempt()
            .publish_statement(f"INSERT INTO {table} (payload, origin) VALUES (:payload, 1)")
            .build())
    conn = connect(queues={"audit": {"table": spec}})
    with pytest.raises(SchemaMismatch, match="its publish statement does not fit the schema"):
        conn.default_channel.queue_declare("audit")


def test_a_row_mode_column_the_table_lacks_fails_at_start_up_with_the_fix(
        connect: Connect, engine: Engine, table_prefix: str) -> None:
    connect().default_channel.queue_declare("events")  # the default layout: no kind column
    spec = (TableBuilder(f"{table_prefix}events").id().payload().attempt()
            .locked_until().task("rows.handle", arguments=("kind",)).build())
    conn = connect(queues={"events": {"table": spec}})
    with pytest.raises(SchemaMismatch, match=r"column 'kind' \(row mode\) is missing; add it"):
        conn.default_channel.queue_declare("events")


#: every claim form on every database that has it (and the driver variants, on one)
FORMS = [("postgresql", "lease"), ("mysql", "lease"), ("sqlite", "lease"),
         ("postgresql", "row_lock"), ("mysql", "row_lock"),
         ("postgresql", "advisory"), ("mysql", "advisory"),
         ("postgresql-psycopg2", "row_lock"), ("mysql-nonstrict", "row_lock")]


@pytest.mark.parametrize(("database", "claim"), FORMS)
def test_row_mode_rows_come_out_of_every_claim_form_a_key_at_a_time(
        connect: Connect, engine: Engine, table_prefix: str, claim: str) -> None:
    spec = (TableBuilder(f"{table_prefix}keyed").id().payload().partition_key("account")
            .attempt().locked_until().available_at().task(column="task").build())
    conn = connect(queues={"keyed": {"table": spec, "claim": claim}})
    conn.default_channel.queue_declare("keyed")
    for n, account in enumerate(("a", "a", "b")):
        insert(engine, f"{table_prefix}keyed", account=account, task="rows.post",
               payload=json.dumps({"n": n}).encode())
    first = get_within(conn, "keyed")
    second = get_within(conn, "keyed")
    assert [first.payload[1], second.payload[1]] == [{"n": 0}, {"n": 2}], (
        "a's second row waits behind its first")
    assert first.headers["task"] == "rows.post"
    first.ack()
    second.ack()
    settled(conn)
    assert get_within(conn, "keyed").payload[1] == {"n": 1}


def test_a_publish_statement_binds_row_mode_columns_by_name(
        connect: Connect, engine: Engine, table_prefix: str) -> None:
    connect(queues={"events": {"table": events(table_prefix)}}).default_channel.queue_declare(
        "events")
    table = quoted(engine, f"{table_prefix}events")
    with engine.begin() as conn:
        conn.execute(text(f"ALTER TABLE {table} ADD COLUMN source VARCHAR(64)"))
    spec = (TableBuilder(f"{table_prefix}events").id().attempt().locked_until().available_at()
            .task("rows.handle", arguments=("order_id", "kind"))
            .publish_statement(f"INSERT INTO {table} (order_id, kind, source) "
                               "VALUES (:order_id, :kind, :task_id)").build())
    conn = connect(queues={"events": {"table": spec}})
    publish(conn, "events", [[], {"order_id": "9", "kind": "paid"}, {}],
            headers={"task": "rows.handle", "id": "task-9"})
    with engine.connect() as db:
        stored = db.execute(text(f"SELECT order_id, kind, source FROM {table}")).all()
    assert [tuple(row) for row in stored] == [("9", "paid", "task-9")]


#: the argument columns of a service's own table, as each database spells them
TYPED_COLUMNS = {
    "postgresql": "order_id BIGINT, kind VARCHAR(8), price NUMERIC(8, 2), ratio REAL, "
                  "due DATE, paid BOOLEAN, starts TIME, bin BYTEA, mood VARCHAR(8), "
                  "stamp TIMESTAMP",
    "mysql": "order_id BIGINT, kind VARCHAR(8), price DECIMAL(8, 2), ratio FLOAT, "
             "due DATE, paid BOOLEAN, starts TIME, bin VARBINARY(4), mood ENUM('sad', 'ok'), "
             "stamp TIMESTAMP NULL",
    "sqlite": "order_id BIGINT, kind VARCHAR(8), price NUMERIC(8, 2), ratio REAL, "
              "due DATE, paid BOOLEAN, starts TIME, bin BLOB, mood VARCHAR(8), "
              "stamp TIMESTAMP",
}
ARGUMENTS = ("order_id", "kind", "price", "ratio", "due", "paid", "starts", "bin", "mood",
             "stamp")


def create_row_table(engine: Engine, name: str, columns: str,
                     available_at: bool = True) -> None:
    """A row-mode table as a service makes it: the lease columns, then ``columns``."""
    dialect = dialect_for(engine)
    due = f"available_at {dialect.column_types[Role.AVAILABLE_AT]}, " if available_at else ""
    with engine.begin() as conn:
        conn.execute(text(
            f"CREATE TABLE {quoted(engine, name)} (id {dialect.generated_id_type}, "
            f"attempt {dialect.column_types[Role.ATTEMPT]}, "
            f"locked_until {dialect.column_types[Role.LOCKED_UNTIL]}, {due}{columns})"))


def typed_events(engine: Engine, database: str, prefix: str) -> TableSpec:
    """Row mode on a table the service made, its argument columns typed."""
    create_row_table(engine, f"{prefix}typed", TYPED_COLUMNS[database], available_at=False)
    return (TableBuilder(f"{prefix}typed").id().attempt().locked_until()
            .task("rows.handle", arguments=ARGUMENTS).build())


GOOD = {"order_id": 2**40 + 1, "kind": "paid", "price": 12.5, "ratio": 0.5,
        "due": "2026-12-03", "paid": True, "starts": "10:00:00", "bin": "ab", "mood": "ok",
        "stamp": "2026-12-03T10:00:00"}


@pytest.mark.parametrize(("argument", "value", "why"), [
    ("order_id", 1.5, "not a whole number"),
    ("order_id", "0042", "text"),
    ("order_id", 2**63, "out of range"),
    ("order_id", True, "true or false"),
    ("kind", 42, "not text"),
    ("kind", "refunded!", "longer than 8"),
    ("price", 1.005, "decimal places"),
    ("price", 10**6, "too large"),
    ("price", "12.50", "text"),
    ("ratio", 0.1, "single precision"),
    ("due", "3 Dec 2026", "ISO 8601"),
    ("due", 20261203, "not text"),
    ("paid", 1, "true or false"),
])
def test_an_argument_its_column_cannot_hold_exactly_is_refused_at_publish(
        connect: Connect, engine: Engine, database: str, table_prefix: str,
        argument: str, value: object, why: str) -> None:
    """Nothing is written, and the error names the argument, the column and why; what the
    columns hold exactly arrives as it was sent."""
    held = {("sqlite", "ratio", 0.1): "SQLite's REAL is double precision",
            ("mysql", "paid", 1): "MariaDB's BOOLEAN is a TINYINT(1)"}
    spec = typed_events(engine, database, table_prefix)
    conn = connect(queues={"typed": {"table": spec}})
    if (database, argument, value) in held:  # this column holds it exactly: taken
        assert arrives_as_sent(conn, argument, value), held[database, argument, value]
        return
    with pytest.raises(ConfigurationError, match=rf"argument {argument}=.*column "
                                                 rf"{argument}\b.*{why}"):
        publish(conn, "typed", [[], {**GOOD, argument: value}, {}],
                headers={"task": "rows.handle", "id": "x"})
    publish(conn, "typed", [[], GOOD, {}], headers={"task": "rows.handle", "id": "y"})
    message = get_within(conn, "typed")
    assert message.payload[1] == {**GOOD, "paid": message.payload[1]["paid"]}
    assert message.payload[1]["paid"] in (True, 1)
    message.ack()
    settled(conn)
    assert get(conn, "typed") is None, "the refused publish wrote a row"


def arrives_as_sent(conn: Connection, argument: str, value: object) -> bool:
    """Publish ``value`` as ``argument`` to the typed queue: whether the task gets it as
    sent (a time as ISO 8601 text, with either separator)."""
    publish(conn, "typed", [[], {**GOOD, argument: value}, {}],
            headers={"task": "rows.handle", "id": "held"})
    message = get_within(conn, "typed")
    arrived = message.payload[1][argument]
    message.ack()
    settled(conn)
    same = str(arrived).replace(" ", "T") == str(value) if argument == "stamp" else (
        arrived == value)
    return bool(same) and get(conn, "typed") is None


#: values a column converts, or a driver fails on with an error naming neither the
#: argument nor the column, and the databases where they do (each is refused everywhere)
ODD_VALUES = [
    ("order_id", 10**400, "out of range", "an int beyond a float's range: OverflowError"),
    ("ratio", -(10**400), "out of range", "an int beyond a float's range: OverflowError"),
    ("starts", "1000", "extended form", "MariaDB stores 00:10:00, SQLite the number 1000"),
    ("starts", "100000", "extended form", "SQLite stores the number 100000"),
    ("kind", "a\x00b", "NUL", "PostgreSQL refuses it unnamed; refused everywhere alike"),
    ("kind", "\udcff", "surrogate", "a UnicodeEncodeError in the driver"),
    ("bin", "\\x41", "backslash", "PostgreSQL's bytea reads it as escapes: 'A'"),
    ("bin", "\u00e9\u00e9\u00e9", "longer than 4 bytes", "MariaDB: data too long, unnamed"),
    ("mood", 1, "one of|not text", "MariaDB's ENUM takes 1 as its first value"),
    ("mood", "OK", "one of", "MariaDB's ENUM takes 'OK' as 'ok' (its collation)"),
    ("kind", "x" * 100_000, "longer than 8", "the whole value in the error, a log line of 100 kB"),
    ("stamp", "2040-01-01T00:00:00", "range", "MariaDB: OperationalError, retried as a lost "
     "connection"),
]
#: where a value is held exactly as it was sent (the column has no such rule there)
HELD = {("bin", "\\x41"): ("mysql", "sqlite"), ("mood", "OK"): ("postgresql", "sqlite"),
        ("stamp", "2040-01-01T00:00:00"): ("postgresql", "sqlite"),
        ("bin", "\u00e9\u00e9\u00e9"): ("postgresql", "sqlite")}


@pytest.mark.parametrize(("argument", "value", "why", "before"), ODD_VALUES,
                         ids=[f"{case[0]}-{case[3][:40]}" for case in ODD_VALUES])
def test_an_odd_value_is_refused_at_publish_naming_argument_and_column(
        connect: Connect, engine: Engine, database: str, table_prefix: str,
        argument: str, value: object, why: str, before: str) -> None:
    """Values at the edges of each column type: refused before anything is written, the
    error naming the argument, the column and why (``before``: what happened without the
    check)."""
    spec = typed_events(engine, database, table_prefix)
    conn = connect(queues={"typed": {"table": spec}})
    if database in HELD.get((argument, value), ()):  # type: ignore[arg-type]
        assert arrives_as_sent(conn, argument, value), f"{database} holds {value!r}"
        return
    with pytest.raises(ConfigurationError, match=rf"argument {argument}=.*column "
                                                 rf"{argument}\b.*({why}).*nothing was written"
                       ) as refused:
        publish(conn, "typed", [[], {**GOOD, argument: value}, {}],
                headers={"task": "rows.handle", "id": "x"})
    assert len(str(refused.value)) < 500, "the error quotes a value at length"
    assert get(conn, "typed") is None, "the refused publish wrote a row"


def test_decimals_dates_and_times_as_python_objects_are_checked_as_their_values(
        connect: Connect, engine: Engine, database: str, table_prefix: str) -> None:
    """Celery's JSON writes a ``Decimal``, ``date``, ``time`` or ``bytes`` argument as a
    tagged object (``{"__type__": "decimal", ...}``): each is checked and written as the
    value it stands for (bytes bound as they are: bytea reads no escapes in them), and
    arrives as a row written with SQL gives it (a number, ISO 8601 text, text)."""
    spec = typed_events(engine, database, table_prefix)
    conn = connect(queues={"typed": {"table": spec}})
    typed = {"order_id": Decimal("42"), "price": Decimal("12.50"), "due": date(2026, 12, 3),
             "starts": time(10, 0), "bin": b"a\\b"}
    with pytest.raises(ConfigurationError, match=r"argument price=Decimal\('12.345'\) does "
                                                 r"not fit column price .*3 decimal places"):
        publish(conn, "typed", [[], {**GOOD, **typed, "price": Decimal("12.345")}, {}],
                headers={"task": "rows.handle", "id": "x"})
    publish(conn, "typed", [[], {**GOOD, **typed}, {}],
            headers={"task": "rows.handle", "id": "y"})
    message = get_within(conn, "typed")
    assert {name: message.payload[1][name] for name in typed} == {
        "order_id": 42, "price": 12.5, "due": "2026-12-03", "starts": "10:00:00",
        "bin": "a\\b"}


def test_an_argument_column_holding_bytes_that_are_not_utf8_is_parked_not_replaced(
        connect: Connect, engine: Engine, database: str, table_prefix: str) -> None:
    """A binary argument column arrives as its text; bytes that are not UTF-8 have no text:
    the row is parked saying which column (as a payload that is not UTF-8 is), kept byte
    for byte, rather than run with U+FFFD in place of the bytes."""
    spec = typed_events(engine, database, table_prefix)
    conn = connect(queues={"typed": {"table": spec, "dead_letter_queue": "typed.dead"}})
    conn.default_channel.queue_declare("typed")
    for value in (b"\xffab", b"ab"):
        insert(engine, f"{table_prefix}typed", order_id=1, bin=value)
    assert get_within(conn, "typed").payload[1]["bin"] == "ab"
    parked = get_within(conn, "typed.dead")
    assert "column 'bin' is not UTF-8" in death(parked)["reason"]
    assert death(parked)["columns"]["bin"] == "base64"
    assert base64.b64decode(parked.decode()["bin"]) == b"\xffab"


@pytest.mark.parametrize("kwargs", [{"kind": "paid"}, {"order_id": None, "kind": "paid"}],
                         ids=["argument-missing", "argument-none"])
def test_null_for_a_not_null_column_is_refused_at_publish_naming_argument_and_column(
        connect: Connect, engine: Engine, table_prefix: str, kwargs: dict[str, object]) -> None:
    """A missing argument is written as NULL (row mode writes every argument column, so
    a column's default never applies): for a NOT NULL column that is refused before the
    INSERT, saying so, rather than the database's constraint error."""
    create_row_table(engine, f"{table_prefix}events",
                     "order_id VARCHAR(16) NOT NULL DEFAULT 'none', kind VARCHAR(16)")
    conn = connect(queues={"events": {"table": events(table_prefix)}})
    with pytest.raises(ConfigurationError, match=r"argument order_id=None does not fit column "
                                                 r"order_id .*NOT NULL.*nothing was written"):
        publish(conn, "events", [[], kwargs, {}], headers={"task": "rows.handle", "id": "x"})
    assert get(conn, "events") is None, "the refused publish wrote a row"


@pytest.mark.databases("sqlite")
def test_sqlite_columns_of_a_type_it_does_not_know_take_what_they_hold_as_sqlite_does(
        connect: Connect, engine: Engine, table_prefix: str) -> None:
    """SQLite gives a type name it does not know (``UUID``), and ``JSON``, numeric affinity:
    text that reads as a number is stored as that number, any other text as it is. A UUID
    arrives as sent; ``"123"`` would arrive as ``123`` and is refused."""
    table = quoted(engine, f"{table_prefix}events")
    with engine.begin() as sql:
        sql.execute(text(f"CREATE TABLE {table} (id INTEGER PRIMARY KEY AUTOINCREMENT, "
                         "attempt INTEGER NOT NULL DEFAULT 0, locked_until REAL, "
                         "available_at REAL NOT NULL DEFAULT 0, order_id UUID, kind JSON)"))
    conn = connect(queues={"events": {"table": events(table_prefix)}})
    ref = "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11"
    publish(conn, "events", [[], {"order_id": ref, "kind": "paid"}, {}],
            headers={"task": "rows.handle", "id": "y"})
    assert get_within(conn, "events").payload[1] == {"order_id": ref, "kind": "paid"}
    for argument in ("order_id", "kind"):
        with pytest.raises(ConfigurationError, match=rf"argument {argument}='123'.*as a number"):
            publish(conn, "events", [[], {"order_id": ref, "kind": "paid", argument: "123"}, {}],
                    headers={"task": "rows.handle", "id": "x"})


@pytest.mark.databases("postgresql")
def test_a_postgresql_json_column_holds_any_json_argument_exactly(
        connect: Connect, engine: Engine, table_prefix: str) -> None:
    """A ``json``/``jsonb`` argument column is written the argument's JSON text: an object
    or a number arrives as it was sent (the drivers bound neither), text stays text
    (``"123"`` arrived as ``123``); what JSON cannot hold (NaN) is refused."""
    create_row_table(engine, f"{table_prefix}events", "order_id JSONB, kind JSON")
    conn = connect(queues={"events": {"table": events(table_prefix)}})
    for sent in ({"order_id": {"n": [1, "x", None]}, "kind": "123"},
                 {"order_id": 7, "kind": [True, 2.5]}, {"order_id": None, "kind": "paid"}):
        publish(conn, "events", [[], sent, {}], headers={"task": "rows.handle", "id": "x"})
        assert get_within(conn, "events").payload[1] == sent
    with pytest.raises(ConfigurationError, match=r"argument kind=nan .*column kind .*JSON"):
        publish(conn, "events", [[], {"order_id": 1, "kind": float("nan")}, {}],
                headers={"task": "rows.handle", "id": "x"})


@pytest.mark.databases("mysql")
def test_the_transports_mariadb_sessions_are_strict_on_a_server_that_is_not(
        connect: Connect, engine: Engine, db_url: str, table_prefix: str) -> None:
    """A session whose ``sql_mode`` is not strict (as a server configured so starts every
    session) cuts a value too long for its column; the transport's sessions refuse it."""
    from sqlalchemy import create_engine
    from sqlalchemy.exc import DataError

    from kombu_sqlinbox.broker import sqlalchemy_url

    not_strict = {"connect_args": {"init_command": "SET SESSION sql_mode = ''"}}
    table = quoted(engine, f"{table_prefix}grouped")
    dialect = dialect_for(engine)
    with engine.begin() as sql:
        sql.execute(text(
            f"CREATE TABLE {table} (id {dialect.generated_id_type}, payload LONGBLOB NOT NULL, "
            f"headers LONGTEXT, grp VARCHAR(8), attempt {dialect.column_types[Role.ATTEMPT]}, "
            f"locked_until {dialect.column_types[Role.LOCKED_UNTIL]})"))
    plain = create_engine(sqlalchemy_url(db_url), **not_strict)  # type: ignore[arg-type]
    try:
        with plain.begin() as sql:  # the control: such a session cuts it silently
            sql.execute(text(f"INSERT INTO {table} (payload, grp) VALUES ('x', :grp)"),
                        {"grp": "customer-12345"})
            assert sql.execute(text(f"SELECT grp FROM {table}")).scalar_one() == "customer"
            sql.execute(text(f"DELETE FROM {table}"))
    finally:
        plain.dispose()
    spec = (TableBuilder(f"{table_prefix}grouped").id().payload().headers().group("grp")
            .attempt().locked_until().build())
    conn = connect(queues={"grouped": {"table": spec}}, engine_options=not_strict)
    with pytest.raises(DataError, match="Data too long for column 'grp'"):
        publish(conn, "grouped", {"n": 1}, headers={"group_key": "customer-12345"})
    with engine.connect() as sql:
        assert sql.execute(text(f"SELECT COUNT(*) FROM {table}")).scalar_one() == 0


@pytest.mark.databases("sqlite")
@pytest.mark.parametrize("generator", ["INTEGER PRIMARY KEY", "INTEGER PRIMARY KEY AUTOINCREMENT"])
def test_row_mode_refuses_a_sqlite_id_that_a_new_row_can_take_again(
        connect: Connect, engine: Engine, table_prefix: str, generator: str) -> None:
    """Without AUTOINCREMENT, SQLite gives a new row the id of the last one deleted; row
    mode's task ids come from ids, so two rows would run as one task: refused when the
    queue is first used, with the fix. With AUTOINCREMENT ids never repeat."""
    table = quoted(engine, f"{table_prefix}events")
    with engine.begin() as sql:
        sql.execute(text(f"CREATE TABLE {table} (id {generator}, attempt INTEGER NOT NULL "
                         "DEFAULT 0, locked_until REAL, available_at REAL NOT NULL DEFAULT 0, "
                         "order_id TEXT, kind TEXT)"))
    conn = connect(queues={"events": {"table": events(table_prefix)}})
    if "AUTOINCREMENT" in generator:
        conn.default_channel.queue_declare("events")
        return
    with pytest.raises(SchemaMismatch, match=rf"(?s){table_prefix}events.*id INTEGER "
                                             "PRIMARY KEY without AUTOINCREMENT.*same task id"):
        conn.default_channel.queue_declare("events")
