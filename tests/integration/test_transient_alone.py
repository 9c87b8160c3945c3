"""MariaDB's transient work on connections kept in autocommit: the registry's and the
bindings' writes, a count, a publish and a claim each cost their statements alone (no
BEGIN, no COMMIT), and the claim (a plain read of the first ids, then their DELETE ...
RETURNING) at its worst: a connection the server killed (the claim runs again, a publish
takes a fresh one: once each), a connection cut as a publish runs (raised, never written
twice), a lock wait timeout (retried), a caller's uncommitted publish (never waited for)
and claimers in several processes (each message taken once)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from multiprocessing.synchronize import Event
from typing import Any

import pytest
from kombu import Connection as KombuConnection
from kombu import Exchange, Queue
from sqlalchemy import event, text
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError

from kombu_sqlinbox.broker import Broker

from .conftest import Connect
from .support import broker_of, spawned, wait_for
from .test_publish import kill_publish_connection, publish_connection_id

pytestmark = pytest.mark.databases("mysql")

REPLIES = Exchange("replies", type="direct", durable=False)
MESSAGES = 2_000
CLAIMERS = 4


def reply_queue(conn: KombuConnection, name: str = "r") -> Queue:
    """A reply queue as kombu's remote control declares one: transient, auto-delete."""
    queue = Queue(name, REPLIES, routing_key=name, durable=False, auto_delete=True)
    bound: Queue = queue(conn.default_channel)
    bound.declare()
    return bound


def send(conn: KombuConnection, body: Any, name: str = "r", **kwargs: Any) -> None:
    conn.Producer().publish(body, exchange=REPLIES, routing_key=name, retry=False, **kwargs)


def transient_rows(engine: Engine, broker: Broker, name: str = "r") -> int:
    table = broker.routes.sql.names[2]
    with engine.connect() as conn:
        return int(conn.execute(text(f"SELECT COUNT(*) FROM `{table}` WHERE queue = :q"),
                                {"q": name.encode()}).scalar_one())


def bodies(queue: Queue) -> list[Any]:
    """What ``queue`` holds, taken one message at a time."""
    taken = []
    while (message := queue.get(no_ack=True)) is not None:
        taken.append(message.payload)
    return taken


@pytest.fixture
def recorded(connect: Connect) -> Iterator[tuple[KombuConnection, list[str]]]:
    """A connection, and the statements and commits its broker's engine sends from now on."""
    conn = connect()
    engine = broker_of(conn).database.engine
    sent: list[str] = []

    def statement(c: Any, cursor: Any, sql: str, *args: Any) -> None:
        sent.append(sql.split()[0].upper())

    def commit(c: Any) -> None:
        sent.append("COMMIT (SQLAlchemy)")

    reply_queue(conn)  # the tables made, the exchange known
    event.listen(engine, "before_cursor_execute", statement)
    event.listen(engine, "commit", commit)
    yield conn, sent
    event.remove(engine, "before_cursor_execute", statement)
    event.remove(engine, "commit", commit)


def test_a_reply_queues_declare_count_publish_and_claim_send_their_statements_alone(
        recorded: tuple[KombuConnection, list[str]]) -> None:
    """As ``app.control.ping`` uses its reply queue: declared anew (its registry row, its
    a count, its binding), a reply published, then claimed (a read of the first ids, their
    DELETE), and an empty claim (the read alone): one round trip each, no COMMIT."""
    conn, sent = recorded
    queue = reply_queue(conn, "fresh")
    assert sent == ["INSERT", "SELECT", "INSERT"], sent  # registry, count, binding
    send(conn, {"pong": 1}, "fresh")  # the exchange's bindings read again: they changed
    sent.clear()
    send(conn, {"pong": 2}, "fresh")
    assert sent == ["INSERT"], sent
    sent.clear()
    assert bodies(queue) == [{"pong": 1}, {"pong": 2}]
    # two claims (a read, a DELETE), then the empty one
    assert sent == ["SELECT", "DELETE", "SELECT", "DELETE", "SELECT"], sent


def test_a_claim_on_a_connection_the_server_killed_runs_again_and_loses_nothing(
        connect: Connect, engine: Engine) -> None:
    conn = connect()
    queue = reply_queue(conn)
    for n in range(3):
        send(conn, {"n": n})
    killed = kill_publish_connection(conn, engine)
    assert bodies(queue) == [{"n": 0}, {"n": 1}, {"n": 2}]
    assert publish_connection_id(conn) != killed


def test_a_transient_publish_on_a_connection_the_server_killed_lands_once(
        connect: Connect, engine: Engine) -> None:
    conn = connect()
    queue = reply_queue(conn)
    send(conn, {"n": 0})
    killed = kill_publish_connection(conn, engine)
    send(conn, {"n": 1})
    assert bodies(queue) == [{"n": 0}, {"n": 1}]
    assert publish_connection_id(conn) != killed


