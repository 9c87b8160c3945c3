"""A rate budget's tokens are taken only while the database's clock is inside the window
they belong to. A take that waited on a shard's row past the window's end, or an open that
reached the database after it (the window's rows maybe pruned by then), takes none of that
window's tokens: a claim would spend them in the next window, on top of that window's own
(a queue over its limit). Such a take reads the database's clock again and takes from the
window that is current."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from sqlalchemy import event, text
from sqlalchemy.engine import Engine

from kombu_sqlinbox import rates as rate_limits
from kombu_sqlinbox.dialects import RateStatements
from kombu_sqlinbox.options import parse_rate
from kombu_sqlinbox.rates import Budget, RateLimits, Taken

from .conftest import Connect
from .support import broker_of, database_now, quoted, wait_for

NAME = "rated"
#: one token a second: windows of a second, one shard
BUDGET = Budget.of(parse_rate("rate_limit", "1/s"))  # type: ignore[arg-type]


def window_start(rates: RateLimits) -> int:
    """The number of a window just begun by the database's clock (the statements below
    fall in it, unless held back on purpose)."""
    rates.ensure()
    begun = int(rates.now() // BUDGET.width) + 1
    wait_for(lambda: int(rates.now() // BUDGET.width) >= begun or None,
             "the next window", timeout=2 * BUDGET.width)
    return begun


def window_ended(rates: RateLimits, window: int) -> None:
    """Wait (bounded) until the database's clock is past ``window``'s end."""
    end = (window + 1) * BUDGET.width
    wait_for(lambda: database_now(rates) > end + 0.05 or None, "the window's end",
             timeout=3 * BUDGET.width)


def used_in(engine: Engine, table_prefix: str, window: int) -> list[tuple[Any, ...]]:
    table = quoted(engine, RateStatements.tables(table_prefix)[0])
    with engine.begin() as db:
        return [tuple(row) for row in db.execute(text(
            f"SELECT shard, used FROM {table} WHERE name = :name AND window_no = :window"),
            {"name": NAME, "window": window})]


#: how the rival transaction holds the shard: ``(SQL, its end)``
HOLDS = {
    "take-commit": ("UPDATE {table} SET used = used WHERE name = :name "
                    "AND window_no = :window", "commit"),
    "take-rollback": ("UPDATE {table} SET used = used WHERE name = :name "
                      "AND window_no = :window", "rollback"),
    "open-rollback": ("INSERT INTO {table} (name, window_no, shard, used) "
                      "VALUES (:name, :window, 0, 0)", "rollback"),
}


@pytest.mark.parametrize("hold", HOLDS)
def test_a_take_that_waited_on_its_shard_past_the_windows_end_takes_none_of_it(
        connect: Connect, engine: Engine, table_prefix: str, hold: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A rival transaction holds the window's shard row (its write lock, on SQLite) until
    the database's clock is past the window's end, then commits (another take) or rolls
    back (a failed take, or a failed opening of the shard): the take waiting on it counts
    none of that window's tokens, and takes from the current window instead. When its
    waiting open made the window's row, the prune that row is due (this window's number
    made the one pruning every so many windows) is still due after the retry."""
    conn = connect(queues={NAME: {"rate_limit": "1/s"}})
    broker = broker_of(conn)
    rates = broker.rates
    window = window_start(rates)
    monkeypatch.setattr(rate_limits, "PRUNE_EVERY", window)  # this window's, not the next
    table = quoted(engine, RateStatements.tables(table_prefix)[0])
    statement, ending = HOLDS[hold]
    if hold != "open-rollback":
        with engine.begin() as db:
            db.execute(text(HOLDS["open-rollback"][0].format(table=table)),
                       {"name": NAME, "window": window})
    sqlite = engine.dialect.name == "sqlite"
    sent = threading.Event()

    def waiting(conn: object, cursor: object, statement: str, *args: object) -> None:
        if (statement == "BEGIN IMMEDIATE" if sqlite
                else "rate_budget" in statement and "used + " in statement):
            sent.set()

    taken: list[Taken] = []
    take = threading.Thread(target=lambda: taken.append(rates.take(NAME, BUDGET, 1)))
    event.listen(broker.engine, "before_cursor_execute", waiting)
    try:
        with engine.connect() as holder, holder.begin() as held:
            holder.execute(text(statement.format(table=table)),
                           {"name": NAME, "window": window})
            take.start()
            assert sent.wait(10), "the take never ran"
            window_ended(rates, window)
            assert take.is_alive(), "the take did not wait on the shard"
            getattr(held, ending)()
        take.join(30)
    finally:
        event.remove(broker.engine, "before_cursor_execute", waiting)
    assert not take.is_alive() and taken
    if hold != "open-rollback":  # (an opening may have made the row; its tokens unused)
        assert used_in(engine, table_prefix, window) == [(0, 0)]
    assert taken[0].window > window and taken[0].total == 1, taken[0]
    assert used_in(engine, table_prefix, taken[0].window) == [(0, 1)]
    made = hold == "open-rollback" and bool(used_in(engine, table_prefix, window))
    assert taken[0].prune == made, (taken[0], made)


