"""A queue's ``rate_limit`` holds across processes: several consumer processes race on one
backlog and together never take more than the limit allows; a connection cut during the
budget's update loses no message; queues without a limit never touch the budget."""

from __future__ import annotations

import contextlib
import multiprocessing
import time
from multiprocessing.synchronize import Event

import pytest
from kombu import Connection, Consumer, Queue
from kombu.message import Message
from sqlalchemy import event, inspect, text
from sqlalchemy.engine import Engine

from kombu_sqlinbox.dialects import RateStatements
from kombu_sqlinbox.options import parse_rate
from kombu_sqlinbox.rates import Budget
from tests.tcp_proxy import Proxy

from .conftest import Connect
from .support import (
    broker_of,
    count_rows,
    get_within,
    publish,
    quoted,
    settled,
    statements_run,
    table_of,
)

PROCESSES = 4
RATE = "40/s"
BACKLOG = 240
#: the longest wait for the consumers' reports
WAIT = 60.0


def limited(prefix: str) -> dict[str, object]:
    return {"table_prefix": prefix, "polling_interval": 0.05,
            "queues": {"rated": {"rate_limit": RATE}}}


def consumer(broker_url: str, prefix: str, stop: Event,
             started: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    """Consume queue ``rated`` (10 prefetch slots), reporting when each message came."""
    with Connection(broker_url, transport_options=limited(prefix)) as conn:
        def arrived(body: object, message: Message) -> None:
            started.put(time.time())
            message.ack()

        with Consumer(conn, [Queue("rated")], callbacks=[arrived], prefetch_count=10):
            while not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    conn.drain_events(timeout=0.2)


def most_in_any(times: list[float], span: float) -> int:
    """The most deliveries in any ``span`` seconds."""
    times = sorted(times)
    most, first = 0, 0
    for last, at in enumerate(times):
        while at - times[first] >= span:
            first += 1
        most = max(most, last - first + 1)
    return most


@pytest.mark.timeout(180)
def test_racing_processes_together_stay_within_the_rate_limit(
        broker_url: str, engine: Engine, table_prefix: str) -> None:
    """Four processes drain a backlog of 240 at 40/s. A claim is bounded by its window's
    budget and its rows go out just after: a span holds its windows' claims, and at most
    two windows' more (one starting inside it, and the last one's rows delivered late
    behind a slow start). The backlog takes about 6 s, not the quarter of it four
    unlimited processes would."""
    with Connection(broker_url, transport_options=limited(table_prefix)) as conn:
        for number in range(BACKLOG):
            publish(conn, "rated", {"n": number})
    context = multiprocessing.get_context("spawn")
    stop, started = context.Event(), context.Queue()
    children = [context.Process(target=consumer, args=(broker_url, table_prefix, stop, started))
                for _ in range(PROCESSES)]
    for child in children:
        child.start()
    try:
        times = [started.get(timeout=WAIT) for _ in range(BACKLOG)]
    finally:
        stop.set()
        for child in children:
            child.join(WAIT)
            if child.is_alive():
                child.kill()
    budget = Budget.of(parse_rate("rate", RATE))  # type: ignore[arg-type]
    for span in (1.0, 2.0, 4.0):
        assert most_in_any(times, span) <= 40 * span + 2 * budget.tokens, (span, sorted(times))
    elapsed = max(times) - min(times)
    assert (BACKLOG - 40) / 40 <= elapsed <= BACKLOG / 40 * 1.5, elapsed
    assert count_rows(engine, table_of("rated", table_prefix)) == 0


def test_a_window_gives_out_its_budget_and_no_more(
        connect: Connect, engine: Engine, table_prefix: str) -> None:
    """Budget rows: one window's shards hold the window's tokens; the claims of one
    window take them all and then nothing until the next window; unused tokens return."""
    conn = connect(queues={"rated": {"rate_limit": "50/s"}})
    for number in range(30):
        publish(conn, "rated", {"n": number})
    broker = broker_of(conn)
    rates = broker.rates
    budget = Budget.of(parse_rate("rate", "50/s"))  # type: ignore[arg-type]
    assert (budget.tokens, budget.shards) == (10, 5)
    rates.ensure()
    # the start of a window, by the database's clock: the claims below fall in it
    wait_start = budget.width - rates.now() % budget.width
    time.sleep(wait_start + 0.01)
    taken = rates.take("rated", budget, 100)
    assert taken.total == budget.tokens
    assert rates.take("rated", budget, 1).total == 0  # spent, told without a round trip
    table = quoted(engine, RateStatements.tables(table_prefix)[0])
    with engine.begin() as db:
        used = db.execute(text(f"SELECT shard, used FROM {table} WHERE window_no = :w"),
                          {"w": taken.window}).all()
    assert sorted(used) == [(shard, budget.share(shard)) for shard in range(budget.shards)]
    rates.give_back("rated", budget, taken, 4)
    with engine.begin() as db:
        left = db.execute(text(f"SELECT SUM(used) FROM {table} WHERE window_no = :w"),
                          {"w": taken.window}).scalar_one()
    assert left in (6, budget.tokens)  # the window may have ended before the give-back
    assert rates.idle_wait(0.0, 1.0) <= budget.width


def test_a_queue_without_a_rate_limit_never_touches_the_budget(
        connect: Connect, engine: Engine, table_prefix: str) -> None:
    conn = connect(queues={"rated": {"rate_limit": "50/s"}})
    publish(conn, "free", {"n": 1})
    with statements_run(broker_of(conn).engine) as seen:
        get_within(conn, "free").ack()
        settled(conn)
    assert seen and not [sql for sql in seen if "rate_budget" in sql]
    assert not inspect(engine).has_table(f"{table_prefix}rate_budget")


@pytest.mark.databases("postgresql", "mysql")  # a file has no connection to cut
def test_a_connection_cut_during_the_budget_update_loses_no_message(
        db_url: str, engine: Engine, table_prefix: str, proxy: Proxy) -> None:
    """The budget's UPDATE reaches the server and its connection breaks: the transaction
    did not happen, runs again on a fresh connection, and every message is delivered."""
    options = {"table_prefix": table_prefix, "queues": {"rated": {"rate_limit": "50/s"}}}
    with Connection("sqlinbox+" + proxy.url(db_url), transport_options=options) as conn:
        for number in range(3):
            publish(conn, "rated", {"n": number})
        rates = broker_of(conn).rates
        rates.ensure()
        rates.now()  # the table and the clock read: the next statement naming it is a take
        proxy.cut_after_commit(marker=b"used = used +")
        got = [get_within(conn, "rated") for _ in range(3)]
        assert proxy.commits_cut == 1
        assert sorted(message.decode()["n"] for message in got) == [0, 1, 2]
        for message in got:
            message.ack()
        settled(conn)
    assert count_rows(engine, table_of("rated", table_prefix)) == 0


def test_a_spent_window_is_waited_out_without_a_statement_and_ends_on_time(
        connect: Connect, table_prefix: str) -> None:
    """At ``1/s`` (one token a window of 1 s), the first message spends the window: the
    consumer then runs no claim and no budget statement until the window ends,
    and takes the second message as the next window begins, long before its
    ``polling_interval`` of 5 s would have it look again."""
    conn = connect(polling_interval=5.0, queues={"rated": {"rate_limit": "1/s"}})
    for number in range(2):
        publish(conn, "rated", {"n": number})
    broker = broker_of(conn)
    arrived: list[float] = []
    ran: list[tuple[float, str]] = []

    def record(conn: object, cursor: object, statement: str, *args: object) -> None:
        ran.append((time.monotonic(), statement))

    with Consumer(conn, [Queue("rated")], prefetch_count=10,
                  callbacks=[lambda body, message: (arrived.append(time.monotonic()),
                                                    message.ack())]):
        deadline = time.monotonic() + 10
        while not arrived and time.monotonic() < deadline:
            conn.drain_events(timeout=1)
        spent_until = broker.rates._spent["rated"]
        event.listen(broker.engine, "before_cursor_execute", record)
        try:
            while len(arrived) < 2 and time.monotonic() < deadline:
                with contextlib.suppress(TimeoutError):
                    conn.drain_events(timeout=1)
        finally:
            event.remove(broker.engine, "before_cursor_execute", record)
    assert len(arrived) == 2
    watched = (table_of("rated", table_prefix), "rate_budget")  # the claim's, the budget's
    early = [sql for at, sql in ran if at < spent_until - 0.005
             and any(name in sql for name in watched) and not sql.startswith("DELETE")]
    assert not early, early  # nothing while the window lasted (the ack aside)
    assert arrived[1] - spent_until <= 0.5
