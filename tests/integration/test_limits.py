"""Concurrency limits: processes racing over a queue never run more rows of a key (or of
the queue) at once than its limit, timed by a ledger outside the broker; a killed holder's
slot frees with its lease; rows of a full key are passed over, not waited behind; a key no
claim could read is refused at publish, and nothing is written."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import signal
import time
from multiprocessing.synchronize import Event
from typing import Any

import pytest
from kombu import Connection, Consumer, Message, Queue
from sqlalchemy import text
from sqlalchemy.engine import Engine

from bench.ledger import most_at_once
from kombu_sqlinbox import keeper
from kombu_sqlinbox.errors import ConfigurationError
from kombu_sqlinbox.rows import ClaimedRow, Held, Settlement

from .conftest import Connect
from .support import (
    broker_of,
    consumer_processes,
    get,
    get_within,
    never_delivered,
    publish,
    quoted,
    table_of,
    wait_for,
)

QUEUE = "limited"
PROCESSES, KEYS, PER_KEY, ROUNDS = 5, 4, 6, 3
#: seconds a task "runs" (between its start and finish in the ledger): long enough for
#: two processes to run rows of one key at once on a loaded machine (a claim there can
#: take longer than a short task)
WORK = 0.1
#: the longest wait for a child or a round
WAIT = 60.0


def job(body: Any, message: Message) -> tuple[str]:
    """A task of ``WORK`` seconds, noting its key in the ledger."""
    time.sleep(WORK)  # the task's work
    return (body["key"],)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("limit", ["key", "queue"])
def test_racing_processes_never_exceed_a_limit(
        connect: Connect, broker_url: str, table_prefix: str, limit: str) -> None:
    """Per key: ``concurrency_limits={"*": 2}``, checked per key; per queue:
    ``max_in_work=3``, checked over every run. Rows without a key run beside them."""
    queue_options = ({"concurrency_limits": {"*": 2}} if limit == "key"
                     else {"max_in_work": 3})
    options = {"table_prefix": table_prefix, "polling_interval": 0.05,
               "queues": {QUEUE: queue_options}}
    runs: list[tuple[str, float, float]] = []
    with consumer_processes(PROCESSES, broker_url, options, QUEUE, 2, job, WAIT) as ledger:
        conn = connect(**{"queues": {QUEUE: queue_options}})
        for _ in range(ROUNDS):
            for _ in range(PER_KEY):
                for key in range(KEYS):
                    publish(conn, QUEUE, {"key": f"k{key}"}, limit_key=f"k{key}")
                publish(conn, QUEUE, {"key": "-"})  # no key
            for _ in range(PER_KEY * (KEYS + 1)):
                runs.append(ledger.get(timeout=WAIT))
    assert len(runs) == ROUNDS * PER_KEY * (KEYS + 1)
    if limit == "key":
        most = most_at_once(run for run in runs if run[0] != "-")
        assert max(most.values()) == 2, most  # reached, never passed
    else:
        most = most_at_once(("queue", start, end) for _, start, end in runs)
        # never passed; on a loaded machine the third at once may never come together
        assert 2 <= most["queue"] <= 3, most


def holder(broker_url: str, options: dict[str, Any], holding: Event) -> None:
    """Take one row and hold it until killed."""
    with Connection(broker_url, transport_options=options) as conn:
        conn.default_channel.queue_declare(QUEUE)
        message = get_within(conn, QUEUE, WAIT)
        assert message is not None
        holding.set()
        time.sleep(WAIT)  # killed meanwhile


@pytest.mark.timeout(120)
def test_a_killed_workers_slot_frees_with_its_lease(
        connect: Connect, broker_url: str, table_prefix: str) -> None:
    queue_options = {"concurrency_limits": {"*": 1}, "visibility_timeout": 3}
    options = {"table_prefix": table_prefix, "polling_interval": 0.05,
               "queues": {QUEUE: queue_options}}
    conn = connect(queues={QUEUE: queue_options})
    publish(conn, QUEUE, {"n": 1}, limit_key="tenant")
    context = multiprocessing.get_context("spawn")
    holding = context.Event()
    child = context.Process(target=holder, args=(broker_url, options, holding))
    child.start()
    try:
        assert holding.wait(WAIT), "the holder took no row"
        publish(conn, QUEUE, {"n": 2}, limit_key="tenant")
        os.kill(child.pid or 0, signal.SIGKILL)
        child.join(WAIT)
        # its lease ran at least two seconds past its last extension: the key stays full
        never_delivered(conn, [QUEUE], 1.5)
        first = get_within(conn, QUEUE, 15.0)
        never_delivered(conn, [QUEUE], 1.0)  # one of the key at a time still
        first.ack()
        second = get_within(conn, QUEUE, 15.0)
        assert {first.decode()["n"], second.decode()["n"]} == {1, 2}
        second.ack()
    finally:
        if child.is_alive():
            child.kill()


def test_rows_of_a_full_key_are_passed_over_not_waited_behind(connect: Connect) -> None:
    """Sixty rows of a key at its limit ahead of other rows: the others are delivered,
    one of the key, however far back they wait."""
    conn = connect(queues={QUEUE: {"concurrency_limits": {"*": 1, "vip-": 2}}})
    for _ in range(60):
        publish(conn, QUEUE, {"key": "busy"}, limit_key="busy")
    for key in ("vip-1", "vip-1", "vip-1", None):
        publish(conn, QUEUE, {"key": key}, **({"limit_key": key} if key else {}))
    got: list[Message] = []
    with Consumer(conn, [Queue(QUEUE, routing_key=QUEUE)], callbacks=[
            lambda body, message: got.append(message)], prefetch_count=10):
        wait_for(lambda: conn.drain_events(timeout=0.2) or len(got) >= 4, "four rows")
        never_delivered_while_draining(conn, got, 1.0)
        keys = sorted(str(message.decode()["key"]) for message in got)
        assert keys == ["None", "busy", "vip-1", "vip-1"], keys
        for message in got:
            message.ack()


@pytest.mark.parametrize("ahead", [2, 10, 70])
def test_a_claim_reads_on_past_any_run_of_a_full_keys_rows(connect: Connect,
                                                           ahead: int) -> None:
    """A key at its limit with ``ahead`` more rows before a free row: a claim of one row
    takes the free row, whether it lies in the first window read (four rows per row
    wanted), in a longer one, or beyond both (then windows passing over the full key)."""
    conn = connect(queues={QUEUE: {"concurrency_limits": {"*": 1}}})
    for _ in range(ahead + 1):
        publish(conn, QUEUE, {"key": "busy"}, limit_key="busy")
    publish(conn, QUEUE, {"key": "free"}, limit_key="free")
    broker = broker_of(conn)
    table = broker.table(QUEUE)
    held = broker.limits.claim(table, 1)
    assert [key_of(row) for row in held] == ["busy"]
    taken = broker.limits.claim(table, 1)
    assert [key_of(row) for row in taken] == ["free"]
    assert broker.limits.claim(table, 1) == []  # both keys at their limit


def test_an_acked_rows_slot_is_free_to_the_claim_that_writes_the_ack(
        connect: Connect, monkeypatch: pytest.MonkeyPatch) -> None:
    """A key at its limit of one: its row acked, the next claim (which writes that ack
    first, in its own statement or transaction) takes the key's next row. The settling
    thread gathers settlements for a minute here, not its 5 ms: on a loaded machine it
    could write the ack on its own, after the claim read the slot held."""
    monkeypatch.setattr(keeper, "SETTLE_GATHER", 60.0)
    conn = connect(queues={QUEUE: {"concurrency_limits": {"*": 1}}})
    for _ in range(3):
        publish(conn, QUEUE, {"key": "one"}, limit_key="one")
    broker = broker_of(conn)
    table = broker.table(QUEUE)
    (first,) = broker.limits.claim(table, 2)
    assert broker.limits.claim(table, 2) == []  # the key is at its limit
    broker.settle(Settlement.COMPLETE, Held(table, first.id, first.attempt))
    (second,) = broker.limits.claim(table, 2)
    assert second.id != first.id and key_of(second) == "one"


def key_of(row: ClaimedRow) -> str:
    return str(json.loads(str(row.headers))["headers"]["limit_key"])


def never_delivered_while_draining(conn: Connection, got: list[Message],
                                   seconds: float) -> None:
    """Drain for ``seconds``: nothing more may arrive."""
    held = len(got)
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        with contextlib.suppress(TimeoutError):
            conn.drain_events(timeout=0.2)
    assert len(got) == held, [message.decode() for message in got]


@pytest.mark.parametrize("key", [5, "", "k" * 256, "nul\x00", ["a"], "\ud800x"],
                         ids=["int", "empty", "too-long", "nul", "list", "lone-surrogate"])
@pytest.mark.parametrize("how", ["property", "header"])
def test_an_unusable_key_is_refused_at_publish_and_nothing_is_written(
        connect: Connect, engine: Engine, table_prefix: str, key: Any, how: str) -> None:
    conn = connect(queues={QUEUE: {"concurrency_limits": {"*": 1}}})
    conn.default_channel.queue_declare(QUEUE)
    sent = {"limit_key": key} if how == "property" else {"headers": {"limit_key": key}}
    with pytest.raises(ConfigurationError, match="limit_key must be a non-empty string"):
        conn.Producer().publish({"n": 1}, routing_key=QUEUE, retry=False, **sent)
    table = quoted(engine, table_of(QUEUE, table_prefix))
    with engine.connect() as db:
        assert db.execute(text(f"SELECT COUNT(*) FROM {table}")).scalar_one() == 0
    publish(conn, QUEUE, {"n": 2}, limit_key="ok")
    message = get_within(conn, QUEUE)
    assert message.decode() == {"n": 2} and message.headers["limit_key"] == "ok"
    message.ack()


def test_keys_compare_exactly(connect: Connect) -> None:
    """Keys differing in case, a trailing space or beyond ASCII are different keys."""
    conn = connect(queues={QUEUE: {"concurrency_limits": {"*": 1}}})
    keys = ["Tenant", "tenant", "tenant ", "ténant-🙂"]
    for key in keys:
        publish(conn, QUEUE, {"key": key}, limit_key=key)
    got = [get_within(conn, QUEUE) for _ in keys]
    assert sorted(message.decode()["key"] for message in got) == sorted(keys)
    assert get(conn, QUEUE) is None
    for message in got:
        message.ack()


def test_limits_for_every_queue_leave_transient_queues_alone(connect: Connect) -> None:
    """``max_in_work`` as every queue's default: remote control's and reply queues (rows
    of the transient messages' table, no envelope a claim reads a key from) claim as
    before, and a table queue is limited."""
    conn = connect(max_in_work=1)
    conn.default_channel.queue_declare("replies", durable=False, auto_delete=True)
    conn.Producer().publish({"n": 1}, routing_key="replies")
    assert broker_of(conn).table("replies").transient
    get_within(conn, "replies").ack()
    for n in range(2):
        publish(conn, QUEUE, {"n": n})
    first = get_within(conn, QUEUE)
    assert get(conn, QUEUE) is None  # the queue's one row in work
    first.ack()
    get_within(conn, QUEUE).ack()


def test_a_row_sent_with_a_number_for_a_key_is_claimed_under_its_text(
        connect: Connect, engine: Engine, table_prefix: str) -> None:
    """A row sent before keys were checked (an earlier version) whose envelope holds a
    number: its key is the number's text, and the claim goes on."""
    conn = connect(queues={QUEUE: {"concurrency_limits": {"*": 1}}})
    for n in range(2):
        publish(conn, QUEUE, {"n": n}, limit_key="7")
    table = quoted(engine, table_of(QUEUE, table_prefix))
    with engine.begin() as db:
        db.execute(text(f"UPDATE {table} SET headers = REPLACE(headers, "
                        "'\"limit_key\": \"7\"', '\"limit_key\": 7')"))
        assert all('"limit_key": 7' in row[0] for row in db.execute(
            text(f"SELECT headers FROM {table}")))
    first = get_within(conn, QUEUE)
    assert get(conn, QUEUE) is None  # the other row of key 7 waits
    first.ack()
    get_within(conn, QUEUE).ack()