def test_an_open_reaching_the_database_after_its_window_ended_makes_none_of_it(
        connect: Connect, engine: Engine, table_prefix: str) -> None:
    """The statement making a window's first row is held back until the database's clock
    is past the window's end (a slow network, a paused process; the window's rows may
    have been pruned meanwhile): it makes no row of that window, and the take takes from
    the current window instead."""
    conn = connect(queues={NAME: {"rate_limit": "1/s"}})
    broker = broker_of(conn)
    rates = broker.rates
    window = window_start(rates)
    late: list[str] = []

    def hold_back(conn: object, cursor: object, statement: str, *args: object) -> None:
        if not late and statement.startswith("INSERT") and "rate_budget" in statement:
            late.append(statement)
            window_ended(rates, window)

    event.listen(broker.engine, "before_cursor_execute", hold_back)
    try:
        taken = rates.take(NAME, BUDGET, 1)
    finally:
        event.remove(broker.engine, "before_cursor_execute", hold_back)
    assert late, "no window was opened"
    assert used_in(engine, table_prefix, window) == []
    assert taken.window > window and taken.total == 1, taken
    assert used_in(engine, table_prefix, taken.window) == [(0, 1)]


#: takes from the database's window the worker with a slow first clock reading must make
TAKES = 5


def test_a_worker_whose_first_clock_reading_was_slow_takes_from_the_databases_window(
        connect: Connect) -> None:
    """The first reading of the database's clock takes 1 s (a cold connection on a loaded
    host): the worker's estimate runs 0.5 s ahead (the reading's midpoint), and every
    window it names is two or three ahead of the database's. Its takes still come
    from the window the database is in, and its estimate is set right."""
    conn = connect(queues={NAME: {"rate_limit": "50/s"}})
    broker = broker_of(conn)
    rates = broker.rates
    budget = Budget.of(parse_rate("rate_limit", "50/s"))  # type: ignore[arg-type]
    rates.ensure()
    reading = rates.sql.now.text
    slowed: list[str] = []

    def slow(conn: object, cursor: object, statement: str, *args: object) -> None:
        if not slowed and statement == reading:
            slowed.append(statement)
            time.sleep(1.0)  # the slow round trip itself, not a wait for anything

    event.listen(broker.engine, "before_cursor_execute", slow)
    try:
        rates.now()
    finally:
        event.remove(broker.engine, "before_cursor_execute", slow)
    assert slowed
    assert rates.now() - database_now(rates) > budget.width  # ahead by over a window
    took = 0
    for _ in range(TAKES * 4):
        rates._spent.clear()  # ask the database each time
        before = int(database_now(rates) // budget.width)
        taken = rates.take(NAME, budget, 1)
        after = int(database_now(rates) // budget.width)
        assert before <= taken.window <= after, (before, taken, after)
        if not taken.total:
            # nothing is taken from a window the database's clock left during the take
            # (a round trip longer than what was left of its 0.2 s on a loaded host)
            assert taken.window < after, (before, taken, after)
            continue
        assert taken.total == 1, taken
        took += 1
        if took == TAKES:
            break
    assert took == TAKES
    assert abs(rates.now() - database_now(rates)) < budget.width
