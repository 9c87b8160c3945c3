"""A consumed queue whose expiry passed anyway (its process could not reach the database
for longer than ``x-expires``) and that another process swept: the consumer registers it
again, its table and bindings included, whatever order the sweep and the registration
run in, and messages published after reach it.

Connections with different transport options get brokers of their own, as other
processes would; the racing test runs real sweeping processes.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import textwrap
from typing import Any

import pytest
from kombu import Connection, Exchange, Queue
from sqlalchemy import event, inspect, text
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError

from tests.processes import Processes
from tests.tcp_proxy import Proxy

from .conftest import Connect
from .support import broker_of, quoted, wait_for

JOBS = Exchange("jobs")
#: the queue's x-expires (seconds): its consumer renews it every quarter of that
EXPIRES = 0.4


def jobs(**arguments: Any) -> Queue:
    return Queue("jobs", JOBS, "jobs", **arguments)


def registered(engine: Engine, prefix: str) -> int:
    with engine.connect() as db:
        return int(db.execute(text(
            f"SELECT COUNT(*) FROM {quoted(engine, prefix + 'queues')} WHERE name = 'jobs'"))
            .scalar_one())


def backdate(engine: Engine, prefix: str) -> None:
    """What a consumer that could not renew its queue leaves: an expiry in the past."""
    with engine.begin() as db:
        db.execute(text(f"UPDATE {quoted(engine, prefix + 'queues')} SET expires_at = 0 "
                        "WHERE name = 'jobs'"))


def receive(conn: Connection, received: list[Any], what: str) -> None:
    """Drain until ``what`` arrives (bounded)."""
    def arrived() -> bool | None:
        with contextlib.suppress(TimeoutError):
            conn.drain_events(timeout=0.2)
        return what in received or None
    wait_for(arrived, f"{what!r} to arrive")


@pytest.mark.databases("postgresql", "mysql")  # a file has no connection to break
def test_a_queue_swept_during_its_consumers_outage_comes_back_with_its_table(
    connect: Connect, engine: Engine, table_prefix: str, db_url: str, proxy: Proxy,
    caplog: pytest.LogCaptureFixture,
) -> None:
    consumer = Connection("sqlinbox+" + proxy.url(db_url),  # its database can be cut off
                          transport_options={"table_prefix": table_prefix,
                                             "polling_interval": 0.05})
    sweeper = broker_of(connect(polling_interval=0.06, sweep_interval=0.01))
    received: list[Any] = []
    with caplog.at_level(logging.WARNING, logger="kombu_sqlinbox"), consumer.Consumer(
            [jobs(expires=EXPIRES)], callbacks=[lambda body, m: received.append(body)]):
        table = broker_of(consumer).table("jobs").spec.table
        sweeper.routes.available()
        with proxy.refuse():  # the consumer cannot renew: the expiry passes, a sweep takes it
            wait_for(lambda: (sweeper.sweep(), not inspect(engine).has_table(table))[1] or None,
                     "another process to sweep the queue and drop its table")
            wait_for(lambda: "renewing the expiry of consumed queues failed" in caplog.text
                     or None, "the consumer's renewal to fail")
        wait_for(lambda: (inspect(engine).has_table(table)
                          and registered(engine, table_prefix) == 1) or None,
                 "the consumer to register the queue and its table again")
        assert "expired while consumed; registering it again" in caplog.text
        connect(polling_interval=0.07).Producer().publish(
            "after", exchange=JOBS, routing_key="jobs")
        receive(consumer, received, "after")
    consumer.release()


def test_a_table_dropped_after_its_consumer_registered_it_again_is_created_again(
    connect: Connect, engine: Engine, table_prefix: str,
) -> None:
    """The sweep that raced the registration dropped the table after it (the registry row
    is back, the table is gone): the consumer's next claim fails, and it restores the
    table instead of failing for good."""
    consumer = connect()
    received: list[Any] = []
    with consumer.Consumer([jobs(expires=EXPIRES)],
                           callbacks=[lambda body, m: received.append(body)]):
        table = broker_of(consumer).table("jobs").spec.table
        with engine.begin() as db:
            db.execute(text(f"DROP TABLE {quoted(engine, table)}"))
        with pytest.raises(TimeoutError):
            consumer.drain_events(timeout=0.5)  # the failed claim, then nothing
        assert inspect(engine).has_table(table)
        assert registered(engine, table_prefix) == 1
        connect(polling_interval=0.07).Producer().publish(
            "after", exchange=JOBS, routing_key="jobs")
        receive(consumer, received, "after")


@pytest.mark.databases("postgresql", "mysql")  # SQLite: one writer, no such interleaving
@pytest.mark.parametrize("drops", [1, 2])
def test_a_table_dropped_again_while_its_consumer_restores_it(
    connect: Connect, engine: Engine, table_prefix: str, caplog: pytest.LogCaptureFixture,
    drops: int,
) -> None:
    """Sweeps racing the consumer's restoring the table: another process creates the table
    and a sweep drops it again between the consumer's ``CREATE TABLE IF NOT EXISTS`` and
    its check of the table. Once: the check looks again and creates it. Twice: the
    consumer registers the queue again at a later claim. Either way it comes back."""
    consumer = connect()
    creator = broker_of(connect(polling_interval=0.06))
    received: list[Any] = []
    with consumer.Consumer([jobs(expires=EXPIRES)],
                           callbacks=[lambda body, m: received.append(body)]):
        broker = broker_of(consumer)
        table = broker.table("jobs").spec.table
        drop = text(f"DROP TABLE IF EXISTS {quoted(engine, table)}")
        left = [drops]

        def ensuring(statement: str) -> bool:
            return bool(left[0]) and statement.startswith("CREATE TABLE IF NOT EXISTS") and (
                table in statement)

        def created_elsewhere(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
            if ensuring(statement):
                creator.forget_table("jobs")
                creator.table("jobs")

        def dropped_by_a_sweep(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
            if ensuring(statement):
                left[0] -= 1
                with engine.begin() as db:
                    db.execute(drop)

        event.listen(broker.engine, "before_cursor_execute", created_elsewhere)
        event.listen(broker.engine, "after_cursor_execute", dropped_by_a_sweep)
        try:
            with engine.begin() as db:  # the sweep that raced the registration
                db.execute(drop)
            def raced() -> bool | None:
                with contextlib.suppress(TimeoutError):
                    consumer.drain_events(timeout=0.2)
                return not left[0] or None

            with caplog.at_level(logging.WARNING, logger="kombu_sqlinbox"):
                wait_for(raced, "the consumer to restore the table, the sweeps racing it")
        finally:
            event.remove(broker.engine, "before_cursor_execute", created_elsewhere)
            event.remove(broker.engine, "after_cursor_execute", dropped_by_a_sweep)
        connect(polling_interval=0.07).Producer().publish(
            "after", exchange=JOBS, routing_key="jobs")
        receive(consumer, received, "after")
    assert inspect(engine).has_table(table)
    assert ("could not be registered again yet" in caplog.text) == (drops == 2)


def test_a_dropped_table_of_a_queue_without_expiry_still_fails_its_consumer(
    connect: Connect, engine: Engine,
) -> None:
    """Only a queue this process declared with an expiry is registered again: another's
    table dropped under its consumer is an error, as before."""
    consumer = connect()
    with consumer.Consumer([jobs()], callbacks=[lambda body, m: None]):
        table = broker_of(consumer).table("jobs").spec.table
        with engine.begin() as db:
            db.execute(text(f"DROP TABLE {quoted(engine, table)}"))
        with pytest.raises(DBAPIError):
            consumer.drain_events(timeout=0.5)


SWEEPER = textwrap.dedent("""
    import sys, time
    from kombu import Connection
    from sqlalchemy import text
    import kombu_sqlinbox  # registers the sqlinbox alias
    url, prefix, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
    conn = Connection(url, transport_options={"table_prefix": prefix, "sweep_interval": 0.001})
    broker = conn.default_channel.broker
    broker.routes.available()
    queues = broker.dialect.quote(prefix + "queues")
    swept = 0
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        with broker.engine.begin() as db:  # the consumer's renewal missed, again and again
            db.execute(text(f"UPDATE {queues} SET expires_at = 0 WHERE name = 'jobs'"))
        broker.sweep()
        swept += 1
        time.sleep(0.01)  # a sweep every 10 ms from each: far more often than ever
    print("swept", swept, flush=True)
