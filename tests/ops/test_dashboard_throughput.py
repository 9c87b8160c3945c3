"""Throughput counts (``kombu_sqlinbox.throughput``) on the real databases: a real worker's
settled tasks add up on the queues page's chart, and so do rows completed by their task's
own transaction; a real consumer with counting off writes nothing; a flush that fails
(its table dropped, or missing where the transport does not create tables) keeps its
counts, warns once, and the consumer's acks go through; old minutes are pruned."""

from __future__ import annotations

import logging
import re
import time
from typing import Any

import pytest
from celery import Celery
from kombu import Connection
from sqlalchemy import Engine, inspect

from celery_ext.dashboard import Dashboard
from kombu_sqlinbox.broker import Broker
from kombu_sqlinbox.brokers import close_all
from kombu_sqlinbox.codec import ROW_KEY
from kombu_sqlinbox.operations import Operations
from kombu_sqlinbox.options import parse_options
from kombu_sqlinbox.throughput import HOUR, KEPT_MINUTES, PRUNE_INTERVAL, last_hour, second_now
from tests.ops.apps import transport_options
from tests.ops.dashboard_support import TOKEN, figures, signed_in
from tests.processes import Processes, wait_until

#: how long a real worker may take to run the tasks, and to stop
RUN_LIMIT = 60.0
#: tasks sent in each test
TASKS = 12
#: how long a consumer waits for a message it put
GET_LIMIT = 10.0


def chart(html: str, queue: str) -> tuple[int, list[int]]:
    """The total a queue's chart says, and its bars' counts."""
    row = re.search(rf'<tr data-chart="{re.escape(queue)}">(.*?)</tr>', html, re.S)
    assert row, html
    total = re.search(r'<td class="total">(\d+)</td>', row.group(1))
    assert total and "<svg" in row.group(1)
    return int(total.group(1)), [int(n) for n in re.findall(r'data-settled="(\d+)"',
                                                              row.group(1))]


def consume(broker_url: str, options: dict[str, Any], queue: str, count: int) -> None:
    """Put ``count`` messages on ``queue`` and consume them with a kombu consumer that acks
    each, then close every broker of this process (as a worker does when it stops)."""
    with Connection(broker_url, transport_options=options) as conn, \
            conn.SimpleQueue(queue) as simple:
        for n in range(count):
            simple.put({"n": n})
        for _ in range(count):
            simple.get(timeout=GET_LIMIT).ack()
    close_all()


def table(prefix: str) -> str:
    return f"{prefix}throughput"


def database_minute(broker: Broker, prefix: str) -> int:
    """The database's current minute, by the clock the rate limits read."""
    now = broker.dialect.rate_statements(prefix).now
    return int(float(broker.run(lambda conn: conn.execute(now).scalar_one()))) // 60


def test_a_real_worker_s_settled_tasks_add_up_on_the_queues_chart(
        ops: Operations, app: Celery, processes: Processes, ops_env: dict[str, str]) -> None:
    worker = processes.worker("tests.ops.apps", env=ops_env, args=["-Q", "jobs"])
    for n in range(TASKS):
        app.send_task("ops.add", (n, n), queue="jobs")
    client = signed_in(Dashboard(ops, token=TOKEN))

    def settled() -> bool:
        shown = figures(client.get("/").text, "jobs")
        return shown["ready"] == 0 and shown["in_work"] == 0
    wait_until(settled, RUN_LIMIT, "the tasks to be settled", alive=[worker])
    worker.stop(RUN_LIMIT)  # a clean stop writes what it counted
    page = client.get("/").text
    total, bars = chart(page, "jobs")
    assert total == TASKS and sum(bars) == TASKS
    assert chart(page, "fifo") == (0, [])  # a queue without work: a flat chart


def test_a_consumer_counts_what_it_acks_and_with_counting_off_writes_nothing(
        broker_url: str, table_prefix: str, engine: Engine) -> None:
    options = transport_options(table_prefix)
    consume(broker_url, {**options, "count_throughput": False}, "plain", TASKS)
    assert not inspect(engine).has_table(table(table_prefix))
    consume(broker_url, options, "plain", TASKS)
    broker = Broker(broker_url.removeprefix("sqlinbox+"), parse_options(options))
    try:
        assert sum(last_hour(broker.database, table_prefix)["plain"]) == TASKS
    finally:
        broker.close()


def test_a_row_completed_by_its_task_s_own_transaction_is_counted(
        broker_url: str, table_prefix: str) -> None:
    """A row completed with its task's own writes (as the sqlinbox result backend completes
    a task's row with its result) leaves through ``QoS.completed``, and counts."""
    with Connection(broker_url, transport_options=transport_options(table_prefix)) as conn, \
            conn.SimpleQueue("plain") as simple:
        channel: Any = conn.default_channel
        broker = channel.broker
        for n in range(TASKS):
            simple.put({"n": n})
        for _ in range(TASKS):
            message = simple.get(timeout=GET_LIMIT)
            row = message.delivery_info[ROW_KEY]
            with broker.engine.begin() as tx:
                assert broker.complete_in(tx, broker.table("plain"), row["id"], row["attempt"])
            channel.qos.completed(message.delivery_tag)
        assert broker.throughput.pending() == TASKS
        assert broker.throughput.flush()
        assert sum(last_hour(broker.database, table_prefix)["plain"]) == TASKS


