"""What keeps an idle consumer quick and cheap: adaptive polling, claims on the LISTEN
connection, and the per-queue ``synchronous_commit`` of publishes (figures:
``bench/latency.py``; these tests prove the behaviour)."""

from __future__ import annotations

import contextlib
import logging
import select
import time
from collections.abc import Callable
from itertools import pairwise
from typing import Any

import pytest
from kombu import Consumer, Queue
from sqlalchemy import event, text
from sqlalchemy.engine import Engine

from kombu_sqlinbox import binding
from kombu_sqlinbox.database import Database
from kombu_sqlinbox.wakeups import Wakeup
from tests.integration.conftest import Connect
from tests.integration.support import broker_of, publish, run_prepared, table_of, wait_for
from tests.tcp_proxy import Proxy

#: a consumer that only polls (no NOTIFY, no same-host signal), backing off quickly
BACKOFF = {"notify": False, "polling_interval": 0.4, "polling_interval_min": 0.01,
           "polling_backoff": 2, "sweep_interval": 600}


def acking(got: list[Any]) -> Callable[[Any, Any], None]:
    """A consumer callback keeping each body and acking its message."""
    def callback(body: Any, message: Any) -> None:
        got.append(body)
        message.ack()
    return callback


def claim_rounds(engine: Engine) -> list[float]:
    """When each transaction began on ``engine`` from now on (an idle consumer's
    transactions are its claim rounds)."""
    began: list[float] = []
    event.listen(engine, "begin", lambda conn: began.append(time.monotonic()))
    return began


def test_polling_backs_off_when_idle_and_speeds_up_after_a_message(
        connect: Connect) -> None:
    consumer_conn = connect(**BACKOFF)
    publisher = connect()  # another broker: its publish does not poke the consumer's
    publisher.default_channel.queue_declare("jobs")
    got: list[Any] = []
    with Consumer(consumer_conn.default_channel, [Queue("jobs")], accept=["json"],
                  callbacks=[acking(got)]):
        rounds = claim_rounds(broker_of(consumer_conn).engine)
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            consumer_conn.drain_events(timeout=2.5)
        gaps = [b - a for a, b in pairwise(rounds)]
        assert gaps[0] < 0.25, gaps  # quick at first ...
        # ... then the ceiling (0.4 s; a round's own time on a loaded machine on top, and
        # well short of the 1.28 s a back-off without a ceiling reaches in the window)
        assert all(0.3 < gap < 0.9 for gap in gaps[-3:]), gaps
        late = [moment for moment in rounds if moment > started + 1.5]
        rate = (len(late) - 1) / (late[-1] - late[0])
        assert rate < 1 / 0.3, f"{rate:.1f} claim rounds/s when idle: {gaps}"
        publish(publisher, "jobs", {"i": 1})
        consumer_conn.drain_events(timeout=5)
        delivered = time.monotonic()
        assert got == [{"i": 1}]
        with pytest.raises(TimeoutError):
            consumer_conn.drain_events(timeout=0.6)
        after = [moment for moment in rounds if moment > delivered]
        # the waits start again at 0.01 s (four rounds take about 0.15 s of them); at the
        # ceiling there would be at most two
        assert len(after) >= 4, "no quick claims right after the delivery"


