"""Remote control answers while a worker takes in a backlog.

An operator revokes and inspects exactly when workers are busy: a worker whose prefetch
is filling, or full, with long tasks still answers ``ping`` (and every control command,
which come the same way) within a small bound, as it does when idle.
"""

from __future__ import annotations

import socket
import time

from tests.acceptance.conftest import Acceptance
from tests.processes import wait_until

HOST = socket.gethostname()
#: a worker answers within this (seconds): an idle one takes 20-200 ms here, depending on
#: the load of a shared two-core machine; a loop blocked behind the pool answers only
#: once a task ends (TASK_SECONDS), or not within the ping's timeout
REPLY_LIMIT = 2.0
#: the backlog's tasks: far longer than REPLY_LIMIT
TASK_SECONDS = 10.0
BACKLOG = 8
PINGS = 20


def test_ping_is_answered_while_the_prefetch_fills(acceptance: Acceptance) -> None:
    worker = acceptance.worker("prefork", 2, name="w1")
    node = f"w1@{HOST}"
    control = acceptance.app.control

    def ping() -> float:
        started = time.monotonic()
        replies = control.ping(destination=[node], timeout=5.0)
        took = time.monotonic() - started
        assert replies == [{node: {"ok": "pong"}}], replies
        return took

    ping()  # the test's reply queue exists from here on
    idle = [ping() for _ in range(3)]
    acceptance.send("acc.run", [f"long{n}" for n in range(BACKLOG)],
                    kwargs={"seconds": TASK_SECONDS})
    wait_until(lambda: acceptance.runs.starts(), 30, "the first task to start", alive=[worker])
    busy = [ping() for _ in range(PINGS)]
    print(f"ping latency idle {[round(t, 3) for t in idle]} busy {[round(t, 3) for t in busy]}")
    assert max(busy) < REPLY_LIMIT, busy

    # what an operator does then: revoke, and see it taken (inspect returns with the
    # answer of the one worker it names)
    control.revoke("not-yet-sent")
    revoked = control.inspect(destination=[node], timeout=5.0).revoked()
    assert revoked == {node: ["not-yet-sent"]}, revoked
