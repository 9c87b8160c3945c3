"""Several threads of one process consuming through its one broker, as Flower does: an
event receiver waits in one thread while ``inspect`` calls in others consume reply
queues of their own.

The scenario runs in a child process: a broker that is unsafe across threads can
corrupt the driver's memory and abort the whole process, not only fail an assertion.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import threading
import time
from typing import Any

import pytest
from kombu import Connection, Consumer, Producer, Queue
from sqlalchemy.engine import make_url

#: new queues the listening thread consumes, one after another
QUEUES = 100
LIMIT = 60.0


def busy_and_new_queues(url: str, prefix: str, result: Any) -> None:
    """One thread waits on a queue that a second, with a broker of its own, keeps busy (the
    wake-ups arrive on the first broker's LISTEN connection); a third consumes
    :data:`QUEUES` new queues, each asking that connection to LISTEN. Reports how many it
    consumed and whether it finished."""
    import kombu_sqlinbox  # noqa: F401  (registers the sqlinbox alias)

    options = {"table_prefix": prefix, "polling_interval": 0.05}
    busy = Queue("busy", durable=False, auto_delete=True)
    stop = threading.Event()
    consumed = [0]

    def wait() -> None:
        with Connection(url, transport_options=options) as conn, Consumer(
                conn, [busy], callbacks=[lambda body, message: None], no_ack=True):
            while not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    conn.drain_events(timeout=0.05)

    def publish() -> None:
        # a broker of its own, as another process would have: its NOTIFYs reach the
        # others through the LISTEN connection
        with Connection(url, transport_options={**options, "polling_interval": 0.051}) as conn:
            busy(conn.default_channel).declare()
            producer = Producer(conn.default_channel)
            while not stop.is_set():
                producer.publish({"n": 1}, routing_key="busy")
                time.sleep(0.002)

    def listen() -> None:
        with Connection(url, transport_options=options) as conn:
            for n in range(QUEUES):
                with Consumer(conn, [Queue(f"new{n}", durable=False, auto_delete=True)],
                              no_ack=True):
                    consumed[0] = n + 1

    for run in (wait, publish):
        threading.Thread(target=run, daemon=True).start()
    time.sleep(0.5)
    listener = threading.Thread(target=listen, daemon=True)
    listener.start()
    listener.join(LIMIT)
    result.put((consumed[0], not listener.is_alive()))
    stop.set()


@pytest.mark.databases("postgresql")  # the LISTEN connection is PostgreSQL's
@pytest.mark.parametrize("driver", ["psycopg2", "psycopg"])
def test_threads_sharing_the_listen_connection(db_url: str, table_prefix: str,
                                               driver: str) -> None:
    url = "sqlinbox+" + make_url(db_url).set(drivername=f"postgresql+{driver}").render_as_string(
        hide_password=False)
    spawn = multiprocessing.get_context("spawn")
    result = spawn.Queue()
    child = spawn.Process(target=busy_and_new_queues, args=(url, table_prefix, result))
    child.start()
    child.join(LIMIT + 30)
    if child.is_alive():
        child.kill()
        child.join(10)
    assert child.exitcode == 0, f"the process died (exit code {child.exitcode})"
    consumed, finished = result.get(timeout=5)
    assert finished, f"the listening thread hung after {consumed} of {QUEUES} queues"
    assert consumed == QUEUES