@pytest.mark.parametrize("database", ["postgresql"])
def test_synchronous_commit_off_applies_to_that_queues_publishes_alone(
        connect: Connect, engine: Engine, table_prefix: str) -> None:
    """A trigger records the setting each publish's transaction ran with, and on which
    session: one pooled connection serves the lossy queue, then the other queue."""
    one_connection = {"engine_options": {"pool_size": 1, "max_overflow": 0}}
    conn = connect(queues={"lossy": {"synchronous_commit": False}}, **one_connection)
    for queue in ("lossy", "kept"):
        conn.default_channel.queue_declare(queue)
    seen = f"{table_prefix}seen"
    with engine.begin() as db:
        db.execute(text(f"CREATE TABLE {seen} (tbl TEXT, setting TEXT, pid INTEGER)"))
        db.execute(text(
            f"CREATE FUNCTION {seen}_record() RETURNS trigger AS $$ BEGIN "
            f"INSERT INTO {seen} VALUES (TG_TABLE_NAME, "
            "current_setting('synchronous_commit'), pg_backend_pid()); RETURN NEW; END "
            "$$ LANGUAGE plpgsql"))
        for queue in ("lossy", "kept"):
            db.execute(text(f"CREATE TRIGGER {seen}_{queue} AFTER INSERT ON "
                            f"{table_of(queue, table_prefix)} FOR EACH ROW EXECUTE "
                            f"FUNCTION {seen}_record()"))
    try:
        for queue in ("lossy", "kept", "lossy", "kept"):
            conn.Producer().publish({"q": queue}, routing_key=queue)
        with engine.connect() as caller:  # a bound publish: the caller's transaction
            token = binding.BOUND.set(caller)
            try:
                conn.Producer().publish({"q": "bound"}, routing_key="lossy")
                bound_setting = caller.execute(
                    text("SELECT current_setting('synchronous_commit')")).scalar_one()
            finally:
                binding.BOUND.reset(token)
            caller.commit()
        with engine.connect() as db:
            rows = db.execute(text(f"SELECT tbl, setting, pid FROM {seen}")).all()
    finally:
        with engine.begin() as db:
            db.execute(text(f"DROP TABLE {seen}"))
            db.execute(text(f"DROP FUNCTION {seen}_record() CASCADE"))
    lossy, kept = table_of("lossy", table_prefix), table_of("kept", table_prefix)
    assert [(tbl, setting) for tbl, setting, _ in rows] == [
        (lossy, "off"), (kept, "on"), (lossy, "off"), (kept, "on"), (lossy, "on")]
    assert len({pid for _, _, pid in rows[:4]}) == 1  # one pooled session throughout
    assert bound_setting == "on"  # the caller's transaction keeps its own durability


def listening_consumer(connect: Connect, queue: str) -> tuple[Any, Consumer, list[Any]]:
    """A consumer whose broker's LISTEN connection is up (the first wait connects it)."""
    conn = connect(polling_interval=5)
    conn.default_channel.queue_declare(queue)
    got: list[Any] = []
    consumer = Consumer(conn.default_channel, [Queue(queue)], accept=["json"],
                        callbacks=[acking(got)])
    consumer.consume()
    wait_for(lambda: idle_until_listening(conn), "the LISTEN connection")
    return conn, consumer, got


def idle_until_listening(conn: Any) -> bool:
    """One idle wait (which connects the LISTEN connection); whether it is up."""
    with contextlib.suppress(TimeoutError):
        conn.drain_events(timeout=0.5)
    return broker_of(conn).wakeup._listener is not None


def listener_pid(wakeup: Wakeup) -> int:
    assert wakeup._session is not None
    return int(wakeup._session.execute(text("SELECT pg_backend_pid()")).scalar_one())


@pytest.mark.parametrize("database", ["postgresql"])
def test_a_claim_on_a_dead_listen_connection_goes_to_the_pool(
        connect: Connect, engine: Engine) -> None:
    conn, consumer, got = listening_consumer(connect, "jobs")
    wakeup = broker_of(conn).wakeup
    dead = listener_pid(wakeup)
    with engine.connect() as db:
        db.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": dead})
        db.commit()
    publish(connect(), "jobs", {"i": 1})
    message = conn.default_channel.basic_get("jobs")  # a claim, before any wait
    assert message is not None and message.payload == {"i": 1}
    message.ack()
    assert wakeup._listener is None  # dropped; the next wait connects another
    wait_for(lambda: idle_until_listening(conn), "a new LISTEN connection")
    assert listener_pid(wakeup) != dead
    publish(connect(), "jobs", {"i": 2})
    conn.drain_events(timeout=5)
    assert got == [{"i": 2}]  # nothing twice, nothing lost
    assert conn.default_channel.basic_get("jobs") is None
    consumer.cancel()


@pytest.mark.parametrize("database", ["sqlite", "mysql"])
def test_a_publish_between_a_consumers_first_claim_and_its_first_wait_wakes_it(
        db_url: str) -> None:
    """The same-host signal's socket is bound as the consumer registers, before its first
    claim: a publish committed by another process after that claim and before the
    consumer's first wait wakes the wait (bound at the wait, the socket was not there for
    the publish's byte, and the consumer slept its whole polling interval)."""
    consumer_db, publisher_db = Database.open(db_url), Database.open(db_url)
    consumer, publisher = Wakeup(consumer_db), Wakeup(publisher_db)
    try:
        consumer.listen(None)  # registered, as where there is no NOTIFY; its first claim
        # finds nothing
        publisher.published()  # another process's commit, before the consumer waits
        started = time.monotonic()
        consumer.wait(10.0)
        assert time.monotonic() - started < 5.0, "the first wait missed the publish"
    finally:
        consumer.close()
        publisher.close()
        consumer_db.engine.dispose()
        publisher_db.engine.dispose()


