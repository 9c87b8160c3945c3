"""kombu's API behaves on ``sqlinbox+`` as on kombu's own brokers.

Each test body runs on the three databases and, as the control, on Redis and RabbitMQ
(where that broker has the feature): headers, message TTL, the event loop, failover,
priority, requeue and reject, fanout and topic.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from queue import Empty
from typing import Any

import pytest
from celery import Celery
from kombu import Connection, Consumer, Exchange, Producer, Queue
from kombu.asynchronous import Hub
from kombu.message import Message

import kombu_sqlinbox  # noqa: F401  (registers the sqlinbox aliases)
from tests.databases import CONTROLS, DATABASES, require_control

Connect = Callable[..., Connection]

#: brokers that keep a message's or a queue's TTL (kombu's Redis transport ignores both)
WITH_TTL = (*DATABASES, "rabbitmq")
#: brokers that order by priority, higher first (Redis takes 0 as the highest)
HIGHER_FIRST = (*DATABASES, "rabbitmq")
#: brokers that route fanout and topic exchanges across connections (kombu's Redis fanout,
#: over pub/sub, delivered nothing here even to a consumer that had polled once)
ROUTING = (*DATABASES, "rabbitmq")

#: a broker of each kind that is down: a port nothing listens on, a file that cannot open
DEAD_URLS = {
    "postgresql": "sqlinbox+postgresql://postgres@127.0.0.1:5439/test",
    "mysql": "sqlinbox+mysql+pymysql://root@127.0.0.1:3309/test",
    "sqlite": "sqlinbox+sqlite:////nonexistent-directory/inbox.db",
    "redis": "redis://127.0.0.1:6390/7",
    "rabbitmq": "amqp://guest:guest@127.0.0.1:5673//",
}
#: a message TTL short enough to wait out (only messages meant to expire carry it)
TTL = 0.3
#: a queue's message TTL, which a message meant to be delivered carries too: long enough to
#: consume it within on a loaded machine, short enough to wait out
QUEUE_TTL = 1.0


@pytest.fixture(params=(*DATABASES, *CONTROLS))
def database(request: pytest.FixtureRequest) -> str:
    """Each database in turn, then each control broker."""
    return str(request.param)


@pytest.fixture
def url(database: str, request: pytest.FixtureRequest) -> str:
    if database in CONTROLS:
        return require_control(database)
    return str(request.getfixturevalue("broker_url"))


@pytest.fixture
def options(database: str, request: pytest.FixtureRequest) -> dict[str, Any]:
    """The transport options every connection of the test takes (none on a control)."""
    if database in CONTROLS:
        return {}
    return {"table_prefix": request.getfixturevalue("table_prefix"), "polling_interval": 0.05}


@pytest.fixture
def names(url: str, database: str) -> Iterator[Callable[[], str]]:
    """Queue names no other test uses; on a control broker, deleted afterwards."""
    made: list[str] = []

    def name() -> str:
        made.append(f"k{uuid.uuid4().hex[:10]}")
        return made[-1]

    yield name
    if database in CONTROLS:
        with Connection(url) as conn:
            for queue in made:
                conn.default_channel.queue_delete(queue)


@pytest.fixture
def connect(url: str, options: dict[str, Any]) -> Iterator[Connect]:
    opened: list[Connection] = []

    def open_connection(to: str = url, **more: Any) -> Connection:
        conn = Connection(to, transport_options={**options, **more})
        opened.append(conn)
        return conn

    yield open_connection
    for conn in reversed(opened):
        conn.release()


def count(conn: Connection, queue: str) -> int:
    """The broker's count of a plain queue's ready messages (a passive declaration fails on
    Redis for a queue with no messages)."""
    declared = queue_of(queue)(conn.default_channel).queue_declare()
    return int(declared.message_count)


def queue_of(name: str, **arguments: Any) -> Queue:
    """A queue on the default exchange, as ``SimpleQueue`` makes one from a name."""
    return Queue(name, routing_key=name, **arguments)


def test_headers_round_trip_exactly(connect: Connect, names: Callable[[], str]) -> None:
    conn = connect()
    queue = conn.SimpleQueue(names())
    queue.put({"n": 1}, headers={"k1": "v1"})
    message = queue.get(timeout=10)
    assert message.headers == {"k1": "v1"}
    message.ack()


@pytest.mark.databases(*WITH_TTL)
def test_an_expired_message_is_not_delivered(
        connect: Connect, names: Callable[[], str]) -> None:
    conn = connect()
    name = names()
    queue = conn.SimpleQueue(name)
    queue.put("short-lived", expiration=TTL)
    queue.put("lasting", expiration=60)
    queue.put("forever")
    time.sleep(TTL * 2)  # the time to pass is what is under test
    assert [queue.get(timeout=10).payload for _ in range(2)] == ["lasting", "forever"]
    with pytest.raises(Empty):
        queue.get(block=False)
    assert count(conn, name) == 0


@pytest.mark.databases(*WITH_TTL)
def test_a_queue_message_ttl_expires_its_messages(
        connect: Connect, names: Callable[[], str]) -> None:
    conn = connect()
    queue = conn.SimpleQueue(queue_of(names(), message_ttl=QUEUE_TTL))
    queue.put("stale")
    time.sleep(QUEUE_TTL + TTL)  # the time to pass is what is under test
    with pytest.raises(Empty):
        queue.get(block=False)
    queue.put("fresh")
    assert queue.get(timeout=10).payload == "fresh"


@pytest.mark.databases(*DATABASES)
def test_an_expired_message_goes_to_the_dead_letter_queue(
        connect: Connect, names: Callable[[], str]) -> None:
    name, dead = names(), names()
    conn = connect(queues={name: {"dead_letter_queue": dead}})
    queue = conn.SimpleQueue(name)
    queue.put("short-lived", headers={"k1": "v1"}, expiration=TTL)
    time.sleep(TTL * 2)
    with pytest.raises(Empty):
        queue.get(block=False)
    parked = conn.SimpleQueue(dead).get(timeout=10)
    assert parked.payload == "short-lived"
    assert parked.headers["k1"] == "v1"
    assert parked.headers["x-sqlinbox-death"]["reason"] == "expired"


class EventLoop:
    """A kombu hub consuming one queue of a connection, run by the test, a turn at a time."""

    def __init__(self, conn: Connection, queue: Queue,
                 on_message: Callable[[Message], None] | None = None) -> None:
        self.hub = Hub()
        self.received: list[Message] = []
        conn.register_with_event_loop(self.hub)
        self.consumer = Consumer(conn, [queue], on_message=on_message or self.received.append)
        self.consumer.consume()

    def run_until(self, done: Callable[[], bool], what: str, timeout: float = 10) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            assert time.monotonic() < deadline, f"the hub did not {what} within {timeout} s"
            self.hub.run_once()

    def close(self) -> None:
        self.consumer.cancel()
        self.hub.close()


def test_event_loop_consume_with_an_ack_from_another_thread(
        connect: Connect, names: Callable[[], str]) -> None:
    conn, sender = connect(), connect()
    queue = queue_of(names())
    received: list[Message] = []

    def on_message(message: Message) -> None:
        received.append(message)
        threading.Thread(target=loop.hub.call_soon, args=(message.ack,)).start()

    loop = EventLoop(conn, queue, on_message)
    try:
        Producer(sender).publish({"n": 1}, routing_key=queue.name, declare=[queue])
        loop.run_until(lambda: bool(received), "deliver the message")
        loop.run_until(lambda: received[0].acknowledged, "run the other thread's ack")
    finally:
        loop.close()
    conn.release()  # an unacked message would go back to the queue here
    assert received[0].payload == {"n": 1}
    assert count(sender, queue.name) == 0
    with pytest.raises(Empty):
        sender.SimpleQueue(queue).get(block=False)


@pytest.mark.databases(*DATABASES)
def test_event_loop_wakes_on_a_publish_in_the_same_process(
        connect: Connect, names: Callable[[], str]) -> None:
    """Polling every 30 s, the in-process wake-up (a hub reader) delivers at once."""
    conn, sender = connect(polling_interval=30), connect(polling_interval=30)
    queue = queue_of(names())
    sender.SimpleQueue(queue)  # declared, so the consumer's first claim finds it empty
    loop = EventLoop(conn, queue)
    try:
        Producer(sender).publish({"n": 1}, routing_key=queue.name)
        loop.run_until(lambda: bool(loop.received), "deliver the message", timeout=5)
        loop.received[0].ack()
        conn.release()  # a closed connection leaves the hub: no readers, no polling timer
        assert not loop.hub.readers
        assert all(scheduled.entry.canceled for scheduled in loop.hub.timer.queue)
    finally:
        loop.close()


@pytest.mark.databases(*DATABASES)
def test_event_loop_delivers_a_backlog_a_claim_at_a_time(
        connect: Connect, names: Callable[[], str]) -> None:
    """Polling every 30 s, a backlog five times a claim's size goes out in later turns of
    the loop, not at the next poll."""
    conn = connect(polling_interval=30, max_batch=2)
    queue = queue_of(names())
    producer = Producer(conn)
    for n in range(10):
        producer.publish(n, routing_key=queue.name, declare=[queue], serializer="json")
    loop = EventLoop(conn, queue)
    try:
        loop.run_until(lambda: len(loop.received) == 10, "deliver the backlog", timeout=5)
        for message in loop.received:
            message.ack()
    finally:
        loop.close()
    assert sorted(message.payload for message in loop.received) == list(range(10))


@pytest.mark.databases("postgresql")
def test_event_loop_wakes_on_a_notify(connect: Connect, names: Callable[[], str]) -> None:
    """Polling every 30 s, a NOTIFY from another broker (as from another process) on the
    LISTEN socket (a hub reader) delivers at once."""
    conn, sender = connect(polling_interval=30), connect(polling_interval=30, max_batch=7)
    assert conn.transport.broker is not sender.transport.broker
    queue = queue_of(names())
    sender.SimpleQueue(queue)
    loop = EventLoop(conn, queue)
    try:
        loop.run_until(lambda: len(loop.hub.readers) == 2, "read its LISTEN socket")
        Producer(sender).publish({"n": 1}, routing_key=queue.name)
        loop.run_until(lambda: bool(loop.received), "deliver the message", timeout=5)
    finally:
        loop.close()


def test_failover_from_a_dead_url_to_a_live_one(
        database: str, url: str, options: dict[str, Any], connect: Connect,
        names: Callable[[], str]) -> None:
    dead = DEAD_URLS[database]
    celery = Celery(set_as_current=False, broker=[dead, url])
    celery.conf.broker_transport_options = options
    for conn in (connect(f"{dead};{url}"), Connection(dead, alternates=[url],
                                                       transport_options=options),
                 celery.connection_for_write()):
        try:
            conn.ensure_connection(max_retries=3, interval_start=0, interval_step=0)
            name = names()
            conn.SimpleQueue(name).put("after failover")
            assert conn.SimpleQueue(name).get(timeout=10).payload == "after failover"
        finally:
            conn.release()


@pytest.mark.databases(*HIGHER_FIRST)
def test_priority_higher_first(connect: Connect, names: Callable[[], str]) -> None:
    conn = connect()
    queue = conn.SimpleQueue(queue_of(names(), max_priority=9))
    for priority in (1, 9, 5):
        queue.put(priority, priority=priority)
    assert [queue.get(timeout=10).payload for _ in range(3)] == [9, 5, 1]


@pytest.mark.databases(*HIGHER_FIRST)
def test_priority_higher_first_on_a_transient_queue(connect: Connect) -> None:
    """kombu's ``SimpleBuffer`` (not durable, auto-delete, exclusive on RabbitMQ: gone
    with its connection, so not one of ``names``) with ``max_priority``."""
    conn = connect()
    buffer = conn.SimpleBuffer(f"k{uuid.uuid4().hex[:10]}", queue_opts={"max_priority": 9})
    for priority in (1, 9, 5, 1):
        buffer.put(priority, priority=priority)
    assert [buffer.get(timeout=10).payload for _ in range(4)] == [9, 5, 1, 1]


@pytest.mark.databases(*HIGHER_FIRST)
def test_a_requeued_transient_message_keeps_its_priority(
        connect: Connect, names: Callable[[], str]) -> None:
    """One message prefetched at a time: what a consumer prefetched is not overtaken."""
    conn = connect()
    queue = conn.SimpleQueue(queue_of(names(), max_priority=9, durable=False,
                                      auto_delete=True))
    queue.consumer.qos(prefetch_count=1)
    for priority in (5, 9, 1):
        queue.put(priority, priority=priority)
    queue.get(timeout=10).requeue()
    got = []
    for _ in range(3):
        message = queue.get(timeout=10)
        got.append(message.payload)
        message.ack()
    assert got == [9, 5, 1]


def test_requeue_delivers_again_and_reject_drops(
        connect: Connect, names: Callable[[], str]) -> None:
    conn = connect()
    name = names()
    queue = conn.SimpleQueue(name)
    queue.put("once more")
    first = queue.get(timeout=10)
    assert not first.delivery_info.get("redelivered")
    first.requeue()
    again = queue.get(timeout=10)
    assert again.payload == "once more"
    again.reject()
    with pytest.raises(Empty):
        queue.get(block=False)
    assert count(conn, name) == 0


def two_consumers(connect: Connect, exchange: Exchange, keys: list[str],
                  names: Callable[[], str]) -> list[list[Any]]:
    """Publish through ``exchange`` from a third connection after two others bound a queue
    each with ``keys``; what each one received."""
    received: list[list[Any]] = [[], []]
    consumers = []
    for index, key in enumerate(keys):
        conn = connect()
        queue = Queue(names(), exchange, routing_key=key)
        consumer = Consumer(conn, [queue], accept=["json"],
                            callbacks=[lambda body, message, index=index: (
                                received[index].append(body), message.ack())])
        consumer.consume()
        consumers.append((conn, consumer))
        _drain(conn, [], 0.1)  # Redis subscribes a fanout consumer on its first poll
    producer = Producer(connect(), exchange)
    for key in ("a.b", "x.y"):
        producer.publish(key, routing_key=key, serializer="json")
    return [_drain(conn, got) for (conn, _), got in zip(consumers, received, strict=True)]


def _drain(conn: Connection, got: list[Any], quiet: float = 1.0) -> list[Any]:
    """What arrives until ``quiet`` seconds pass with nothing."""
    try:
        while True:
            conn.drain_events(timeout=quiet)
    except TimeoutError:
        return got


@pytest.mark.databases(*ROUTING)
def test_fanout_reaches_every_bound_queue_across_connections(
        connect: Connect, names: Callable[[], str]) -> None:
    exchange = Exchange(names(), type="fanout")
    assert two_consumers(connect, exchange, ["", ""], names) == [["a.b", "x.y"]] * 2


@pytest.mark.databases(*ROUTING)
def test_topic_routes_by_pattern_across_connections(
        connect: Connect, names: Callable[[], str]) -> None:
    exchange = Exchange(names(), type="topic")
    assert two_consumers(connect, exchange, ["a.*", "#"], names) == [["a.b"], ["a.b", "x.y"]]


@pytest.mark.databases(*DATABASES, "redis")  # RabbitMQ's count lags behind its recover-ok
def test_basic_recover_gives_unacked_messages_back_at_once(
        connect: Connect, names: Callable[[], str]) -> None:
    conn = connect()
    name = names()
    queue = conn.SimpleQueue(name)
    for n in range(2):
        queue.put(n)
    held = conn.default_channel.basic_get(name)
    assert held is not None and count(conn, name) == 1
    conn.default_channel.basic_recover(requeue=True)
    assert count(conn, name) == 2


@pytest.mark.databases(*DATABASES, "redis")  # RabbitMQ sends an unlimited consumer all
def test_a_cancelled_consumer_gives_back_what_it_did_not_deliver(
        connect: Connect, names: Callable[[], str]) -> None:
    """Without a prefetch limit one claim takes both rows; one is delivered."""
    conn = connect()
    queue = queue_of(names())
    producer = Producer(conn)
    for n in range(2):
        producer.publish(n, routing_key=queue.name, declare=[queue], serializer="json")
    received: list[Message] = []
    consumer = Consumer(conn, [queue], on_message=received.append)
    consumer.consume()
    conn.drain_events(timeout=10)
    consumer.cancel()
    assert [message.payload for message in received] == [0]
    assert count(conn, queue.name) == 1  # the delivered one stays unacked
