"""Wake-ups: an idle consumer starts on a new row long before its polling interval ends.

On PostgreSQL a publish NOTIFYs the table's channel in its own transaction and an
idle consumer in another process, waiting in ``select()`` on its LISTEN socket,
wakes at once. On SQLite and MariaDB a publish signals the consumers of its own
host through Unix sockets (the same-host signal). With ``notify=False`` only the
polling interval finds the row -- except in the publishing process itself,
whose consumers are poked in-process. Latency figures are in bench/ordering.py;
these tests only bound them.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from kombu import Consumer, Queue

from kombu_sqlinbox.dialects import dialect_for
from kombu_sqlinbox.wakeups import SETTLED_NS
from tests.ordering.conftest import Ordering, publish
from tests.processes import wait_until

MESSAGES = 3
#: an idle consumer's polling interval where something else must wake it, and how soon
#: after a publish it is woken at the latest, on a loaded machine
POLLED, WOKEN = 30.0, 3.0


def arrivals(ordering: Ordering, name: str) -> list[float]:
    """How long after publishing each message reached the consumer program, in order."""
    path = ordering.marker(name, "lat")
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line)["delay"] for line in lines]


def arrived(ordering: Ordering, name: str, count: int) -> bool:
    return len(arrivals(ordering, name)) >= count


def delays_to_another_process(ordering: Ordering, polling_interval: float,
                              **options: Any) -> list[float]:
    """Publish one message at a time to an idle consumer process; each after the last
    arrived, so each one finds the consumer waiting."""
    options["polling_interval"] = polling_interval
    conn = ordering.connect("jobs", "plain", **options)
    conn.default_channel.queue_declare("jobs")
    consumer = ordering.consumer("idle", "jobs", "plain", mode="latency", options=options,
                                 drain_timeout=60, expect=MESSAGES)
    for i in range(MESSAGES):
        publish(conn, "jobs", [({"i": i, "sent": time.time()}, {})])
        wait_until(partial(arrived, ordering, "idle", i + 1), polling_interval + 10,
                   f"message {i} to arrive", alive=[consumer], interval=0.01)
    return arrivals(ordering, "idle")


@pytest.mark.slow
@pytest.mark.parametrize("database", ["postgresql"])
def test_notify_wakes_an_idle_consumer_in_another_process(ordering: Ordering) -> None:
    delays = delays_to_another_process(ordering, polling_interval=POLLED)
    # tens of milliseconds on an idle machine; waiting for its poll would take 30 s
    assert max(delays) < WOKEN, f"publish -> delivery took {delays} s with NOTIFY"


@pytest.mark.slow
@pytest.mark.parametrize("database", ["postgresql"])
def test_without_notify_another_process_waits_for_its_polling_interval(
        ordering: Ordering) -> None:
    interval = 2.0
    # polling_interval_min too: no quick look right after a delivery finds the next row
    delays = delays_to_another_process(ordering, polling_interval=interval, notify=False,
                                       polling_interval_min=interval)
    assert all(delay < interval + WOKEN for delay in delays), delays
    # a publish may land before the consumer's own next claim right after a delivery (no
    # wake-up needed then); the others wait for the polling interval, since nothing wakes it
    waited = [delay for delay in delays if delay > interval / 2]
    assert len(waited) >= len(delays) - 1, delays


def test_a_publish_wakes_a_consumer_of_the_same_process(ordering: Ordering) -> None:
    """Publisher and consumer share the process's broker: the publish pokes the wait.
    ``notify=False`` and no quick polling, so that only the poke can be what wakes it."""
    options = {"polling_interval": POLLED, "polling_interval_min": POLLED, "notify": False}
    consumer_conn = ordering.connect("jobs", "plain", **options)
    publisher = ordering.connect("jobs", "plain", **options)
    publisher.default_channel.queue_declare("jobs")
    delays: list[float] = []
    arrived = threading.Event()

    def on_message(body: dict[str, Any], message: Any) -> None:
        delays.append(time.time() - body["sent"])
        message.ack()
        arrived.set()

    def publish_while_idle() -> None:
        for i in range(MESSAGES):
            time.sleep(0.3)  # the consumer's idle gap: it is waiting by now
            publish(publisher, "jobs", [({"i": i, "sent": time.time()}, {})])
            arrived.wait(10)
            arrived.clear()

    with Consumer(consumer_conn.default_channel, [Queue("jobs")], callbacks=[on_message],
                  accept=["json"]):
        thread = threading.Thread(target=publish_while_idle)
        thread.start()
        deadline = time.monotonic() + 30
        while len(delays) < MESSAGES and time.monotonic() < deadline:
            consumer_conn.drain_events(timeout=10)
        thread.join(10)
    assert len(delays) == MESSAGES and max(delays) < WOKEN, delays


# -- the same-host signal (SQLite, MariaDB) ---------------------------------------------
#: polling so slow that only the signal can explain a quick delivery
NO_POLLING = {"polling_interval": POLLED, "polling_interval_min": POLLED}
SIGNALLED = ["sqlite", "mysql"]


@pytest.fixture
def signalled(ordering: Ordering, monkeypatch: pytest.MonkeyPatch) -> Iterator[Ordering]:
    """``ordering`` with a temporary directory of the test's own, for this process and the
    ones it starts: MariaDB's signal directory lies under it, so that no other test's
    consumers of the same server share it (a short path: a Unix socket's must fit in 108
    bytes)."""
    path = Path(tempfile.mkdtemp(prefix="wk", dir="/tmp"))
    monkeypatch.setenv("TMPDIR", str(path))
    monkeypatch.setattr(tempfile, "tempdir", str(path))
    yield ordering
    shutil.rmtree(path, ignore_errors=True)


def signal_directory(ordering: Ordering) -> Path:
    """Where the consumers of the test's database on this host bind their sockets."""
    directory = dialect_for(ordering.engine).signal_directory()
    assert directory is not None, f"no same-host signal on {ordering.engine.dialect.name}"
    return Path(directory)


