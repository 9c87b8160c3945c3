"""Exchanges shared by every process: bindings in the database, transient queues, expiry.

Connections with different transport options get different per-process brokers, each
with its own caches: a message that reaches a queue bound through another one went
through the database, as between two processes.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
from kombu import Connection, Consumer, Exchange, Queue
from kombu.exceptions import ChannelError
from kombu.transport.virtual.exchange import TopicExchange
from sqlalchemy import bindparam, inspect, text
from sqlalchemy.engine import Engine

from celery_ext.binding import bind
from kombu_sqlinbox import ConfigurationError, SchemaMismatch, lapsing, routing
from kombu_sqlinbox.dialects import RoutingStatements, dialect_for
from kombu_sqlinbox.tables import table_name_for_queue

from .conftest import Connect
from .support import (
    broker_of,
    earlier_routing_ddl,
    get,
    get_within,
    quoted,
    statements_run,
    wait_for,
)
from .test_kombu import EventLoop

FANOUT = Exchange("broadcast", type="fanout", durable=False)
TOPIC = Exchange("events", type="topic", durable=False)
REPLIES = Exchange("replies", type="direct", durable=False)
#: the x-expires of a queue a test keeps alive (seconds): its consumer renews it every
#: quarter of it, so a renewal may come three quarters of a second late (a loaded machine's
#: stalled thread or slow commit) before it expires
KEPT_EXPIRES = 1.0
#: the x-message-ttl of a queue whose later message must be delivered: long enough to
#: consume it within on a loaded machine
KEPT_TTL = 1.0


def other(connect: Connect, n: int, **options: Any) -> Connection:
    """A connection with a broker of its own, as another process would have."""
    return connect(**{"polling_interval": 0.05 + n / 1000, **options})


def transient(name: str, exchange: Exchange | None = None, routing_key: str = "",
              **kwargs: Any) -> Queue:
    return Queue(name, exchange, routing_key=routing_key, durable=False, auto_delete=True,
                 **kwargs)


def declare(conn: Connection, queue: Queue) -> Queue:
    bound = queue(conn.default_channel)
    bound.declare()
    return bound


def count(engine: Engine, prefix: str, table: str, where: str = "", **params: Any) -> int:
    name = quoted(engine, prefix + table)
    with engine.connect() as conn:
        return int(conn.execute(text(f"SELECT COUNT(*) FROM {name} {where}"), params)
                   .scalar_one())


def test_fanout_reaches_queues_bound_by_other_processes_in_one_statement(
    connect: Connect,
) -> None:
    consumers = [other(connect, n) for n in range(3)]
    for n, conn in enumerate(consumers):
        declare(conn, transient(f"node{n}.pidbox", FANOUT))
    publisher = other(connect, 9)
    producer = publisher.Producer()
    producer.publish({"warm": True}, exchange=FANOUT, declare=[FANOUT])  # bindings cached
    for n, conn in enumerate(consumers):
        assert get_within(conn, f"node{n}.pidbox").payload == {"warm": True}
    with statements_run(broker_of(publisher).engine) as seen:
        producer.publish({"ping": 1}, exchange=FANOUT)
    writes = [sql for sql in seen if "INSERT" in sql.upper()]
    assert len(writes) == 1, seen
    for n, conn in enumerate(consumers):
        assert get_within(conn, f"node{n}.pidbox").payload == {"ping": 1}
        assert get(conn, f"node{n}.pidbox") is None  # exactly one copy each


@pytest.mark.parametrize("routing_key", [
    "task.succeeded", "worker.heartbeat", "task", "task.a.b", "worker.x.heartbeat", "x"])
def test_topic_routes_as_kombus_own_topic_exchange(connect: Connect, routing_key: str) -> None:
    patterns = {"tasks": "task.#", "beats": "*.heartbeat", "exact": "worker.heartbeat",
                "everything": "#"}
    consumer = other(connect, 1)
    for queue, pattern in patterns.items():
        declare(consumer, transient(queue, TOPIC, pattern))
    publisher = other(connect, 2)
    publisher.Producer().publish({"key": routing_key}, exchange=TOPIC,
                                 routing_key=routing_key, declare=[TOPIC])
    topic = TopicExchange(None)
    expected = {queue for queue, pattern in patterns.items()
                if re.match(topic.key_to_pattern(pattern), routing_key)}
    assert expected  # "everything" at least
    got = {queue for queue in patterns if get(consumer, queue) is not None}
    assert got == expected


def test_direct_reply_reaches_a_queue_only_the_caller_bound(
    connect: Connect, engine: Engine, table_prefix: str,
) -> None:
    caller, replier = other(connect, 1), other(connect, 2)
    declare(caller, transient("ticket.reply", REPLIES, "ticket"))
    producer = replier.Producer()
    producer.publish({"reply": "pong"}, exchange=REPLIES, routing_key="ticket",
                     declare=[REPLIES])
    producer.publish({"reply": "lost"}, exchange=REPLIES, routing_key="nobody")
    assert get_within(caller, "ticket.reply").payload == {"reply": "pong"}
    assert get(caller, "ticket.reply") is None
    # an unroutable message is dropped, as AMQP drops it: no catch-all queue appears
    assert count(engine, table_prefix, "transient") == 0
    assert not [t for t in inspect(engine).get_table_names()
                if t.startswith(table_prefix) and "undeliver" in t]


def test_durable_queue_bound_to_a_fanout_elsewhere_gets_a_copy(connect: Connect) -> None:
    jobs = Queue("audit", Exchange("audited", type="fanout"), durable=True)
    consumer, publisher = other(connect, 1), other(connect, 2)
    declare(consumer, jobs)
    publisher.Producer().publish({"audit": 1}, exchange=jobs.exchange,
                                 declare=[jobs.exchange])
    message = get_within(consumer, "audit")
    assert message.payload == {"audit": 1}
    assert not broker_of(consumer).table("audit").transient
    message.ack()


def test_direct_publish_reaches_queues_bound_here_and_elsewhere(connect: Connect) -> None:
    """A publisher with a binding of its own for the exchange and key still reaches the
    queues other processes bound to them: the union, as on an AMQP broker."""
    orders = Exchange("orders", type="direct")
    consumer, publisher = other(connect, 1), other(connect, 2)
    declare(consumer, Queue("audit", orders, "created"))
    declare(consumer, transient("watch", orders, "created"))
    declare(publisher, Queue("billing", orders, "created"))
    publisher.Producer().publish({"order": 1}, exchange=orders, routing_key="created")
    for conn, queue in ((publisher, "billing"), (consumer, "audit"), (consumer, "watch")):
        message = get_within(conn, queue)
        assert message.payload == {"order": 1}, queue
        message.ack()
        assert get(conn, queue) is None, queue  # one copy each


AUDITED = Exchange("audited", type="fanout")


def test_a_queue_bound_elsewhere_reaches_a_warm_publisher_within_the_bindings_cache(
    connect: Connect, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The documented window: a publisher reads an exchange's bindings at most every
    ``BINDINGS_CACHE`` seconds, so a queue another process bound just now misses its
    publishes until then. The routing's clock is the test's: how long the binder's
    declaration takes on a loaded machine does not move the window."""
    now = [time.monotonic()]
    monkeypatch.setattr(lapsing, "time", SimpleNamespace(monotonic=lambda: now[0]))
    publisher, binder = other(connect, 1), other(connect, 2)
    producer = publisher.Producer()
    producer.publish({"n": 0}, exchange=AUDITED, declare=[AUDITED])  # bindings read
    declare(binder, Queue("late", AUDITED))
    now[0] += routing.BINDINGS_CACHE - 0.1
    producer.publish({"n": 1}, exchange=AUDITED)
    assert get(binder, "late") is None
    now[0] += 0.2  # the cache's age passing is the point
    producer.publish({"n": 2}, exchange=AUDITED)
    assert get_within(binder, "late").payload == {"n": 2}


