"""Queue management: sizes, purge, delete."""

from __future__ import annotations

from sqlalchemy import inspect
from sqlalchemy.engine import Engine

from kombu_sqlinbox import TableBuilder

from .conftest import Connect
from .support import count_rows, get_within, publish, rows, settled, table_of


def test_message_count_is_the_number_of_waiting_messages(connect: Connect) -> None:
    conn = connect()
    channel = conn.default_channel
    for n in range(3):
        publish(conn, "jobs", {"n": n})
    assert channel.queue_declare("jobs").message_count == 3
    assert channel._size("jobs") == 3
    held = get_within(conn, "jobs")
    assert channel.queue_declare("jobs", passive=True).message_count == 2
    held.ack()


def test_purge_deletes_waiting_messages_and_returns_their_count(
    connect: Connect, engine: Engine, table_prefix: str,
) -> None:
    conn = connect()
    for n in range(4):
        publish(conn, "jobs", {"n": n})
    held = get_within(conn, "jobs")
    assert conn.default_channel.queue_purge("jobs") == 3
    assert conn.default_channel.queue_declare("jobs", passive=True).message_count == 0
    held.ack()
    settled(conn)
    assert rows(engine, table_of("jobs", table_prefix)) == []


def test_queue_delete_drops_a_table_the_transport_created(
    connect: Connect, engine: Engine, table_prefix: str,
) -> None:
    conn = connect()
    publish(conn, "jobs", {"n": 1})
    table = table_of("jobs", table_prefix)
    assert inspect(engine).has_table(table)
    conn.default_channel.queue_delete("jobs")
    assert not inspect(engine).has_table(table)


def test_deleting_a_queue_that_is_not_there_does_nothing(
    connect: Connect, engine: Engine, table_prefix: str,
) -> None:
    """As on RabbitMQ and Redis, also where the transport creates no tables: a reply
    queue Celery deletes after its caller read the replies is gone already (kombu
    deletes it once per collected reply batch)."""
    connect().default_channel.queue_declare("replies", durable=False, auto_delete=True)
    channel = connect(create_tables=False).default_channel
    for name in ("replies", "replies", "never.declared"):
        channel.queue_delete(name)
    assert not inspect(engine).has_table(table_of("never.declared", table_prefix))


def test_queue_delete_only_empties_a_declared_table(
    connect: Connect, engine: Engine, table_prefix: str,
) -> None:
    """A declared table belongs to the service (its migrations): never dropped."""
    table = f"{table_prefix}declared"
    spec = TableBuilder(table).id().payload().headers().attempt().locked_until().build()
    conn = connect(queues={"jobs": {"table": spec}})
    publish(conn, "jobs", {"n": 1})
    conn.default_channel.queue_delete("jobs")
    assert inspect(engine).has_table(table)
    assert count_rows(engine, table) == 0

