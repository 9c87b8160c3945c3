"""A process that acks and then ends normally, closing nothing: its acks are written
before it is gone, so none of its messages is delivered again."""

from __future__ import annotations

import json
import socket
import sys
import time
from pathlib import Path

from kombu import Connection

from tests.acceptance.conftest import Acceptance
from tests.integration.support import rows_locked, table_of
from tests.processes import START_LIMIT, wait_until

QUEUE = "acked"
MESSAGES = 20
#: how long the test watches the process stay alive while its acks cannot be written
BLOCKED_FOR = 2.0


def marker(base: Path, what: str) -> Path:
    return base.with_name(f"{base.name}.{what}")


def test_acks_made_just_before_a_normal_exit_are_written(acceptance: Acceptance) -> None:
    with Connection(acceptance.broker_url, transport_options=acceptance.options) as conn:
        producer = conn.Producer(serializer="json")
        acceptance.declare(QUEUE)
        for n in range(MESSAGES):
            producer.publish({"n": n}, routing_key=QUEUE)
    base = acceptance.tmp / "acker"
    acker = acceptance.spawn("acker", [
        sys.executable, "-m", "tests.acceptance.apps.acker", acceptance.broker_url,
        json.dumps(acceptance.options), QUEUE, str(MESSAGES), str(base)])
    wait_until(marker(base, "received").exists, START_LIMIT, "the messages to be received",
               alive=[acker])
    # the acks cannot be written while the rows are locked: the process must wait for
    # them at exit, not end with them unwritten
    with rows_locked(acceptance.engine, table_of(QUEUE, acceptance.table_prefix)):
        marker(base, "ack").touch()
        wait_until(marker(base, "acked").exists, 30, "the messages to be acked", alive=[acker])
        until = time.monotonic() + BLOCKED_FOR
        while time.monotonic() < until and acker.popen.poll() is None:
            time.sleep(0.05)
    assert acker.wait(30) == 0, acker.tail()
    assert acceptance.rows(QUEUE) == 0, acker.tail()


#: Celery's blocking loop drains for up to two seconds at a time, looks for a shutdown
#: between drains, and drains once more after it: waited out, the worker's part of a warm
#: shutdown of an idle worker (from the request to the consumer stopped) takes two seconds
#: at least
PROMPT_STOP = 1.5
#: the whole stop, the interpreter's exit included, which a loaded machine stretches
STOPPED_WITHIN = 10.0


def test_an_idle_worker_on_the_blocking_loop_stops_without_waiting_out_its_drain(
        acceptance: Acceptance) -> None:
    worker = acceptance.worker("solo")
    asked = time.monotonic()
    assert worker.stop() == 0, worker.tail()
    took = time.monotonic() - asked
    assert took < STOPPED_WITHIN, f"the warm shutdown took {took:.2f}s"
    record = acceptance.runs.path / f"shutdown.{worker.name}@{socket.gethostname()}"
    assert record.exists(), worker.tail()
    seconds = json.loads(record.read_text())["seconds"]
    assert seconds < PROMPT_STOP, f"the worker took {seconds:.2f}s to stop its consumer"
