"""A queue's ``rate_limit`` holds across processes: several consumer processes race on one
backlog and together never take more than the limit allows; a connection cut during the
budget's update loses no message; queues without a limit never touch the budget."""

from __future__ import annotations

import contextlib
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from kombu import Connection, Consumer, Queue
from kombu.message import Message
from sqlalchemy import event, inspect, text
from sqlalchemy.engine import Engine

from kombu_sqlinbox.dialects import RateStatements
from kombu_sqlinbox.errors import ConfigurationError
from kombu_sqlinbox.options import parse_rate
from kombu_sqlinbox.rates import PRUNE_ROWS, Budget
from tests.tcp_proxy import Proxy

from .conftest import Connect
from .support import (
    broker_of,
    consumer_processes,
    count_rows,
    database_now,
    get_within,
    publish,
    quoted,
    session_ended_after,
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


def arrived(body: Any, message: Message) -> tuple[()]:
    """A consumer process's task: nothing to note but when it started."""
    return ()


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
    options = limited(table_prefix)
    with Connection(broker_url, transport_options=options) as conn:
        for number in range(BACKLOG):
            publish(conn, "rated", {"n": number})
    with consumer_processes(PROCESSES, broker_url, options, "rated", 10, arrived,
                            WAIT) as ledger:
        times = [start for start, _ in (ledger.get(timeout=WAIT) for _ in range(BACKLOG))]
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
    for _ in range(5):
        # the start of a window, by the database's clock: the takes below fall in it,
        # unless a loaded host stretches them past its 0.2 s (then in the next windows)
        wait_start = budget.width - rates.now() % budget.width
        time.sleep(wait_start + 0.01)
        taken = rates.take("rated", budget, 100)
        again = rates.take("rated", budget, 1)
        if int(database_now(rates) // budget.width) == taken.window:
            break
    assert taken.total == budget.tokens
    assert again.total == 0  # spent, told without a round trip
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


def test_a_session_lost_as_unused_tokens_go_back_fails_no_claim(
        connect: Connect, engine: Engine, table_prefix: str) -> None:
    """At ``10/s`` a window holds two tokens in one shard: a claim takes both, finds one
    row, and gives one back. The session giving it back ends for real before its commit:
    the claim still delivers its row at once (not after its lease), and the token is let
    go, never given back twice (the window's row still counts both). A give-back comes
    only while its window lasts, so messages go one at a time until one is cut."""
    conn = connect(queues={"rated": {"rate_limit": "10/s"}})
    broker = broker_of(conn)
    got: list[Message] = []
    with session_ended_after(broker.engine, engine,
                             lambda sql: "used = used -" in sql) as ended, \
            Consumer(conn, [Queue("rated")], prefetch_count=10,
                     callbacks=[lambda body, message: got.append(message)]):
        for number in range(20):
            publish(conn, "rated", {"n": number})
            deadline = time.monotonic() + 5
            while len(got) <= number and time.monotonic() < deadline:
                with contextlib.suppress(TimeoutError):
                    conn.drain_events(timeout=1)
            assert len(got) == number + 1, f"message {number} was not delivered in 5 s"
            got[-1].ack()
            if ended:
                break
    assert ended, "no give-back came in 20 messages"
    settled(conn)
    table = quoted(engine, RateStatements.tables(table_prefix)[0])
    with engine.begin() as db:
        last = db.execute(text(f"SELECT SUM(used) FROM {table} WHERE window_no = "
                               f"(SELECT MAX(window_no) FROM {table})")).scalar_one()
    assert last == 2


@pytest.mark.parametrize("tasks", [False, True], ids=["queue", "tasks"])
def test_an_idle_limited_queue_costs_at_most_one_budget_statement_a_poll(
        connect: Connect, table_prefix: str, tasks: bool) -> None:
    """A consumer of a limited queue gone idle polls (every 50 ms) for a second: each
    poll runs one statement on the queue's table (a read for a ready row) and at most one
    on the budget (none, in fact: it was ten or more, taking tokens for every free
    prefetch slot, claiming nothing, giving them back shard by shard). Rate-limited tasks
    (``task_rate_limits``) alike."""
    limits = {"task_rate_limits": {"proj.call": "50/s"}} if tasks else {"rate_limit": "50/s"}
    conn = connect(queues={"rated": limits})
    publish(conn, "rated", {"n": 0})
    broker = broker_of(conn)
    queue_table = table_of("rated", table_prefix)
    got: list[Message] = []
    with Consumer(conn, [Queue("rated")], prefetch_count=10,
                  callbacks=[lambda body, message: (got.append(message), message.ack())]):
        conn.drain_events(timeout=10)  # the one message: the queue is idle from here on
        settled(conn)
        with contextlib.suppress(TimeoutError):
            conn.drain_events(timeout=0.5)  # the round that finds it idle
        with statements_run(broker.engine) as seen:
            until = time.monotonic() + 1.0
            while time.monotonic() < until:
                with contextlib.suppress(TimeoutError):
                    conn.drain_events(timeout=until - time.monotonic())
    polls = [sql for sql in seen if queue_table in sql]
    budget = [sql for sql in seen if "rate_budget" in sql]
    assert len(got) == 1 and len(polls) >= 5, seen
    assert len(budget) <= len(polls), budget
    # each poll's BEGIN aside (SQLite), and a sweep of expired queues
    assert len(seen) <= 2 * len(polls) + 6, "\n".join(seen)


def seed_windows(engine: Engine, table_prefix: str, name: str, windows: range,
                 shards: int = 8) -> None:
    """Rows of the budget for ``name``: ``shards`` shards of each window in ``windows``."""
    table = quoted(engine, RateStatements.tables(table_prefix)[0])
    with engine.begin() as db:
        db.execute(text(f"INSERT INTO {table} (name, window_no, shard, used) "
                        "VALUES (:name, :window, :shard, 1)"),
                   [{"name": name, "window": window, "shard": shard}
                    for window in windows for shard in range(shards)])


def windows_of(engine: Engine, table_prefix: str, name: str) -> int:
    table = quoted(engine, RateStatements.tables(table_prefix)[0])
    with engine.begin() as db:
        return int(db.execute(text(f"SELECT COUNT(*) FROM {table} WHERE name = :name"),
                              {"name": name}).scalar_one())


@pytest.mark.timeout(120)
def test_pruning_is_bounded_and_a_lost_session_during_it_fails_no_claim(
        connect: Connect, engine: Engine, table_prefix: str) -> None:
    """1,600 rows of old windows wait for the claims of a ``50/s`` queue draining a
    backlog: a claim opening every 16th window prunes, at most PRUNE_ROWS rows a
    statement. The first prune's session ends for real after its DELETE (rolled back):
    that claim still delivers, and the prune run again deletes rows. The rows left are
    the seeded ones, plus at most those the run's windows made, less the committed
    deletes. Another queue's windows stay."""
    conn = connect(queues={"rated": {"rate_limit": "50/s"}})
    broker = broker_of(conn)
    rates = broker.rates
    budget = Budget.of(parse_rate("rate_limit", "50/s"))  # type: ignore[arg-type]
    rates.ensure()
    seed_windows(engine, table_prefix, "rated", range(1, 201))
    seed_windows(engine, table_prefix, "other", range(1, 11))
    for number in range(300):
        publish(conn, "rated", {"n": number})
    deleted: list[int] = []

    def pruning(statement: str) -> bool:
        return statement.startswith("DELETE") and "rate_budget" in statement

    def count(conn: object, cursor: Any, statement: str, *args: object) -> None:
        if pruning(statement):
            deleted.append(cursor.rowcount)

    got: list[int] = []
    first_window = int(rates.now() // budget.width)
    event.listen(broker.engine, "after_cursor_execute", count)
    try:
        with session_ended_after(broker.engine, engine, pruning) as ended, \
                Consumer(conn, [Queue("rated")], prefetch_count=10, callbacks=[
                    lambda body, message: (got.append(body["n"]), message.ack())]):
            deadline = time.monotonic() + 60
            # the first DELETE is the lost one: wait for one committed after it
            while (len(got) < 300 or len(deleted) < 2) and time.monotonic() < deadline:
                with contextlib.suppress(TimeoutError):
                    conn.drain_events(timeout=1)
    finally:
        event.remove(broker.engine, "after_cursor_execute", count)
    # the take's windows follow this clock, which never goes back
    made = (int(rates.now() // budget.width) - first_window + 1) * budget.shards
    assert ended and sorted(got) == list(range(300))
    committed = deleted[1:]  # after the lost one
    assert committed and max(deleted) <= PRUNE_ROWS, deleted
    assert sum(committed) >= PRUNE_ROWS, deleted  # the 1,600 old rows are all due
    assert windows_of(engine, table_prefix, "other") == 80
    left = windows_of(engine, table_prefix, "rated")
    assert 1600 - sum(committed) <= left <= 1600 - sum(committed) + made, (left, deleted)


@pytest.mark.timeout(120)
def test_pruning_twice_and_at_once_deletes_each_old_window_once(
        connect: Connect, engine: Engine, table_prefix: str) -> None:
    """Four threads prune the same queue twice each, at once: none fails or waits on
    another for long, the old windows go (each deleted once), the current one stays."""
    conn = connect(queues={"rated": {"rate_limit": "50/s"}})
    rates = broker_of(conn).rates
    rates.ensure()
    seed_windows(engine, table_prefix, "rated", range(1, 201))
    seed_windows(engine, table_prefix, "rated", range(500, 501))
    with ThreadPoolExecutor(4) as pool:
        counts = list(pool.map(lambda _: rates.prune("rated", 500), range(8)))
    assert sum(counts) == 1600, counts
    assert windows_of(engine, table_prefix, "rated") == 8


def test_the_window_clock_never_goes_back_when_the_host_clock_steps_back(
        connect: Connect, monkeypatch: pytest.MonkeyPatch) -> None:
    """The host's clock steps back a minute (NTP, a VM resumed) after a claim spent its
    window: the windows counted from then on are that one or later, never the 300 before
    it, which would give out their tokens a second time."""
    conn = connect(queues={"rated": {"rate_limit": "50/s"}})
    rates = broker_of(conn).rates
    budget = Budget.of(parse_rate("rate_limit", "50/s"))  # type: ignore[arg-type]
    rates.ensure()
    first = rates.take("rated", budget, budget.tokens)
    before = rates.now()
    stepped = time.time
    monkeypatch.setattr(time, "time", lambda: stepped() - 60.0)
    rates._spent.clear()  # ask the database, not this process's note of the spent window
    second = rates.take("rated", budget, budget.tokens)
    assert rates.now() >= before
    assert second.window >= first.window, (first.window, second.window)


@pytest.mark.parametrize("written", [50, "50", 50.0, "50/"])
def test_celerys_own_rate_forms_are_per_second(connect: Connect, written: object) -> None:
    """``rate_limit=50`` and ``"50"`` mean 50 a second, as Celery reads a task's
    ``rate_limit``: the queue's windows hold 10 tokens."""
    conn = connect(queues={"rated": {"rate_limit": written}})
    publish(conn, "rated", {"n": 1})
    broker = broker_of(conn)
    rate = broker.table("rated").options.rate_limit
    assert rate is not None and rate.per_second == 50
    get_within(conn, "rated").ack()
    assert Budget.of(rate).tokens == 10


@pytest.mark.parametrize("written", ["50/x", "0/s", "0", 0, "-1", "fast", True, ""])
def test_a_bad_rate_limit_is_refused_naming_its_queue(
        connect: Connect, written: object) -> None:
    with pytest.raises(ConfigurationError, match=r"queue 'rated'"):
        publish(connect(queues={"rated": {"rate_limit": written}}), "rated", {"n": 1})