def sockets(directory: Path) -> list[Path]:
    return sorted(directory.iterdir()) if directory.is_dir() else []


@pytest.mark.slow
@pytest.mark.parametrize("database", SIGNALLED)
def test_the_same_host_signal_wakes_a_consumer_in_another_process(
        signalled: Ordering) -> None:
    delays = delays_to_another_process(signalled, **NO_POLLING)
    assert max(delays) < WOKEN, f"publish -> delivery took {delays} s with the signal"


@pytest.mark.slow
@pytest.mark.parametrize("database", SIGNALLED)
def test_a_killed_consumers_socket_is_removed_and_nothing_is_lost(
        signalled: Ordering) -> None:
    """``kill -9`` leaves the consumer's socket behind: the next publish finds it dead and
    removes it; its message goes, once, to the consumer started after."""
    conn = signalled.connect("jobs", "plain", **NO_POLLING)
    conn.default_channel.queue_declare("jobs")
    doomed = signalled.consumer("doomed", "jobs", "plain", mode="latency",
                               options=NO_POLLING, drain_timeout=60)
    directory = signal_directory(signalled)
    left = wait_until(lambda: sockets(directory), 30, "the consumer's socket")
    doomed.kill()
    doomed.wait(10)
    assert sockets(directory) == left  # nobody removed it
    publish(conn, "jobs", [({"i": 0, "sent": time.time()}, {})])
    assert not sockets(directory), "the dead consumer's socket is still there"
    signalled.consumer("next", "jobs", "plain", mode="latency", options=NO_POLLING,
                      drain_timeout=60, expect=2)
    publish(conn, "jobs", [({"i": 1, "sent": time.time()}, {})])
    wait_until(partial(arrived, signalled, "next", 2), 20, "both messages to arrive",
               interval=0.01)
    assert len(arrivals(signalled, "next")) == 2
    assert max(arrivals(signalled, "next")[1:]) < WOKEN  # the live one is woken