def test_a_binding_made_in_the_publishing_transaction_routes_at_once(
    connect: Connect, engine: Engine,
) -> None:
    """A queue bound in the database transaction a publish is made in gets the message,
    whichever connection of the process bound it, the publisher's cache warm or not."""
    publisher, binder = other(connect, 1), other(connect, 2)
    producer = publisher.Producer()
    producer.publish({"n": 0}, exchange=AUDITED, declare=[AUDITED])  # bindings read
    with engine.connect() as caller:
        caller.begin()
        with bind(caller):
            declare(binder, Queue("late", AUDITED))
            producer.publish({"n": 1}, exchange=AUDITED)
        caller.commit()
    assert get_within(binder, "late").payload == {"n": 1}


@pytest.mark.parametrize("how", ["queue x-message-ttl", "message expiration"])
def test_expired_message_is_never_delivered_and_is_swept(
    connect: Connect, engine: Engine, table_prefix: str, how: str,
) -> None:
    queue_ttl = {"message_ttl": 0.3} if how.startswith("queue") else {}
    message_ttl = {} if queue_ttl else {"expiration": 0.3}
    conn = other(connect, 1, sweep_interval=0.05)
    declare(conn, transient("short", REPLIES, "short", **queue_ttl))
    producer = conn.Producer()
    producer.publish({"n": 1}, exchange=REPLIES, routing_key="short", declare=[REPLIES],
                     **message_ttl)
    producer.publish({"n": 2}, exchange=REPLIES, routing_key="short")  # outlives the TTL
    assert count(engine, table_prefix, "transient") == 2
    time.sleep(0.4)  # the TTL passing is the point
    if queue_ttl:
        assert get(conn, "short") is None
    else:
        assert get(conn, "short").payload == {"n": 2}  # type: ignore[union-attr]
        assert get(conn, "short") is None
    broker_of(conn).sweep()
    assert count(engine, table_prefix, "transient") == 0


