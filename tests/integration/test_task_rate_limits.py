"""A task's rate limit (``task_rate_limits``) holds across processes: four processes race
over a backlog of two tasks, one limited; the limited one never starts more often than
its limit in any span, the other runs as fast as it comes (though queued behind it);
with the queue's own ``rate_limit`` and with concurrency limits, every limit holds at
once."""

from __future__ import annotations

import time
from typing import Any

import pytest
from kombu import Message
from sqlalchemy.engine import Engine

from bench.ledger import most_at_once
from kombu_sqlinbox.errors import ConfigurationError
from kombu_sqlinbox.options import parse_rate
from kombu_sqlinbox.rates import Budget
from kombu_sqlinbox.tables import TableBuilder

from .conftest import Connect
from .support import consumer_processes, count_rows, get_within, publish, table_of
from .test_rate_limits import most_in_any

QUEUE = "mixed"
PROCESSES = 4
LIMITED, FREE = "proj.call_api", "proj.resize"
TASK_RATE = "10/s"
#: rows of each task in the backlog, in this order
BACKLOG = {LIMITED: 50, FREE: 100}
#: the longest wait for a child or a run
WAIT = 60.0

SETUPS: dict[str, dict[str, Any]] = {
    "alone": {},
    "queue-rate": {"rate_limit": "30/s"},
    "concurrency": {"concurrency_limits": {"*": 1}},
}


def job(body: Any, message: Message) -> tuple[str, str | None]:
    """A task noting its name and key in the ledger (a key's run lasts 50 ms)."""
    if body["key"]:
        time.sleep(0.05)
    return message.headers["task"], body["key"]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("setup", SETUPS)
def test_racing_processes_keep_a_tasks_rate_and_leave_the_other_task_alone(
        connect: Connect, broker_url: str, engine: Engine, table_prefix: str,
        setup: str) -> None:
    queue_options = {"task_rate_limits": {LIMITED: TASK_RATE}, **SETUPS[setup]}
    options = {"table_prefix": table_prefix, "polling_interval": 0.05,
               "queues": {QUEUE: queue_options}}
    conn = connect(queues={QUEUE: queue_options})
    keyed = setup == "concurrency"
    for task, count in BACKLOG.items():  # the other task's rows behind the limited one's
        for number in range(count):
            key = f"k{number % 2}" if keyed and task == LIMITED else None
            publish(conn, QUEUE, {"key": key}, headers={"task": task},
                    **({"limit_key": key} if key else {}))
    with consumer_processes(PROCESSES, broker_url, options, QUEUE, 10, job, WAIT) as ledger:
        runs = [ledger.get(timeout=WAIT) for _ in range(sum(BACKLOG.values()))]
    starts = {task: sorted(start for name, _, start, _ in runs if name == task)
              for task in BACKLOG}
    tokens = Budget.of(parse_rate("rate", TASK_RATE)).tokens  # type: ignore[arg-type]
    for span in (1.0, 2.0):
        assert most_in_any(starts[LIMITED], span) <= 10 * span + 2 * tokens, (
            span, starts[LIMITED])
    limited = starts[LIMITED][-1] - starts[LIMITED][0]
    assert (BACKLOG[LIMITED] - 10) / 10 <= limited, limited
    free = starts[FREE][-1] - starts[FREE][0]
    if setup == "queue-rate":  # the queue's 30/s holds; the other task has what is left
        queue_tokens = Budget.of(parse_rate("rate", "30/s")).tokens  # type: ignore[arg-type]
        every = sorted(start for _, _, start, _ in runs)
        assert most_in_any(every, 1.0) <= 30 + 2 * queue_tokens, every
        assert free < BACKLOG[FREE] / 20 * 1.5, (starts[FREE], free)
    else:  # the other task is not held back: its backlog is done long before
        assert free < limited / 2, (starts[FREE], limited)
    if keyed:
        most = most_at_once((key, start, end) for _, key, start, end in runs if key)
        assert most == {"k0": 1, "k1": 1}, most
    assert count_rows(engine, table_of(QUEUE, table_prefix)) == 0


def test_tasks_without_a_limit_and_messages_naming_none_are_claimed_as_before(
        connect: Connect) -> None:
    """A limit of ``1/h`` on one task (a window the test cannot outlast): its second
    message waits for the next hour, the other task's and an unnamed one's come at
    once."""
    conn = connect(queues={QUEUE: {"task_rate_limits": {LIMITED: "1/h"}}})
    for task in (LIMITED, LIMITED, FREE, None):
        publish(conn, QUEUE, {"task": task}, headers={"task": task} if task else {})
    got = [get_within(conn, QUEUE) for _ in range(3)]
    assert sorted(str(message.decode()["task"]) for message in got) == sorted(
        [LIMITED, FREE, "None"])
    time.sleep(0.5)
    assert conn.default_channel.basic_get(QUEUE) is None
    for message in got:
        message.ack()


def test_a_spent_task_passes_over_no_task_whose_name_differs_in_case_or_trailing_spaces(
        connect: Connect) -> None:
    """``proj.call_api`` limited to ``1/h`` and spent after its first message: tasks
    named ``proj.CALL_API`` and ``proj.call_api `` are other tasks, without a limit, and
    come at once (a comparison under a case- or trailing-space-insensitive collation
    would pass over them with the spent one, for the rest of its window)."""
    conn = connect(queues={QUEUE: {"task_rate_limits": {LIMITED: "1/h"}}})
    others = [LIMITED.upper(), LIMITED + " "]
    for task in [LIMITED, LIMITED, *others]:
        publish(conn, QUEUE, {"task": task}, headers={"task": task})
    got = [get_within(conn, QUEUE, timeout=5) for _ in range(3)]
    assert sorted(str(message.decode()["task"]) for message in got) == sorted(
        [LIMITED, *others])
    assert conn.default_channel.basic_get(QUEUE) is None  # the second call_api waits
    for message in got:
        message.ack()


def test_a_table_without_a_celery_envelope_refuses_task_rate_limits(
        connect: Connect, table_prefix: str) -> None:
    spec = (TableBuilder(f"{table_prefix}orders").id().payload().attempt().locked_until()
            .available_at().build())
    conn = connect(queues={QUEUE: {"table": spec, "task_rate_limits": {LIMITED: "1/s"}}})
    publish(conn, QUEUE, {"n": 1})
    with pytest.raises(ConfigurationError, match="task_rate_limits need a queue table"):
        conn.default_channel.basic_get(QUEUE)