@pytest.mark.parametrize("database", ["postgresql"])
def test_a_listen_connection_that_breaks_while_it_is_set_up_is_given_up_then_made_anew(
        db_url: str, proxy: Proxy, caplog: pytest.LogCaptureFixture) -> None:
    """The pooled connection the listener takes broke while it waited in the pool (a server
    restart, a firewall): its LISTEN fails, the connection is closed as it is (detached
    from the pool, nothing else would close it; no rollback is tried on it, whose failure
    would be logged as an error), the consumer polls with a warning, and its next wait
    connects a listener on a new connection."""
    database = Database.open(proxy.url(db_url))
    wakeup = Wakeup(database, local=False)
    taken: list[Any] = []
    event.listen(database.engine, "checkout", lambda dbapi, record, fairy: taken.append(dbapi))
    caplog.set_level(logging.WARNING)
    try:
        with database.engine.connect() as conn:  # one connection waits in the pool
            conn.execute(text("SELECT 1"))
        proxy.cut()  # and breaks there
        wakeup.listen("jobs")
        assert wakeup.sources() == [wakeup._read], "a broken listener is waited on"
        assert "LISTEN connection failed" in caplog.text
        assert taken[-1].closed
        assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
        sources = wakeup.sources()
        assert wakeup._listener is not None and sources == [wakeup._read, wakeup._listener]
    finally:
        wakeup.close()
        database.engine.dispose()


@pytest.mark.parametrize("database", ["postgresql"])
def test_a_notification_that_arrives_during_a_claim_is_a_pending_wake_up(
        connect: Connect, engine: Engine) -> None:
    """psycopg2 reads it with the claim's reply, off the socket the wait selects on: the
    claim pokes the in-process pipe instead, so the next wait returns at once."""
    conn, consumer, _ = listening_consumer(connect, "jobs")
    wakeup = broker_of(conn).wakeup
    channel = broker_of(conn).dialect.channel(broker_of(conn).table("jobs").spec)
    with engine.connect() as db:
        db.execute(text("SELECT pg_notify(:channel, '')"), {"channel": channel})
        db.commit()
    wait_for(lambda: select.select([wakeup._listener], [], [], 0.05)[0], "the notification")
    assert conn.default_channel.basic_get("jobs") is None  # the claim reads it
    assert select.select([wakeup._read], [], [], 0)[0], "the pipe was not poked"
    consumer.cancel()


@pytest.mark.parametrize("database", ["postgresql"])
def test_a_consumer_with_a_backlog_claims_on_the_listen_connection_from_its_first_claim(
        connect: Connect) -> None:
    """It never waits while rows are ready, so its first claim connects the LISTEN
    connection rather than leave every claim of the backlog to the pool."""
    publisher = connect()
    for i in range(30):
        publish(publisher, "jobs", {"i": i})
    conn = connect(polling_interval=5)
    broker = broker_of(conn)
    claimed_on: list[Any] = []

    # the claim (alone, or carrying the last claim's acks) as text, or run by the name
    # psycopg2's LISTEN session prepared it under
    statements = broker.dialect.statements(broker.table("jobs").spec)
    assert statements.claim_completing is not None
    claims = (statements.claim[0], statements.claim_completing)
    names = tuple(run_prepared(claim) for claim in claims)
    texts = tuple(claim.text.split()[0] for claim in claims)

    def record(connection: Any, cursor: Any, statement: str, *rest: Any) -> None:
        if ((statement.startswith(texts) and "RETURNING" in statement)
                or statement.startswith(names)):
            claimed_on.append(connection.connection.dbapi_connection)

    event.listen(broker.engine, "before_cursor_execute", record)
    got: list[Any] = []
    with Consumer(conn.default_channel, [Queue("jobs")], accept=["json"],
                  callbacks=[acking(got)]) as consumer:
        consumer.qos(prefetch_count=10)
        while len(got) < 30:
            conn.drain_events(timeout=5)
    assert sorted(body["i"] for body in got) == list(range(30))
    assert len(claimed_on) >= 3
    assert all(on is broker.wakeup._listener for on in claimed_on), claimed_on