def test_a_durable_queues_message_ttl_applies_to_every_publisher(
    connect: Connect, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``x-message-ttl`` is the queue's, registered where every process sees it: a
    publisher that never declared the queue applies it too (within the bindings cache's
    two seconds of the declaration)."""
    monkeypatch.setattr(routing, "BINDINGS_CACHE", 0.2)
    consumer, publisher = other(connect, 1), other(connect, 2)
    # a TTL the second message, delivered, must be consumed within on a loaded machine
    declare(consumer, Queue("short", Exchange("short"), "short", message_ttl=KEPT_TTL))
    publisher.Producer().publish({"n": 1}, routing_key="short")  # not declared there
    time.sleep(KEPT_TTL + 0.2)  # the TTL passing is the point
    assert get(consumer, "short") is None
    publisher.Producer().publish({"n": 2}, routing_key="short")
    assert get_within(consumer, "short").payload == {"n": 2}


def test_queue_unused_past_x_expires_goes_with_its_bindings_and_messages(
    connect: Connect, engine: Engine, table_prefix: str,
) -> None:
    owner = other(connect, 1)
    declare(owner, transient("gone", FANOUT, expires=0.3))
    owner.Producer().publish({"left": "behind"}, exchange=FANOUT, declare=[FANOUT])
    assert count(engine, table_prefix, "transient") == 1
    sweeper = broker_of(other(connect, 2, sweep_interval=0.05))
    sweeper.routes.available()
    time.sleep(0.4)  # the expiry passing is the point
    sweeper.sweep()
    for table in ("queues", "bindings", "transient"):
        assert count(engine, table_prefix, table) == 0, table


def test_a_consumer_in_an_event_loop_sweeps_what_expired(
    connect: Connect, engine: Engine, table_prefix: str,
) -> None:
    """Celery's event loop (the ``event_loop`` option) runs the transport's timer, not its
    blocking loop: that timer deletes expired queues too."""
    owner = other(connect, 1)
    declare(owner, transient("gone", FANOUT, expires=0.3))
    owner.Producer().publish({"left": "behind"}, exchange=FANOUT, declare=[FANOUT])
    loop = EventLoop(other(connect, 2, sweep_interval=0.05), declare(owner, transient("busy")))
    try:
        loop.run_until(lambda: count(engine, table_prefix, "queues", "WHERE name = 'gone'") == 0,
                       "sweep the expired queue")
    finally:
        loop.close()
    assert count(engine, table_prefix, "transient") == 0


def test_consumed_queue_outlives_its_expiry_and_comes_back_after_a_sweep_took_it(
    connect: Connect, engine: Engine, table_prefix: str, caplog: pytest.LogCaptureFixture,
) -> None:
    consumer = other(connect, 1)
    declare(consumer, transient("kept", FANOUT, expires=KEPT_EXPIRES))
    sweeper = broker_of(other(connect, 2, sweep_interval=0.01))
    until = time.monotonic() + 2 * KEPT_EXPIRES  # two expiries of polling and sweeping
    while time.monotonic() < until:
        assert get(consumer, "kept") is None
        sweeper.sweep()
        time.sleep(0.05)
    assert count(engine, table_prefix, "queues") == 1
    # a sweep took it while the consumer could not reach the database
    with engine.begin() as db:
        for table in ("queues", "bindings"):
            db.execute(text(f"DELETE FROM {quoted(engine, table_prefix + table)}"))
    with caplog.at_level(logging.WARNING, logger="kombu_sqlinbox.routing"):
        wait_for(lambda: (get(consumer, "kept") is None and count(
            engine, table_prefix, "queues") == 1) or None, "the queue registered again")
    assert "expired while consumed" in caplog.text
    other(connect, 3).Producer().publish({"back": True}, exchange=FANOUT, declare=[FANOUT])
    assert get_within(consumer, "kept").payload == {"back": True}


def test_a_busy_consumer_keeps_its_queue_through_its_own_processs_sweeps(
    connect: Connect, engine: Engine, table_prefix: str,
) -> None:
    """A consumer that claims nothing for several expiries (its task runs, every prefetch
    slot taken) keeps its auto-delete broadcast queue: its own process sweeps meanwhile,
    and fanout messages published after still reach it."""
    conn = other(connect, 1, sweep_interval=0.01)
    received: list[Any] = []
    queue = transient("node1.broadcast", FANOUT, expires=KEPT_EXPIRES)
    with conn.Consumer([queue], callbacks=[lambda body, message: received.append(body)]):
        broker = broker_of(conn)
        until = time.monotonic() + 2 * KEPT_EXPIRES  # two expiries without a claim
        while time.monotonic() < until:
            broker.sweep()
            time.sleep(0.05)
        assert count(engine, table_prefix, "queues") == 1
        other(connect, 2).Producer().publish({"after": True}, exchange=FANOUT,
                                             declare=[FANOUT])
        conn.drain_events(timeout=5)
    assert received == [{"after": True}]


def test_auto_delete_queue_goes_with_its_last_consumer(
    connect: Connect, engine: Engine, table_prefix: str,
) -> None:
    conn = other(connect, 1)
    queue = transient("monitor", TOPIC, "#")
    with conn.Consumer([queue], callbacks=[lambda body, message: None]):
        assert count(engine, table_prefix, "bindings") == 1
    wait_for(lambda: count(engine, table_prefix, "queues") == 0, "the queue's delete")
    assert count(engine, table_prefix, "bindings") == 0


def test_exclusive_queue_goes_with_its_channel(
    connect: Connect, engine: Engine, table_prefix: str,
) -> None:
    conn = other(connect, 1)
    channel = conn.channel()
    Queue("mine", FANOUT, exclusive=True)(channel).declare()
    assert broker_of(conn).table("mine").transient
    assert count(engine, table_prefix, "bindings") == 1
    channel.close()
    assert count(engine, table_prefix, "queues") == 0
    assert count(engine, table_prefix, "bindings") == 0


def test_expired_queue_with_its_own_table_is_dropped(
    connect: Connect, engine: Engine, table_prefix: str,
) -> None:
    conn = other(connect, 1, sweep_interval=0.01)
    declare(conn, Queue("batch", Exchange("batch"), "batch", expires=0.3))
    table = broker_of(conn).table("batch").spec.table
    assert table in inspect(engine).get_table_names()
    time.sleep(0.4)  # the expiry passing is the point
    broker_of(conn).sweep()
    assert table not in inspect(engine).get_table_names()
    assert count(engine, table_prefix, "bindings") == 0


def test_messages_of_a_queue_deleted_meanwhile_are_swept(
    connect: Connect, engine: Engine, table_prefix: str,
) -> None:
    """A publish racing the queue's deletion leaves its message behind: a sweep takes it."""
    conn = other(connect, 1, sweep_interval=0.01)
    broker = broker_of(conn)
    broker.routes.available()
    with engine.begin() as db:
        db.execute(text(f"INSERT INTO {quoted(engine, table_prefix + 'transient')} "
                        "(queue, payload, headers) VALUES ('deleted.queue', :p, '{}')"),
                   {"p": b"x"})
    broker.sweep()
    assert count(engine, table_prefix, "transient") == 0


def test_transient_message_rejected_or_requeued(connect: Connect, engine: Engine,
                                                table_prefix: str) -> None:
    conn = other(connect, 1)
    declare(conn, transient("work", REPLIES, "work"))
    producer = conn.Producer()
    producer.publish({"n": 1}, exchange=REPLIES, routing_key="work", declare=[REPLIES])
    first = get_within(conn, "work")
    first.requeue()
    again = get_within(conn, "work")
    assert again.payload == {"n": 1}
    again.reject()  # no dead-letter queue for transient messages: it is gone
    assert get(conn, "work") is None
    assert count(engine, table_prefix, "transient") == 0


def test_messages_buffered_by_a_cancelled_consumer_go_back(connect: Connect) -> None:
    conn = other(connect, 1)
    queue = Queue("burst", REPLIES, "burst", durable=False, expires=30)  # not auto-delete
    declare(conn, queue)
    producer = conn.Producer()
    for n in range(5):
        producer.publish({"n": n}, exchange=REPLIES, routing_key="burst", declare=[REPLIES])
    got: list[int] = []
    consumer = conn.Consumer([queue], callbacks=[lambda body, message: got.append(body["n"])],
                             no_ack=True)
    consumer.consume()
    conn.drain_events(timeout=5)
    consumer.cancel()  # claimed in one go, one delivered: the rest go back
    assert got == [0]
    rest = [get_within(conn, "burst").payload["n"] for _ in range(4)]
    assert sorted(rest) == [1, 2, 3, 4]


def test_undecodable_transient_message_is_dropped_with_a_warning(
    connect: Connect, engine: Engine, table_prefix: str, caplog: pytest.LogCaptureFixture,
) -> None:
    conn = other(connect, 1)
    declare(conn, transient("garbled", REPLIES, "garbled"))
    with engine.begin() as db:
        db.execute(text(f"INSERT INTO {quoted(engine, table_prefix + 'transient')} "
                        "(queue, payload, headers) VALUES ('garbled', :p, 'not json')"),
                   {"p": b"x"})
    with caplog.at_level(logging.WARNING, logger="kombu_sqlinbox.broker"):
        assert get(conn, "garbled") is None
    assert "transient message of queue 'garbled' dropped" in caplog.text
    assert count(engine, table_prefix, "transient") == 0


def test_a_transient_table_of_an_earlier_release_gets_its_priority_column(
    connect: Connect, engine: Engine, table_prefix: str,
) -> None:
    """Earlier releases made the transient messages' table without a priority column: it
    is added where the transport creates tables, and named where it may not."""
    other(connect, 1).default_channel.queue_declare("jobs")  # the routing tables too
    table = quoted(engine, table_prefix + "transient")
    index = quoted(engine, table_prefix + "transient_claim")
    on_table = f" ON {table}" if engine.dialect.name == "mysql" else ""
    with engine.begin() as db:  # the earlier layout
        db.execute(text(f"DROP INDEX {index}{on_table}"))
        db.execute(text(f"ALTER TABLE {table} DROP COLUMN priority"))
        db.execute(text(f"CREATE INDEX {index} ON {table} (queue, id)"))
    as_it_was = other(connect, 2, create_tables=False)  # table-backed queues work as before
    as_it_was.SimpleQueue("jobs").put("kept")
    assert as_it_was.SimpleQueue("jobs").get(timeout=10).payload == "kept"
    with pytest.raises(SchemaMismatch, match="ADD COLUMN priority"):
        as_it_was.SimpleBuffer("buffer").put("refused")
    buffer = other(connect, 3).SimpleBuffer("buffer", queue_opts={"max_priority": 9})
    for priority in (1, 9):
        buffer.put(priority, priority=priority)
    assert [buffer.get(timeout=10).payload for _ in range(2)] == [9, 1]


def test_queue_declared_durable_again_leaves_the_registry(
    connect: Connect, engine: Engine, table_prefix: str,
) -> None:
    conn = other(connect, 1)
    declare(conn, transient("flip", REPLIES, "flip"))
    assert broker_of(conn).table("flip").transient
    declare(conn, Queue("flip", REPLIES, "flip", durable=True))
    assert count(engine, table_prefix, "queues") == 0
    assert not broker_of(conn).table("flip").transient


def test_passive_declare_finds_a_transient_queue_of_another_process(connect: Connect) -> None:
    declare(other(connect, 1), transient("theirs", REPLIES, "theirs"))
    channel = other(connect, 2).default_channel
    assert channel.queue_declare("theirs", passive=True).queue == "theirs"
    with pytest.raises(ChannelError):
        channel.queue_declare("nobody.s", passive=True)


@pytest.mark.parametrize("durable", [False, True])
def test_a_passive_declare_changes_nothing(
    connect: Connect, engine: Engine, table_prefix: str, durable: bool,
) -> None:
    """A passive declare only looks, as on AMQP: it declared the queue again as kombu's
    defaults have it (durable, no arguments), so another process's transient queue left
    the registry with its messages, a durable one its x-expires."""
    owner = other(connect, 1)
    declare(owner, Queue("theirs", durable=durable, expires=60))
    owner.Producer().publish({"kept": True}, routing_key="theirs")
    channel = other(connect, 2).default_channel
    assert channel.queue_declare("theirs", passive=True).message_count == 1
    assert count(engine, table_prefix, "queues", "WHERE expires IS NOT NULL") == 1
    assert get_within(owner, "theirs").payload == {"kept": True}


def test_names_differing_only_in_case_are_different_queues(connect: Connect) -> None:
    conn = other(connect, 1)
    for name in ("Reply", "reply"):
        declare(conn, transient(name, REPLIES, name))
    producer = conn.Producer()
    producer.publish({"to": "Reply"}, exchange=REPLIES, routing_key="Reply", declare=[REPLIES])
    assert get_within(conn, "Reply").payload == {"to": "Reply"}
    assert get(conn, "reply") is None


def test_names_differing_only_in_trailing_spaces_are_different_queues(
        connect: Connect) -> None:
    """MariaDB's utf8mb4_bin pads with spaces when it compares ('alice' = 'alice '): names
    are stored where they compare byte for byte, on every database."""
    conn = other(connect, 1)
    for name in ("alice", "alice ", "alice  "):
        declare(conn, transient(name, REPLIES, name))
    producer = other(connect, 2).Producer()
    producer.publish({"to": "alice"}, exchange=REPLIES, routing_key="alice", declare=[REPLIES])
    producer.publish({"to": "alice  "}, exchange=REPLIES, routing_key="alice  ")
    assert get(conn, "alice ") is None
    assert get_within(conn, "alice").payload == {"to": "alice"}
    assert get_within(conn, "alice  ").payload == {"to": "alice  "}
    assert get(conn, "alice") is None
    channel = other(connect, 3).default_channel
    with pytest.raises(ChannelError):
        channel.queue_declare("bob ", passive=True)  # only "bob" exists
    declare(conn, transient("bob", REPLIES, "bob"))
    with pytest.raises(ChannelError):
        channel.queue_declare("bob ", passive=True)


def test_exchanges_differing_only_in_trailing_spaces_route_apart(connect: Connect) -> None:
    news, spaced = (Exchange(name, type="fanout", durable=False) for name in ("news", "news "))
    conn = other(connect, 1)
    declare(conn, transient("plain", news))
    declare(conn, Queue("kept", spaced, durable=True))  # reached through the bindings table
    other(connect, 2).Producer().publish({"to": "news"}, exchange="news")
    assert get_within(conn, "plain").payload == {"to": "news"}
    assert get(conn, "kept") is None


@pytest.mark.parametrize("database", ["mysql"], indirect=True)
def test_routing_tables_of_an_earlier_version_are_named_at_start_up_with_their_fix(
        connect: Connect, engine: Engine, table_prefix: str,
        caplog: pytest.LogCaptureFixture) -> None:
    """Made when names were text (a collation ignoring trailing spaces): the transport
    still runs on them, and says what to change."""
    routing = dialect_for(engine).routing_statements(table_prefix)
    with engine.begin() as conn:
        for statement in earlier_routing_ddl(routing.ddl):
            conn.execute(text(statement))
    with caplog.at_level(logging.WARNING, logger="kombu_sqlinbox.routing"):
        declare(other(connect, 1), transient("alice", REPLIES, "alice"))
    warned = [record.getMessage() for record in caplog.records]
    assert [message.split(":")[1] for message in warned] == [
        f" routing table {name}" for name in (*routing.names, routing.names[2])], warned
    assert "trailing spaces" in warned[0] and "ALTER TABLE" in warned[0], warned
    assert "once no process of an earlier version uses them" in warned[0], warned


@pytest.mark.parametrize("database", ["mysql"], indirect=True)
def test_names_route_alike_whatever_the_connection_charset(
        connect: Connect, broker_url: str, table_prefix: str, engine: Engine) -> None:
    """A process whose URL names another character set (``?charset=latin1``, an older
    service's) writes its names as the bytes of that set: stored in binary columns as they
    arrive, they would match no other process's names, and read back garbled (a queue
    bound elsewhere gets nothing; an expired queue is never deleted)."""
    options = {"table_prefix": table_prefix, "polling_interval": 0.05, "sweep_interval": 0.01}
    latin1 = Connection(broker_url + "?charset=latin1", transport_options=options)
    try:
        durable = Exchange("cafés", type="direct", durable=True)
        declare(latin1, Queue("café", durable, routing_key="crème", durable=True))
        # kept until its message is got (a get renews it), however slow the machine
        declare(latin1, transient("thé", REPLIES, "thé", expires=2 * KEPT_EXPIRES))
        publisher = other(connect, 2)
        publisher.Producer().publish({"to": "café"}, exchange=durable, routing_key="crème",
                                     declare=[durable])
        publisher.Producer().publish({"to": "thé"}, exchange=REPLIES, routing_key="thé")
        assert get_within(latin1, "café").payload == {"to": "café"}
        assert get_within(latin1, "thé").payload == {"to": "thé"}
        sweeper = broker_of(other(connect, 3, sweep_interval=0.01))
        sweeper.routes.available()
        wait_for(lambda: sweeper.sweep() or count(engine, table_prefix, "queues") == 0,
                 "the expired queue deleted", timeout=10)
    finally:
        latin1.release()


@pytest.mark.drivers
def test_a_topic_binding_of_the_longest_key_routes_exactly(connect: Connect) -> None:
    """The pattern kombu makes of a binding key is longer than the key (a character
    escaped, ``^`` and ``$``): 255 characters of emoji make 1277 bytes. It is stored
    whole: not refused, nor cut short where a server is not strict (a pattern that would
    then match other keys)."""
    key = "😀" * 255
    consumer = other(connect, 1)
    declare(consumer, transient("longest", TOPIC, key))
    declare(consumer, Queue("kept", TOPIC, routing_key=key, durable=True))
    producer = other(connect, 2).Producer()
    producer.publish({"key": "other"}, exchange=TOPIC, routing_key="😀" * 254 + "x",
                     declare=[TOPIC])
    producer.publish({"key": "exact"}, exchange=TOPIC, routing_key=key)
    for queue in ("longest", "kept"):
        assert get_within(consumer, queue).payload == {"key": "exact"}, queue
        assert get(consumer, queue) is None, queue


@pytest.mark.parametrize("routing_key", ["café.crème", "x.ünï", "x.ÜNÏ", "😀.a.b", "Café.x"])
def test_topic_patterns_of_non_ascii_words_match_as_kombus_own(
        connect: Connect, routing_key: str) -> None:
    """Case-sensitive, a character at a time, as kombu's topic exchange matches."""
    patterns = {"cafe": "café.*", "any": "#.ünï", "emoji": "😀.#", "upper": "Café.*"}
    consumer = other(connect, 1)
    for queue, pattern in patterns.items():
        declare(consumer, transient(queue, TOPIC, pattern))
    other(connect, 2).Producer().publish({"key": routing_key}, exchange=TOPIC,
                                         routing_key=routing_key, declare=[TOPIC])
    topic = TopicExchange(None)
    expected = {queue for queue, pattern in patterns.items()
                if re.match(topic.key_to_pattern(pattern), routing_key)}
    assert {queue for queue in patterns if get(consumer, queue) is not None} == expected


@pytest.mark.parametrize("database", ["mysql"], indirect=True)
def test_a_topic_match_on_mysql_takes_no_binary_string(engine: Engine) -> None:
    """MySQL 8.0.22 and later refuse a binary string on either side of REGEXP (error
    3995, ER_CHARACTER_SET_MISMATCH: every publish to an exchange would fail), where
    MariaDB takes it; names are binary strings there, so the match reads both as text."""
    dialect = dialect_for(engine)
    value, pattern = dialect.matches(":routing_key", "b.pattern").split(" REGEXP ")
    with engine.connect() as conn:
        charsets = conn.execute(text(
            f"SELECT CHARSET({value}), CHARSET({pattern}), "
            f"{dialect.matches(':routing_key', 'b.pattern')} "
            "FROM (SELECT CAST(:pattern AS BINARY) AS pattern) AS b").bindparams(
                bindparam("routing_key", type_=dialect.name_bind),
                bindparam("pattern", type_=dialect.name_bind)),
            {"routing_key": "Café.crème", "pattern": r"^Café\.[^.]+$"}).one()
    assert tuple(charsets) == ("utf8mb4", "utf8mb4", 1)


@pytest.mark.drivers
def test_a_transient_message_with_headers_past_64_kib_arrives_whole(connect: Connect) -> None:
    """A queue table's headers column holds what a message carries; so does the transient
    messages' (a MySQL TEXT holds 64 KiB: refused raw on a strict server, cut short and
    then dropped as undecodable on one that is not)."""
    conn = other(connect, 1)
    declare(conn, transient("big", REPLIES, "big"))
    headers = {"note": "y" * 70_000}
    other(connect, 2).Producer().publish({"to": "big"}, exchange=REPLIES, routing_key="big",
                                         headers=headers, declare=[REPLIES])
    message = get_within(conn, "big")
    assert (message.payload, message.headers["note"]) == ({"to": "big"}, headers["note"])


def test_hostile_exchange_names_and_keys_are_bound_values(connect: Connect) -> None:
    hostile = Exchange("x'); DROP TABLE users; --", type="topic", durable=False)
    conn = other(connect, 1)
    declare(conn, transient("safe", hostile, "ünï.`quoted`.#"))
    conn.Producer().publish({"ok": 1}, exchange=hostile, routing_key="ünï.`quoted`.x",
                            declare=[hostile])
    assert get_within(conn, "safe").payload == {"ok": 1}
    with pytest.raises(ConfigurationError, match="routing key"):
        conn.Producer().publish({"no": 1}, exchange=hostile, routing_key="nul\x00byte")


@pytest.mark.parametrize("database", ["postgresql"], indirect=True)
def test_notify_wakes_a_transient_queue_consumer_at_once(connect: Connect) -> None:
    consumer = other(connect, 1, polling_interval=5.0)
    got: list[float] = []
    queue = transient("woken", FANOUT)
    with consumer.Consumer([queue], callbacks=[lambda body, message: got.append(
            time.monotonic())], no_ack=True):
        publisher = other(connect, 2)
        sent = threading.Timer(0.3, lambda: publisher.Producer().publish(
            {"wake": 1}, exchange=FANOUT, declare=[FANOUT]))
        started = time.monotonic()
        sent.start()
        consumer.drain_events(timeout=4)
        sent.join()
    assert got and got[0] - started < 1.5  # not the 5 s polling interval


@pytest.mark.parametrize("database", ["postgresql"], indirect=True)
def test_racing_creation_of_the_routing_tables_is_retried(
    connect: Connect, engine: Engine, table_prefix: str,
) -> None:
    """Another process creating the routing tables in an open transaction: ours waits
    on its catalog rows, fails on the duplicate when it commits, and finds them."""
    broker = broker_of(other(connect, 1))
    names = RoutingStatements.tables(table_prefix)
    rival = engine.connect()
    rival_transaction = rival.begin()
    outcome: list[Any] = []

    def race() -> None:
        try:
            outcome.append(broker.routes.available())
        except Exception as exc:  # shown by the assertions below
            outcome.append(exc)

    racer = threading.Thread(target=race, daemon=True)
    try:
        rival_pid = rival.exec_driver_sql("SELECT pg_backend_pid()").scalar_one()
        for statement in broker.routes.sql.ddl:
            rival.exec_driver_sql(statement)
        racer.start()
        with engine.connect() as watch:
            wait_for(lambda: outcome or watch.execute(text(
                "SELECT 1 FROM pg_stat_activity WHERE :rival = ANY(pg_blocking_pids(pid))"),
                {"rival": rival_pid}).first(), "our CREATE waiting on the rival's", timeout=30)
        assert not outcome, outcome  # still waiting: the rival holds the catalog rows
        rival_transaction.commit()
    finally:
        rival.close()  # rolls back if the test failed before the commit
    racer.join(timeout=30)
    assert outcome == [True]
    assert set(names) <= set(inspect(engine).get_table_names())


def test_exchange_never_declared_here_routes_through_the_bindings_table(
    connect: Connect,
) -> None:
    consumer = other(connect, 1)
    declare(consumer, transient("by.name", REPLIES, "by.name"))
    other(connect, 2).Producer().publish({"named": 1}, exchange="replies",
                                         routing_key="by.name")
    assert get_within(consumer, "by.name").payload == {"named": 1}


def test_malformed_expiration_is_no_ttl(connect: Connect) -> None:
    """kombu writes ``expiration`` as milliseconds; a raw publish may put anything there."""
    conn = other(connect, 1, sweep_interval=0.01)
    declare(conn, transient("odd", REPLIES, "odd"))
    channel = conn.default_channel
    channel.exchange_declare("replies", "direct")
    channel.basic_publish(channel.prepare_message(
        b"odd", properties={"expiration": "soon"}), "replies", "odd")
    broker_of(conn).sweep()
    assert get_within(conn, "odd").body == b"odd"


def test_a_transient_queue_is_polled_once_per_polling_interval_while_another_has_rows(
    connect: Connect, table_prefix: str,
) -> None:
    """kombu asks a connection's queues in turn: a worker's remote-control queue (transient,
    on a channel of its own) is not polled before every task of a backlog, nor at every
    claim of its rows, but once per polling interval while the task queue has rows; once
    that runs dry, at every round again: its messages still come through at once."""
    conn = connect(polling_interval=60)
    producer = conn.Producer()
    for n in range(50):
        producer.publish({"n": n}, routing_key="jobs", declare=[Queue("jobs")])
    tasks, control = conn.channel(), conn.channel()
    got: list[Any] = []

    def take(body: Any, message: Any) -> None:
        got.append(body)
        message.ack()

    consumer = Consumer(tasks, [Queue("jobs")], callbacks=[take])
    consumer.qos(prefetch_count=10)
    consumer.consume()
    pidbox = transient("node.pidbox", FANOUT)(control)
    pidbox.declare()
    pinged: list[Any] = []
    Consumer(control, [pidbox], no_ack=True,
                  callbacks=[lambda body, message: pinged.append(body)]).consume()
    transient_table = table_prefix + "transient"
    with statements_run(broker_of(conn).engine) as seen:
        while len(got) < 50:
            conn.drain_events(timeout=5)
    # a poll's first statement (the claim of its rows) names the table in its FROM
    polls = [sql for sql in seen if re.search(rf"FROM \W?{transient_table}\W", sql)]
    assert len(polls) == 1, polls  # five claims of ten rows, one poll
    producer.publish({"ping": 1}, exchange=FANOUT, declare=[FANOUT])
    while not pinged:  # the task queue's empty claim ends the skipping, not the interval
        conn.drain_events(timeout=5)
    assert pinged == [{"ping": 1}]


def test_a_consumer_tag_in_use_is_refused_and_the_queue_expires_after_its_cancel(
    connect: Connect, engine: Engine, table_prefix: str,
) -> None:
    """A channel refuses a consumer tag it already consumes with, as AMQP does: taken
    twice, one cancel left the queue counted as consumed, renewed for ever. A cancel of a
    tag never consumed with changes nothing."""
    conn = other(connect, 1)
    declare(conn, Queue("tagged", durable=False, expires=0.3))
    channel = conn.default_channel
    channel.basic_consume("tagged", False, lambda message: None, "t1")
    with pytest.raises(ChannelError, match="consumer tag 't1'"):
        channel.basic_consume("tagged", False, lambda message: None, "t1")
    channel.basic_cancel("never-consumed")
    channel.basic_cancel("t1")
    channel.basic_cancel("t1")  # twice: nothing more
    sweeper = broker_of(other(connect, 2, sweep_interval=0.01))
    sweeper.routes.available()

    def expired() -> bool | None:
        sweeper.sweep()
        return count(engine, table_prefix, "queues") == 0 or None

    wait_for(expired, "the queue no longer consumed to expire", timeout=5)


@pytest.mark.parametrize(("exchange", "keys"), [
    (Exchange("everyone", type="fanout"), ["", ""]),
    (Exchange("orders", type="direct"), ["created", "created"]),
    (Exchange("events", type="topic"), ["order.*", "order.#"]),
])
@pytest.mark.parametrize("durable", [True, False])
def test_a_queue_bound_here_and_elsewhere_gets_one_copy(
    connect: Connect, exchange: Exchange, keys: list[str], durable: bool,
) -> None:
    """A queue bound in the publishing process and in another one, by the same key or by
    two patterns that both take the message, gets it once, as on an AMQP broker."""
    publisher, binder = other(connect, 1), other(connect, 2)
    name = "audit" if durable else "watch"
    for conn, key in ((publisher, keys[0]), (binder, keys[1])):
        declare(conn, Queue(name, exchange, key, durable=durable))
    publisher.Producer().publish({"order": 1}, exchange=exchange, routing_key="order.created"
                                 if exchange.type == "topic" else "created")
    message = get_within(binder, name)
    assert message.payload == {"order": 1}
    message.ack()
    assert get(publisher, name) is None
    assert get(binder, name) is None


def test_a_queue_unbound_in_another_process_no_longer_gets_messages(
    connect: Connect, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A binding is the exchange's, not a process's: once another process unbinds a queue,
    a publisher that bound it too stops routing to it within the bindings cache, as on an
    AMQP broker (its own kombu binding kept it routed for ever)."""
    monkeypatch.setattr(routing, "BINDINGS_CACHE", 0.2)
    orders = Exchange("orders", type="direct")
    publisher, binder = other(connect, 1), other(connect, 2)
    declare(publisher, Queue("audit", orders, "created"))
    declare(binder, Queue("audit", orders, "created")).unbind_from(orders, "created")
    time.sleep(0.2)  # the cache's age passing is the point
    publisher.Producer().publish({"order": 1}, exchange=orders, routing_key="created")
    assert get(binder, "audit") is None


def test_a_transient_queue_takes_any_priority_as_a_stored_one(connect: Connect) -> None:
    """A priority outside 0-255 is taken as the nearest bound, one that is no number (or
    no finite one) as none: every message arrives, in the order of the stored ones."""
    conn = other(connect, 1)
    buffer = conn.SimpleBuffer("ranked", queue_opts={"max_priority": 255})
    sent: list[tuple[str, Any]] = [
        ("below", -5), ("above", 300), ("none", None), ("text", "7"), ("word", "high"),
        ("infinite", float("inf")), ("nan", float("nan")), ("mid", 100)]
    for name, priority in sent:
        buffer.put(name, priority=priority)
    got = [buffer.get(timeout=10).payload for _ in sent]
    assert got == ["above", "mid", "text", "below", "none", "word", "infinite", "nan"]


def test_a_queue_consumed_by_a_process_that_did_not_declare_it_never_expires(
    connect: Connect, engine: Engine, table_prefix: str,
) -> None:
    """The consumer keeps the queue, not its declaration: a process consuming a queue
    another one declared with ``x-expires`` (found by a passive declare) keeps it for as
    long as it consumes, and it expires once the consumer is cancelled."""
    declare(other(connect, 1), Queue("shared", durable=False, expires=KEPT_EXPIRES))
    channel = other(connect, 2).default_channel
    channel.queue_declare("shared", passive=True)
    channel.basic_consume("shared", False, lambda message: None, "c1")
    sweeper = broker_of(other(connect, 3, sweep_interval=0.01))
    sweeper.routes.available()
    until = time.monotonic() + 2 * KEPT_EXPIRES  # two expiries passing is the point
    while time.monotonic() < until:
        sweeper.sweep()
        time.sleep(0.05)
    assert count(engine, table_prefix, "queues") == 1
    channel.basic_cancel("c1")

    def expired() -> bool | None:
        sweeper.sweep()
        return count(engine, table_prefix, "queues") == 0 or None

    wait_for(expired, "the queue no longer consumed to expire", timeout=10)


def test_a_publisher_that_bound_an_expired_queue_does_not_route_to_it(
    connect: Connect, engine: Engine, table_prefix: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A queue that expired (nobody consumed it) is gone for every process: a publisher
    that bound it too publishes to its exchange without failing, and nothing routes to
    it any more, as on an AMQP broker."""
    monkeypatch.setattr(routing, "BINDINGS_CACHE", 0.2)
    orders = Exchange("orders", type="direct")
    publisher = other(connect, 1)
    declare(publisher, Queue("audit", orders, "created", expires=0.3))
    sweeper = broker_of(other(connect, 2, sweep_interval=0.01))
    sweeper.routes.available()

    def expired() -> bool | None:
        sweeper.sweep()
        return count(engine, table_prefix, "queues") == 0 or None

    wait_for(expired, "the queue to expire", timeout=5)
    time.sleep(0.2)  # the cache's age passing is the point
    publisher.Producer().publish({"order": 1}, exchange=orders, routing_key="created")
    assert not inspect(engine).has_table(table_name_for_queue("audit", table_prefix))
