"""Transient work alone on MariaDB (each statement committed as it runs) against what
production does to it: claims racing for the same ids, the database out of reach or
blinking, a statement interrupted, a cut claim, a bound caller, odd
queue names, priorities and TTLs; and, on every database, the wake-ups of threads that
share a process and of a transient queue a busy round passed over."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

import pytest
from kombu import Connection as KombuConnection
from kombu import Consumer, Queue
from sqlalchemy import event, text
from sqlalchemy.engine import Engine

from kombu_sqlinbox.broker import Broker

from .conftest import Connect
from .support import broker_of, count_rows, table_of
from .test_transient_alone import REPLIES, bodies, reply_queue, send, transient_rows

# -- racing claimers ------------------------------------------------------------------


@pytest.mark.databases("mysql")
def test_a_claim_that_loses_the_race_for_the_first_ids_still_takes_what_the_queue_holds(
        connect: Connect, engine: Engine) -> None:
    """Two consumers of one transient queue (a kombu user's ``durable=False`` work queue,
    or two threads draining one reply queue) claim at once and read the same first ids;
    the first DELETE takes them. The second claim reads on and takes the next ones: a
    claim that found nothing would have its consumer take the queue for empty (it waits;
    ``queue.get()`` returns None with messages in it)."""
    conn = connect()
    reply_queue(conn, "shared")
    broker = broker_of(conn)
    for n in range(30):
        broker.transient.put("shared", str(n).encode(), None, None)
    table = broker.table("shared")
    read, raced = threading.Event(), threading.Event()
    loser = threading.local()

    def after(c: Any, cursor: Any, sql: str, *args: Any) -> None:
        if getattr(loser, "on", False) and sql.startswith("SELECT id FROM"):
            loser.on = False
            read.set()
            raced.wait(10)

    taken: list[Any] = []

    def claim() -> None:
        loser.on = True
        taken.append(broker.transient.claim(table, 10))

    event.listen(broker.database.engine, "after_cursor_execute", after)
    try:
        thread = threading.Thread(target=claim)
        thread.start()
        assert read.wait(10)
        winner = broker.transient.claim(table, 10)  # the same first ten ids
        raced.set()
        thread.join(10)
    finally:
        event.remove(broker.database.engine, "after_cursor_execute", after)
    assert len(winner) == 10
    left = transient_rows(engine, broker, "shared")
    assert len(taken[0]) == 10, f"the claim took {len(taken[0])}, with {left} messages left"
    assert {row.id for row in winner}.isdisjoint(row.id for row in taken[0])
    assert left == 10


# -- wake-ups taken before a round ----------------------------------------------------


@pytest.mark.databases("mysql", "postgresql", "sqlite")
def test_a_busy_consumer_thread_does_not_take_another_threads_wake_up(
        connect: Connect, database: str) -> None:
    """Two threads of one process share the broker's wake-up (Flower: an event receiver
    in one thread, ``inspect`` calls in another; a worker's consumer beside an
    ``AsyncResult.get`` in a thread): thread B waits for a reply, thread A consumes a
    task queue with work in it. A's drains must leave B's wake-up to B, or B sleeps out
    its whole polling interval though its reply came at once."""
    options = {"polling_interval": 2.0, "polling_interval_min": 2.0}
    conn_a, conn_b = connect(**options), connect(**options)
    assert broker_of(conn_a) is broker_of(conn_b)
    broker = broker_of(conn_a)
    work = Queue("work")
    work(conn_a.default_channel).declare()
    conn_a.Producer().publish({"task": 1}, routing_key="work", retry=False)
    reply_queue(conn_b)
    b_empty, go = threading.Event(), threading.Event()
    claim = broker.transient.claim
    claims_in_b: list[int] = []

    def watched(table: Any, limit: int, skip: Any = ()) -> Any:
        rows = claim(table, limit, skip)
        if threading.current_thread().name == "b" and not claims_in_b:
            claims_in_b.append(len(rows))
            b_empty.set()
            go.wait(10)
        return rows

    got: list[float] = []
    broker.transient.claim = watched  # type: ignore[method-assign]

    def drain_b() -> None:
        with Consumer(conn_b.default_channel, [Queue("r", REPLIES, routing_key="r",
                                                     durable=False, auto_delete=True)],
                      callbacks=[lambda body, m: got.append(time.monotonic())],
                      no_ack=True, accept=["json"]), contextlib.suppress(TimeoutError):
            conn_b.drain_events(timeout=5)

    try:
        with Consumer(conn_a.default_channel, [Queue("work")], accept=["json"],
                      callbacks=[lambda body, m: m.ack()]):
            thread = threading.Thread(target=drain_b, name="b")
            thread.start()
            assert b_empty.wait(10), "thread B never claimed its reply queue"
            send(conn_a, {"pong": 1})  # B's reply, its wake-up poked now
            conn_a.drain_events(timeout=1)  # A's task delivered
            replied = time.monotonic()
            go.set()
            thread.join(10)
    finally:
        del broker.transient.claim
    assert claims_in_b == [0]
    assert got, "B got no reply"
    assert got[0] - replied < 0.5, f"B's reply waited {got[0] - replied:.2f}s"


@pytest.mark.databases("mysql", "postgresql", "sqlite")
def test_a_reply_for_a_queue_skipped_in_a_busy_round_is_not_left_for_a_whole_interval(
        connect: Connect, database: str) -> None:
    """A worker's connection consumes a task queue and a transient queue (its pidbox, a
    reply queue). While its last task claim found rows, the transient queue skips the
    round for a polling interval after it was found empty, and this process's publish
    into it pokes the wake-up pipe. The poke outlives the round that skipped the queue,
    so the next round takes the reply at once, not a whole interval later."""
    conn = connect(polling_interval=2.0, polling_interval_min=2.0)
    work = Queue("work")
    work(conn.default_channel).declare()
    reply_queue(conn, "t")
    got: list[tuple[str, float]] = []
    tasks = Consumer(conn.default_channel, [Queue("work")], accept=["json"],
                     callbacks=[lambda body, m: (got.append(("task", time.monotonic())),
                                                 m.ack())])
    replies = Consumer(conn.channel(), [Queue("t", REPLIES, routing_key="t", durable=False,
                                              auto_delete=True)], accept=["json"],
                       no_ack=True,
                       callbacks=[lambda body, m: got.append(("reply", time.monotonic()))])
    with tasks, replies:
        with pytest.raises(TimeoutError):  # both queues claimed, found empty
            conn.drain_events(timeout=0.1)
        conn.Producer().publish({"task": 1}, routing_key="work", retry=False)
        conn.drain_events(timeout=3)  # the task claimed (rows found)
        assert [what for what, _ in got] == ["task"]
        sent = time.monotonic()
        send(conn, {"pong": 1}, "t")
        while len(got) < 2 and time.monotonic() - sent < 5:
            try:
                conn.drain_events(timeout=5)
            except TimeoutError:
                break
    assert [what for what, _ in got] == ["task", "reply"], got
    assert got[1][1] - sent < 0.5, f"the reply waited {got[1][1] - sent:.2f}s"


# -- the database out of reach ------------------------------------------------------


@pytest.mark.databases("mysql")
def test_a_transient_queue_registered_again_while_the_database_is_away_is_logged_not_raised(
        db_url: str, table_prefix: str, proxy: Any) -> None:
    """``Routes.register_again`` (a queue a sweep took while it was consumed: run from the
    renewal thread and from every claim's ``keep_alive``) logs SQLAlchemy's errors, so
    that the database out of reach is logged and the next renewal tries again: a
    connection the server refuses must come out as SQLAlchemy's error, not the
    driver's."""
    url = "sqlinbox+" + proxy.url(db_url)
    conn = KombuConnection(url, transport_options={"table_prefix": table_prefix})
    try:
        Queue("x", REPLIES, routing_key="x", durable=False, auto_delete=True,
              expires=60)(conn.default_channel).declare()
        broker = broker_of(conn)
        assert broker.database.publish_pool is not None
        with proxy.refuse():
            broker.routes.register_again("x")  # logged: the next renewal tries again
    finally:
        conn.release()


@pytest.mark.databases("mysql")
def test_a_claim_while_the_database_is_away_raises_what_run_raised(
        db_url: str, table_prefix: str, proxy: Any) -> None:
    """A claim that cannot connect raises SQLAlchemy's ``OperationalError`` (a
    ``DBAPIError``, as every other statement of the transport does), which
    ``Channel._get``'s handler expects, not PyMySQL's own."""
    from sqlalchemy.exc import DBAPIError
    url = "sqlinbox+" + proxy.url(db_url)
    conn = KombuConnection(url, transport_options={"table_prefix": table_prefix})
    try:
        reply_queue(conn)
        broker = broker_of(conn)
        with proxy.refuse(), pytest.raises(Exception) as raised:
            broker.transient.claim(broker.table("r"), 10)
        assert isinstance(raised.value, DBAPIError), type(raised.value)
    finally:
        conn.release()


# -- pool hygiene ---------------------------------------------------------------------


def interrupt_next_reply(broker: Broker) -> Any:
    """Make the publish pool's (only) connection raise KeyboardInterrupt as it waits for
    its next reply, as a SIGINT arriving in ``recv`` does: the reply stays unread."""
    pool = broker.database.publish_pool
    assert pool is not None
    pooled = pool.connect()
    driver = pooled.dbapi_connection
    pooled.close()
    assert pool.checkedin() == 1
    def interrupted(*args: Any, **kwargs: Any) -> Any:
        del driver._read_packet
        raise KeyboardInterrupt

    driver._read_packet = interrupted
    return driver


@pytest.mark.databases("mysql")
def test_a_claim_interrupted_mid_statement_leaves_the_publish_pool_clean(
        connect: Connect) -> None:
    """A KeyboardInterrupt (or a greenlet's timeout) as the claim's read waits for its
    reply: the connection must not go back to the pool with that reply unread."""
    conn = connect()
    queue = reply_queue(conn)
    broker = broker_of(conn)
    send(conn, {"n": 0})
    interrupt_next_reply(broker)
    with pytest.raises(KeyboardInterrupt):
        broker.transient.claim(broker.table("r"), 10)
    send(conn, {"n": 1})
    message = queue.get(no_ack=True)
    assert message is not None and message.payload == {"n": 0}


@pytest.mark.databases("mysql")
def test_a_durable_publish_interrupted_mid_statement_leaves_the_pool_clean_for_claims(
        connect: Connect) -> None:
    """A task publish (``Database.write``, raw driver cursor on the publish pool)
    interrupted as it waits for the INSERT's reply returns its connection to the pool
    without that reply read: transient claims, reads and declares take the pool's
    connections too, and the next one must not read the stale reply as its own."""
    conn = connect()
    queue = reply_queue(conn)
    Queue("work")(conn.default_channel).declare()
    broker = broker_of(conn)
    send(conn, {"n": 0})
    interrupt_next_reply(broker)
    with pytest.raises(KeyboardInterrupt):
        conn.Producer().publish({"task": 1}, routing_key="work", retry=False)
    message = queue.get(no_ack=True)
    assert message is not None and message.payload == {"n": 0}
    assert queue.get(no_ack=True) is None


# -- what held ------------------------------------------------------------------------


@pytest.mark.databases("mysql")
def test_the_claim_alone_keeps_priority_order_and_leaves_expired_messages(
        connect: Connect) -> None:
    conn = connect()
    queue = Queue("p", REPLIES, routing_key="p", durable=False, auto_delete=True,
                  max_priority=9)(conn.default_channel)
    queue.declare()
    for n, priority in enumerate([0, 5, 1, 9, 5]):
        send(conn, {"n": n}, "p", priority=priority)
    send(conn, {"n": "gone"}, "p", priority=9, expiration=0.05)
    time.sleep(0.2)  # the message's own TTL passes (no event tells it)
    broker = broker_of(conn)
    first = broker.transient.claim(broker.table("p"), 2)
    assert len(first) == 2
    taken = [m.payload["n"] for m in iter(lambda: queue.get(no_ack=True), None)]
    firsts = [json_n(row.payload) for row in first]
    assert firsts + taken == [3, 1, 4, 2, 0], (firsts, taken)


def json_n(payload: Any) -> Any:
    import json
    body = json.loads(payload)
    if "body" in body:
        body = json.loads(body["body"])
    return body["n"]


@pytest.mark.databases("mysql")
def test_a_queue_message_ttl_is_honoured_by_the_claim_alone(connect: Connect) -> None:
    conn = connect()
    queue = Queue("ttl", REPLIES, routing_key="ttl", durable=False, auto_delete=True,
                  message_ttl=0.05)(conn.default_channel)
    queue.declare()
    send(conn, {"n": 0}, "ttl")
    time.sleep(0.2)  # the queue's TTL passes (no event tells it)
    assert queue.get(no_ack=True) is None


@pytest.mark.databases("mysql")
def test_a_bound_callers_transient_declare_and_publish_stay_in_its_transaction(
        connect: Connect, engine: Engine) -> None:
    """Bound (transactional publishing): the declare, the binding and the publish run in
    the caller's transaction, not alone: it counts its own message, and its rollback
    leaves no registry row, binding or message."""
    from kombu_sqlinbox import binding
    conn = connect()
    reply_queue(conn, "other")  # the routing tables made
    broker = broker_of(conn)
    names = broker.routes.sql.names
    with broker.database.engine.connect() as caller:
        caller.begin()
        token = binding.BOUND.set(caller)
        try:
            queue = reply_queue(conn, "bound")
            send(conn, {"n": 0}, "bound")
            assert broker.transient.size("bound") == 1
        finally:
            binding.BOUND.reset(token)
        caller.rollback()
    with engine.connect() as db:
        for table in names:
            counted = db.execute(text(f"SELECT COUNT(*) FROM {table}")).scalar_one()
            if table == names[2]:
                assert counted == 0, table
        assert transient_rows(engine, broker, "bound") == 0
        registered = db.execute(text(f"SELECT COUNT(*) FROM {names[0]} WHERE name = :q"),
                                {"q": b"bound"}).scalar_one()
        assert registered == 0
    assert queue is not None


@pytest.mark.databases("mysql")
def test_a_claim_whose_delete_is_cut_delivers_nothing_twice(
        db_url: str, table_prefix: str, proxy: Any) -> None:
    """The network drops the claim's connection as its DELETE goes out: run again, it may
    lose what the DELETE took (at most once), never deliver a message twice."""
    url = "sqlinbox+" + proxy.url(db_url)
    conn = KombuConnection(url, transport_options={"table_prefix": table_prefix})
    try:
        queue = reply_queue(conn)
        broker = broker_of(conn)
        for n in range(20):
            send(conn, {"n": n})
        cuts: list[bool] = []

        def before(c: Any, cursor: Any, sql: str, *args: Any) -> None:
            if sql.startswith("DELETE") and "RETURNING" in sql and len(cuts) < 3:
                cuts.append(True)
                proxy.cut()

        event.listen(broker.database.engine, "before_cursor_execute", before)
        taken: list[int] = []
        try:
            for _ in range(40):
                rows = broker.transient.claim(broker.table("r"), 3)
                taken += [json_n(row.payload) for row in rows]
        finally:
            event.remove(broker.database.engine, "before_cursor_execute", before)
        assert len(cuts) == 3
        assert len(taken) == len(set(taken)), taken
        assert queue.get(no_ack=True) is None
    finally:
        conn.release()


@pytest.mark.databases("mysql")
def test_the_claim_alone_keeps_queues_whose_names_differ_by_a_trailing_space_or_case_apart(
        connect: Connect) -> None:
    conn = connect()
    names = ["ü", "ü ", "Ü", "r"]
    queues = {name: reply_queue(conn, name) for name in names}
    for name in names:
        send(conn, {"to": name}, name)
    for name in names:
        assert bodies(queues[name]) == [{"to": name}], name


@pytest.mark.databases("mysql")
def test_a_claim_rides_out_a_blink_of_the_database_as_run_did(
        db_url: str, table_prefix: str, proxy: Any) -> None:
    """Every connection cut, new ones refused for 0.15 s (a failover, a proxy's restart):
    the claim's lost connection and its refused successors (error 2013, a disconnect)
    are retried with back-off (at least 0.225 s in all), so the claim rides it out."""
    url = "sqlinbox+" + proxy.url(db_url)
    conn = KombuConnection(url, transport_options={"table_prefix": table_prefix})
    try:
        queue = reply_queue(conn)
        send(conn, {"n": 0})
        back = proxy.blink(0.15)
        try:
            message = queue.get(no_ack=True)
        finally:
            back.join()
        assert message is not None and message.payload == {"n": 0}
    finally:
        conn.release()


@pytest.mark.databases("mysql")
def test_a_task_publish_rides_out_a_blink_of_the_database_and_lands_once(
        db_url: str, table_prefix: str, proxy: Any, engine: Engine) -> None:
    """The same for a publish to a task queue (its own connections in autocommit): a
    connection refused is retried as the engine's own would be, and the row lands once."""
    url = "sqlinbox+" + proxy.url(db_url)
    conn = KombuConnection(url, transport_options={"table_prefix": table_prefix})
    try:
        conn.default_channel.queue_declare("work")
        conn.Producer().publish({"n": 0}, routing_key="work", retry=False)
        back = proxy.blink(0.15)
        try:
            conn.Producer().publish({"n": 1}, routing_key="work", retry=False)
        finally:
            back.join()
        assert count_rows(engine, table_of("work", table_prefix)) == 2
    finally:
        conn.release()
