"""Throughput counts of awkward names on every database and driver: queues whose names
differ only in case (MariaDB's default collation would fold them) or in a trailing space
each keep their own row, and so does a queue name of 255 four-byte characters; a process
whose host name is long is written whole. A child forked while a thread of its parent
holds the counter's lock counts on its own lock, none of its parent's counts. Acks of a
transient queue (events, replies, pidbox) are not counted."""

from __future__ import annotations

import os
import signal
import socket
import threading

import pytest
from kombu import Connection, Exchange, Queue

from kombu_sqlinbox.broker import Broker
from kombu_sqlinbox.brokers import close_all
from kombu_sqlinbox.options import parse_options
from kombu_sqlinbox.throughput import last_hour
from tests.processes import wait_until

pytestmark = pytest.mark.drivers

#: how long the forked child and the lock's holder may take
FORK_LIMIT = 10.0
#: names a case- or space-folding comparison would merge, and the longest name a queue has
NAMES = ("Jobs", "jobs", "jobs ", "\U0001f600" * 255)


def test_names_differing_in_case_or_space_keep_their_own_counts(
        broker_url: str, table_prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    broker = Broker(broker_url.removeprefix("sqlinbox+"), parse_options(
        {"table_prefix": table_prefix}))
    counter = broker.throughput
    sql = broker.dialect.throughput_statements(table_prefix)
    # a host name as long as Linux allows
    monkeypatch.setattr(socket, "gethostname", lambda: "h" * 64)
    try:
        for _round in range(2):  # the second flush adds to the rows the first made
            for n, name in enumerate(NAMES, 1):
                for _ in range(n):
                    counter.count(name)
            assert counter.flush() and counter.pending() == 0
        found = last_hour(broker.database, table_prefix)
        assert {name: sum(bars) for name, bars in found.items()} == {
            name: 2 * n for n, name in enumerate(NAMES, 1)}
        processes = broker.run(lambda conn: {str(p) for p, in conn.exec_driver_sql(
            f"SELECT DISTINCT {broker.dialect.name_text('process')} FROM "
            f"{broker.dialect.quote(sql.names[0])}")}, read_only=True)
        assert len(processes) == 1 and processes.pop().startswith("h" * 64 + ".")
    finally:
        broker.run(lambda conn: conn.exec_driver_sql(sql.drop[0]))
        broker.close()


def test_a_child_forked_while_a_thread_holds_the_counter_s_lock_counts_its_own(
        broker_url: str, table_prefix: str) -> None:
    # a prefork pool forks whenever it likes: here while another thread holds the lock
    broker = Broker(broker_url.removeprefix("sqlinbox+"), parse_options(
        {"table_prefix": table_prefix}))
    counter = broker.throughput
    for _ in range(3):
        counter.count("jobs")
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with counter._lock:
            held.set()
            release.wait(FORK_LIMIT)

    holder = threading.Thread(target=hold)
    holder.start()
    assert held.wait(FORK_LIMIT)
    child = os.fork()
    if child == 0:  # the child: a lock of its own, none of its parent's counts
        try:
            counter.count("jobs")
            os._exit(0 if counter.pending() == 1 else 3)
        finally:
            os._exit(4)
    release.set()
    holder.join(FORK_LIMIT)
    reaped: list[int] = []

    def exited() -> bool:
        done, status = os.waitpid(child, os.WNOHANG)
        if done:
            reaped.append(status)
        return bool(done)

    try:
        wait_until(exited, FORK_LIMIT, "the forked child to exit (not hung on the lock)",
                   interval=0.01)
        status = reaped[0]
        assert os.waitstatus_to_exitcode(status) == 0
        assert counter.pending() == 3 and counter.flush()  # the parent's, written by it
        assert sum(last_hour(broker.database, table_prefix)["jobs"]) == 3
    finally:
        if not reaped:
            os.kill(child, signal.SIGKILL)
            os.waitpid(child, 0)
        broker.run(lambda conn: conn.exec_driver_sql(
            broker.dialect.throughput_statements(table_prefix).drop[0]))
        broker.close()


def test_transient_queues_acks_are_not_counted(broker_url: str, table_prefix: str) -> None:
    # events, replies and pidbox queues are not durable: their acks never reach the table
    options = {"table_prefix": table_prefix}
    transient = Queue(f"celeryev.{table_prefix}", Exchange(f"{table_prefix}ev", "topic"),
                      routing_key="#", durable=False, auto_delete=True)
    with Connection(broker_url, transport_options=options) as conn:
        counter = conn.default_channel.broker.throughput
        for queue in (transient, Queue(f"{table_prefix}kept", routing_key=f"{table_prefix}kept")):
            with conn.SimpleQueue(queue) as simple:
                for n in range(3):
                    simple.put({"n": n})
                for _ in range(3):
                    simple.get(timeout=FORK_LIMIT).ack()
        assert counter.pending() == 3  # the durable queue's only
        assert counter.flush()
        found = last_hour(conn.default_channel.broker.database, table_prefix)
        assert {name: sum(bars) for name, bars in found.items()} == {f"{table_prefix}kept": 3}
        conn.default_channel.broker.run(lambda db: db.exec_driver_sql(
            conn.default_channel.broker.dialect.throughput_statements(table_prefix).drop[0]))
    close_all()