""")
#: seconds the sweepers race the consumer
RACE = 3.0


def test_sweeps_racing_the_consumers_registrations_leave_the_queue_alive(
    connect: Connect, engine: Engine, table_prefix: str, broker_url: str,
    processes: Processes,
) -> None:
    """Two processes expire and sweep the consumed queue over and over while its consumer
    registers it again: the consumer never fails, and once they stop, the queue, its
    table and its binding are there and a message published reaches the consumer.
    (What the queue held when a sweep took it went with it, as with any expired queue;
    a publish into the table just dropped fails, to its publisher.)"""
    consumer = connect()
    received: list[Any] = []
    with consumer.Consumer([jobs(expires=EXPIRES)],
                           callbacks=[lambda body, m: received.append(body)]):
        table = broker_of(consumer).table("jobs").spec.table
        sweepers = [processes.spawn(f"sweeper{n}", [sys.executable, "-c", SWEEPER, broker_url,
                                                   table_prefix, str(RACE)])
                    for n in range(2)]
        publisher = connect(polling_interval=0.07).Producer()
        sent = 0
        while any(proc.popen.poll() is None for proc in sweepers):
            # a publish into the table a sweep just dropped fails, to the publisher
            with contextlib.suppress(DBAPIError):
                publisher.publish(sent, exchange=JOBS, routing_key="jobs")
            sent += 1
            with contextlib.suppress(TimeoutError):
                consumer.drain_events(timeout=0.05)
        for proc in sweepers:
            assert proc.wait(10) == 0, proc.tail()
            assert "swept" in proc.output()
        wait_for(lambda: (inspect(engine).has_table(table)
                          and registered(engine, table_prefix) == 1) or None,
                 "the queue registered, with its table")
        # a publisher whose bindings cache is fresh: the binding is back too
        connect(polling_interval=0.08).Producer().publish(
            "after", exchange=JOBS, routing_key="jobs")
        receive(consumer, received, "after")
    assert sent > 10