def test_a_transient_publish_cut_as_it_runs_is_raised_and_never_written_twice(
        db_url: str, table_prefix: str, proxy: Any, engine: Engine) -> None:
    """The network drops the publish's connection as its INSERT goes out: whether it
    landed is unknown, so it is raised (kombu's retry policy decides), not run again."""
    url = "sqlinbox+" + proxy.url(db_url)
    conn = KombuConnection(url, transport_options={"table_prefix": table_prefix})
    try:
        reply_queue(conn)
        broker = broker_of(conn)
        cut: list[bool] = []

        def before(c: Any, cursor: Any, sql: str, *args: Any) -> None:
            if sql.startswith("INSERT") and "transient" in sql and not cut:
                cut.append(True)
                proxy.cut()

        event.listen(broker.database.engine, "before_cursor_execute", before)
        try:
            with pytest.raises(DBAPIError) as raised:
                send(conn, {"n": 0})
        finally:
            event.remove(broker.database.engine, "before_cursor_execute", before)
        assert cut and raised.value.connection_invalidated
        assert transient_rows(engine, broker) <= 1
    finally:
        conn.release()


def test_a_claim_whose_delete_times_out_on_a_lock_runs_again_and_takes_the_message_once(
        connect: Connect, engine: Engine) -> None:
    """Another transaction holds the message's row (locked by a read of its own) past the
    DELETE's lock wait: MariaDB's error 1205 is retried, and the retry takes it once the
    lock is gone."""
    conn = connect()
    queue = reply_queue(conn)
    send(conn, {"n": 0})
    broker = broker_of(conn)
    pool = broker.database.publish_pool
    assert pool is not None
    pooled = pool.connect()
    cursor = pooled.cursor()
    cursor.execute("SET SESSION innodb_lock_wait_timeout = 1")
    cursor.close()
    pooled.close()
    table = broker.routes.sql.names[2]
    deletes: list[str] = []
    event.listen(broker.database.engine, "before_cursor_execute",
                 lambda c, cur, sql, *a: deletes.append(sql) if sql.startswith("DELETE") else None)
    holder = engine.connect()
    holder.execute(text(f"SELECT id FROM `{table}` WHERE queue = :q FOR UPDATE"),
                   {"q": b"r"}).all()
    release = threading.Timer(1.5, holder.rollback)
    release.start()
    try:
        began = time.monotonic()
        message = queue.get(no_ack=True)
        waited = time.monotonic() - began
    finally:
        release.join()
        holder.close()
    assert message is not None and message.payload == {"n": 0}
    assert len(deletes) >= 2 and waited >= 1.0, (deletes, waited)
    assert queue.get(no_ack=True) is None


def test_a_claim_never_waits_for_a_callers_uncommitted_publish(
        connect: Connect, engine: Engine) -> None:
    """A caller's transaction published into the queue (its row locked, uncommitted) and
    goes on: the claim takes the committed message at once and leaves the other to the
    claim after the caller's commit."""
    conn = connect()
    queue = reply_queue(conn)
    send(conn, {"n": 0})
    broker = broker_of(conn)
    table = broker.routes.sql.names[2]
    with engine.connect() as caller:
        caller.execute(text(f"INSERT INTO `{table}` (queue, payload, headers) "
                            "VALUES (:q, :payload, NULL)"), {"q": b"r", "payload": b"{}"})
        began = time.monotonic()
        assert [m.payload for m in [queue.get(no_ack=True)] if m] == [{"n": 0}]
        assert queue.get(no_ack=True) is None
        assert time.monotonic() - began < 1.0
        caller.commit()
    assert bodies(queue) == ["{}"]  # the caller's row (no headers: its body as is)


def claim_all(url: str, options: dict[str, Any], name: str, ready: Event, stop: Event,
              results: Any) -> None:
    """A claimer process: claim ``name`` ten at a time until stopped; its message numbers."""
    with KombuConnection(url, transport_options=options) as conn:
        reply_queue(conn, name)
        broker = broker_of(conn)
        table = broker.table(name)
        taken: list[int] = []
        ready.set()
        while not stop.is_set():
            taken += [int(row.payload) for row in broker.transient.claim(table, 10)]
        results.put(taken)


def test_claimers_in_several_processes_take_each_message_once(
        connect: Connect, broker_url: str, table_prefix: str, engine: Engine) -> None:
    """Four processes claim one queue while this one publishes into it: every message is
    taken, by one claimer, once (claimers reading the same ids race at the DELETE)."""
    conn = connect()
    reply_queue(conn, "shared")
    broker = broker_of(conn)
    options = {"table_prefix": table_prefix}
    with spawned(claim_all, [(broker_url, options, "shared")] * CLAIMERS) as results:
        for n in range(MESSAGES):
            broker.transient.put("shared", str(n).encode(), None, None)
        wait_for(lambda: transient_rows(engine, broker, "shared") == 0,
                 "every message claimed", timeout=60)
    taken = [n for each in results for n in each]
    assert sorted(taken) == list(range(MESSAGES))
    assert sum(1 for each in results if each) >= 2, "the claimers did not race"