@pytest.mark.parametrize("database", ["sqlite"])
def test_a_socket_whose_queue_is_full_does_not_fail_a_publish(signalled: Ordering) -> None:
    """A consumer that reads its socket late: once its queue is full, sends to it fail
    (EAGAIN) and the publishes go on; the socket stays, as its process lives."""
    conn = signalled.connect("jobs", "plain", **NO_POLLING)
    conn.default_channel.queue_declare("jobs")
    directory = signal_directory(signalled)
    directory.mkdir(exist_ok=True)
    slow = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    slow.bind(str(directory / "slow"))
    try:
        publish(conn, "jobs", [({"i": i, "sent": time.time()}, {}) for i in range(30)])
        assert sockets(directory) == [directory / "slow"]
        slow.setblocking(False)
        waiting = 0
        with contextlib.suppress(BlockingIOError):
            while slow.recv(16):
                waiting += 1
        assert 0 < waiting < 30  # its queue filled up; the rest were refused
    finally:
        slow.close()
    got = [conn.default_channel.basic_get("jobs") for _ in range(31)]
    assert sorted(m.payload["i"] for m in got if m is not None) == list(range(30))


@pytest.mark.parametrize("database", ["sqlite"])
def test_an_entry_that_refuses_wake_ups_and_cannot_be_removed_does_not_fail_a_publish(
        ordering: Ordering) -> None:
    """A dead consumer's socket that another publisher removed first, or an entry that is
    no socket at all (a directory here: it refuses the byte, and cannot be unlinked): the
    publisher leaves it and its publish goes on."""
    conn = ordering.connect("jobs", "plain", **NO_POLLING)
    conn.default_channel.queue_declare("jobs")
    directory = signal_directory(ordering)
    (directory / "stray").mkdir(parents=True)
    publish(conn, "jobs", [({"i": 0, "sent": time.time()}, {})])
    assert sockets(directory) == [directory / "stray"]
    message = conn.default_channel.basic_get("jobs")
    assert message is not None and message.payload["i"] == 0


@pytest.mark.parametrize("database", ["sqlite"])
def test_publishers_list_the_directory_again_only_when_its_time_moved(
        ordering: Ordering) -> None:
    """A publish keeps the directory's listing while its modification time stands still,
    but not one taken within ``SETTLED_NS`` of that time: a socket bound later in the same
    tick of a coarse file system clock (the time unchanged, as set here) is still found."""
    conn = ordering.connect("jobs", "plain", **NO_POLLING)
    conn.default_channel.queue_declare("jobs")
    directory = signal_directory(ordering)
    directory.mkdir(exist_ok=True)
    bound = {name: socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
             for name in ("first", "second", "third")}

    def bind(name: str, tick: int) -> None:
        bound[name].bind(str(directory / name))
        bound[name].setblocking(False)
        os.utime(directory, ns=(tick, tick))  # the clock has not ticked since

    def woken(name: str) -> int:
        count = 0
        with contextlib.suppress(BlockingIOError):
            while bound[name].recv(16):
                count += 1
        return count

    try:
        tick = time.time_ns() - SETTLED_NS // 2  # the directory changed just now
        bind("first", tick)
        publish(conn, "jobs", [({"i": 0}, {})])  # lists it: too soon to keep the listing
        bind("second", tick)
        wait_until(lambda: time.time_ns() - tick >= SETTLED_NS, 5, "the tick to settle",
                   interval=0.01)
        publish(conn, "jobs", [({"i": 1}, {})])  # lists it again, and keeps it
        assert (woken("first"), woken("second")) == (2, 1)
        bind("third", tick)  # no change a real clock would leave unseen by now
        publish(conn, "jobs", [({"i": 2}, {})])
        assert (woken("first"), woken("second"), woken("third")) == (1, 1, 0)
    finally:
        for sock in bound.values():
            sock.close()


@pytest.mark.slow
@pytest.mark.parametrize("database", SIGNALLED)
def test_no_signal_directory_falls_back_to_polling(signalled: Ordering, database: str) -> None:
    """SQLite: a file where the directory should be, so consumers cannot bind and
    publishers find no directory to list. MariaDB: the private root above it open to
    others, so no process uses it. Every message still arrives, by polling."""
    directory = signal_directory(signalled)
    if database == "mysql":
        directory.parent.chmod(0o777)
    else:
        directory.write_text("not a directory")
    polling = {"polling_interval": 0.3, "polling_interval_min": 0.3}
    delays = delays_to_another_process(signalled, **polling)
    assert len(delays) == MESSAGES and max(delays) < 5, delays
    assert sockets(directory) == []
    (idle,) = [proc for proc in signalled.processes.procs if proc.name == "idle"]
    assert "no same-host wake-ups" in idle.output()