def test_a_failed_flush_keeps_its_counts_warns_once_and_acks_go_through(
        broker_url: str, table_prefix: str, caplog: pytest.LogCaptureFixture) -> None:
    made = parse_options({"table_prefix": table_prefix})
    broker = Broker(broker_url.removeprefix("sqlinbox+"), made)
    counter = broker.throughput
    sql = broker.dialect.throughput_statements(table_prefix)
    counter.count("jobs")
    assert counter.flush()
    broker.run(lambda conn: conn.exec_driver_sql(sql.drop[0]))
    for _ in range(3):
        counter.count("jobs")
    with caplog.at_level(logging.INFO, logger="kombu_sqlinbox.throughput"):
        assert not counter.flush()  # the table went: kept, and made again next time
        assert counter.pending() == 3
        assert counter.flush()
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "kept for the next flush" in warned[0].getMessage()
    assert sum(last_hour(broker.database, table_prefix)["jobs"]) == 3  # the 1 went with it
    broker.run(lambda conn: conn.exec_driver_sql(sql.drop[0]))

    # where the transport does not create tables: a real consumer's acks go through
    # while the table is missing, the counts wait until it is made
    options = {"table_prefix": table_prefix, "create_tables": False}
    consume(broker_url, {"table_prefix": table_prefix}, "plain", 0)  # its table made
    caplog.clear()
    with Connection(broker_url, transport_options=options) as conn:
        channel: Any = conn.default_channel
        counter = channel.broker.throughput
        with conn.SimpleQueue("plain") as simple:
            for n in range(TASKS):
                simple.put({"n": n})
            for _ in range(TASKS):
                simple.get(timeout=GET_LIMIT).ack()
            with caplog.at_level(logging.WARNING, logger="kombu_sqlinbox.throughput"):
                assert not counter.flush() and not counter.flush()
            mine = [r for r in caplog.records if r.name == "kombu_sqlinbox.throughput"]
            assert len(mine) == 1 and "create it with" in mine[0].getMessage()
            assert counter.pending() == TASKS
            assert channel.broker.keeper.flush()
            assert simple.qsize() == 0  # every ack written
            broker.run(lambda conn: [conn.exec_driver_sql(s) for s in sql.ddl])
            assert counter.flush() and counter.pending() == 0
    assert sum(last_hour(broker.database, table_prefix)["plain"]) == TASKS
    broker.close()


def test_counts_older_than_kept_are_dropped_and_old_minutes_pruned(
        broker_url: str, table_prefix: str) -> None:
    broker = Broker(broker_url.removeprefix("sqlinbox+"),
                    parse_options({"table_prefix": table_prefix}))
    counter = broker.throughput
    sql = broker.dialect.throughput_statements(table_prefix)
    now = second_now()
    old = now - (KEPT_MINUTES + 2) * 60  # counted over KEPT_MINUTES ago
    counter._keep({(old, "jobs"): 5, (now, "jobs"): 2})  # a flush that failed
    assert counter.pending() == 2
    counter._counts[(old, "jobs")] += 5  # written late, as a process gone away may
    counter._pruned = time.monotonic()  # no prune due
    assert counter.flush()

    def minutes() -> list[int]:
        return broker.run(lambda conn: [int(row[0]) for row in conn.exec_driver_sql(
            f"SELECT minute FROM {broker.dialect.quote(sql.names[0])}")])
    kept = database_minute(broker, table_prefix) - KEPT_MINUTES
    assert min(minutes()) < kept
    counter._pruned -= PRUNE_INTERVAL  # a prune due: with the next flush's counts
    counter.count("jobs")
    assert counter.flush()
    assert minutes() and min(minutes()) >= kept
    broker.close()


@pytest.mark.parametrize("skew", [-30, 30], ids=["host-behind", "host-ahead"])
def test_minutes_pruning_and_the_chart_follow_the_database_clock_not_the_hosts(
        broker_url: str, table_prefix: str, monkeypatch: pytest.MonkeyPatch,
        skew: int) -> None:
    """The host's clock is ``skew`` minutes off the database's: a count is written in the
    database's minute, the prune keeps a minute the database calls fresh (100 minutes old)
    and deletes one it calls old (130), and the chart shows the database's last hour."""
    broker = Broker(broker_url.removeprefix("sqlinbox+"),
                    parse_options({"table_prefix": table_prefix}))
    counter = broker.throughput
    sql = broker.dialect.throughput_statements(table_prefix)
    first = database_minute(broker, table_prefix)
    seeded = {first - 130: 1, first - 100: 2, first - 10: 4}
    broker.database.ensure_table(sql.names[0], sql.ddl, True, lambda: "")
    broker.run(lambda conn: conn.execute(sql.add, [
        {"minute": minute, "queue": "jobs", "process": "seed", "settled": settled}
        for minute, settled in seeded.items()]))
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + skew * 60)
    counter.count("jobs")
    assert counter.flush()  # the first flush prunes
    shown = last_hour(broker.database, table_prefix)["jobs"]
    last = database_minute(broker, table_prefix)
    monkeypatch.undo()
    written = dict(broker.run(lambda conn: [(int(minute), int(settled)) for minute, settled in
                                            conn.exec_driver_sql(
        f"SELECT minute, SUM(settled) FROM {broker.dialect.quote(sql.names[0])} "
        "GROUP BY minute")]))
    broker.close()
    assert first - 130 not in written and written[first - 100] == 2, written
    counted = {minute: settled for minute, settled in written.items() if minute > first - 10}
    assert list(counted.values()) == [1] and first <= next(iter(counted)) <= last, written
    assert sum(shown) == 5 and shown[HOUR - 1 - (last - (first - 10))] == 4, shown
