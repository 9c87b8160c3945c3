"""Start-up schema checks: a table that does not match its declaration fails with the fix."""

from __future__ import annotations

import re

import pytest
from kombu import Connection, Exchange, Queue
from sqlalchemy import inspect, text
from sqlalchemy.engine import Engine

from kombu_sqlinbox import Role, SchemaMismatch, default_table
from kombu_sqlinbox.dialects import RoutingStatements, dialect_for

from .conftest import Connect
from .support import DEAD_LETTERS, get_within, publish, quoted, table_of

#: a payload column type that cannot hold a Celery message, per database
WRONG_PAYLOAD = {"postgresql": "INTEGER NOT NULL", "mysql": "TEXT NOT NULL",
                 "sqlite": "INTEGER NOT NULL"}


def fixing_ddl(message: str) -> list[str]:
    """The statements a SchemaMismatch message proposes (each follows a line ending in ':')."""
    return [s.strip() for s in re.findall(r":\n(.+?);(?:\n|$)", message, flags=re.S)]


def run_ddl(engine: Engine, statements: list[str]) -> None:
    with engine.begin() as conn:
        for statement in statements:
            for part in statement.split(";\n"):
                conn.execute(text(part))


def test_missing_column_fails_at_declaration_with_the_fixing_ddl(
    connect: Connect, engine: Engine, table_prefix: str,
) -> None:
    connect().default_channel.queue_declare("jobs")
    table = table_of("jobs", table_prefix)
    with engine.begin() as conn:
        conn.execute(text(f"ALTER TABLE {quoted(engine, table)} DROP COLUMN attempt"))
    later = connect(polling_interval=0.06)  # a fresh broker: the check runs on first use
    with pytest.raises(SchemaMismatch) as failure:
        later.default_channel.queue_declare("jobs")
    message = str(failure.value)
    assert table in message
    assert "'attempt'" in message
    assert "role attempt" in message
    (ddl,) = fixing_ddl(message)
    assert "ADD COLUMN" in ddl
    run_ddl(engine, [ddl])
    publish(later, "jobs", {"fixed": True})
    assert get_within(later, "jobs").decode() == {"fixed": True}


def test_wrong_payload_type_fails_at_declaration_with_the_fixing_ddl(
    connect: Connect, engine: Engine, table_prefix: str, database: str,
) -> None:
    table = table_of("jobs", table_prefix)
    dialect = dialect_for(engine)
    right = dialect.column_types[Role.PAYLOAD]
    ddl = [statement.replace(right, WRONG_PAYLOAD[database])
           for statement in dialect.create_ddl(default_table(table))]
    run_ddl(engine, ddl)
    conn = connect()
    with pytest.raises(SchemaMismatch) as failure:
        conn.default_channel.queue_declare("jobs")
    message = str(failure.value)
    assert table in message
    assert "'payload'" in message
    assert "role payload" in message
    (fix,) = fixing_ddl(message)
    assert right.split()[0] in fix
    if database == "sqlite":
        return  # SQLite cannot change a column's type: the message says to recreate the table
    run_ddl(engine, [fix])
    publish(conn, "jobs", {"fixed": True})
    assert get_within(conn, "jobs").decode() == {"fixed": True}


def test_create_tables_off_and_no_routing_tables_refuses_a_transient_queue_with_their_ddl(
    connect: Connect, engine: Engine, table_prefix: str,
) -> None:
    conn = connect(create_tables=False)
    with pytest.raises(SchemaMismatch) as failure:
        conn.default_channel.queue_declare("replies", durable=False, auto_delete=True)
    message = str(failure.value)
    for table in ("queues", "bindings", "transient"):
        assert table_prefix + table in message
    run_ddl(engine, [message.split("create them with:\n", 1)[1].rstrip(";")])
    conn.default_channel.queue_declare("replies", durable=False, auto_delete=True)
    conn.Producer().publish({"transient": True}, routing_key="replies")
    assert get_within(conn, "replies").decode() == {"transient": True}


def without_routing_tables(connect: Connect, engine: Engine, table_prefix: str) -> Connection:
    """A connection that does not create tables, after the routing tables were dropped (a
    queue table of "jobs" made first)."""
    connect().default_channel.queue_declare("jobs")  # the queue's own table
    for table in RoutingStatements.tables(table_prefix):
        with engine.begin() as conn:
            conn.execute(text(f"DROP TABLE {quoted(engine, table)}"))
    return connect(create_tables=False)


def test_without_routing_tables_exchanges_route_within_the_process(
    connect: Connect, engine: Engine, table_prefix: str,
) -> None:
    """As in kombu's other virtual transports: bindings declared here route here, a
    broadcast reaches nobody, and nothing fails for want of the routing tables."""
    conn = without_routing_tables(connect, engine, table_prefix)
    jobs = Exchange("jobs", type="direct")
    conn.Producer().publish({"routed": "here"}, exchange=jobs, routing_key="jobs",
                            declare=[Queue("jobs", jobs, "jobs")])
    conn.Producer().publish({"nobody": 1}, exchange=Exchange("all", type="fanout"),
                            declare=[Exchange("all", type="fanout")])
    message = get_within(conn, "jobs")
    assert message.decode() == {"routed": "here"}
    message.ack()
    conn.default_channel.queue_delete("jobs")
    assert not set(RoutingStatements.tables(table_prefix)) & set(
        inspect(engine).get_table_names())


def test_bindings_made_before_the_routing_tables_were_there_route_once_they_are(
    connect: Connect, engine: Engine, table_prefix: str,
) -> None:
    """The routing tables created while a process runs (by its service's migrations) get
    the bindings it made without them, whose queues go on getting their messages."""
    conn = without_routing_tables(connect, engine, table_prefix)
    jobs = Exchange("jobs", type="direct")
    conn.Producer().publish({"n": 1}, exchange=jobs, routing_key="jobs",
                            declare=[Queue("jobs", jobs, "jobs")])
    connect(polling_interval=0.07).default_channel.broker.routes.available()  # created
    conn.Producer().publish({"n": 2}, exchange=jobs, routing_key="jobs")
    for n in (1, 2):
        message = get_within(conn, "jobs")
        assert message.decode() == {"n": n}
        message.ack()


def test_create_tables_off_and_no_table_gives_the_create_ddl(
    connect: Connect, engine: Engine, table_prefix: str,
) -> None:
    conn = connect(create_tables=False)
    with pytest.raises(SchemaMismatch) as failure:
        conn.default_channel.queue_declare("jobs")
    message = str(failure.value)
    table = table_of("jobs", table_prefix)
    assert table in message
    (ddl,) = fixing_ddl(message)
    assert ddl.startswith("CREATE TABLE")
    run_ddl(engine, [ddl])
    publish(conn, "jobs", {"created": True})
    assert get_within(conn, "jobs").decode() == {"created": True}


def test_create_tables_off_and_no_dead_letter_table_fails_when_the_queue_is_first_used(
    connect: Connect, engine: Engine, table_prefix: str,
) -> None:
    """Not when the first message is parked: the queue's dead-letter table is checked with
    the queue's own."""
    connect().default_channel.queue_declare("jobs")  # the queue's own table exists
    conn = connect(create_tables=False, **DEAD_LETTERS)
    with pytest.raises(SchemaMismatch) as failure:
        conn.default_channel.queue_declare("jobs")
    message = str(failure.value)
    assert table_of("jobs.dead", table_prefix) in message
    assert "create_tables is off" in message
    run_ddl(engine, fixing_ddl(message))
    publish(conn, "jobs", {"parked": True})
    get_within(conn, "jobs").reject(requeue=False)
    assert get_within(conn, "jobs.dead").decode() == {"parked": True}


def test_dead_letter_queues_naming_each_other_are_both_created(
    connect: Connect, engine: Engine, table_prefix: str,
) -> None:
    conn = connect(queues={"jobs": {"dead_letter_queue": "jobs.dead"},
                           "jobs.dead": {"dead_letter_queue": "jobs"}})
    conn.default_channel.queue_declare("jobs")
    assert {table_of("jobs", table_prefix), table_of("jobs.dead", table_prefix)} <= set(
        inspect(engine).get_table_names())
