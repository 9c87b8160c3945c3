"""Processes racing to publish the same unique keys: in every round exactly one row per key
lands, and every other publish is told which task holds it."""

from __future__ import annotations

import multiprocessing
from multiprocessing.synchronize import Barrier

import pytest
from kombu import Connection
from sqlalchemy import text
from sqlalchemy.engine import Engine

from kombu_sqlinbox.errors import DuplicateTask

from .support import quoted, table_of

PROCESSES = 4
KEYS = 20
ROUNDS = 5
#: the longest any process waits for the others at a round's start or end
WAIT = 60.0


def publisher(broker_url: str, prefix: str, number: int, scope: str | float,
              barrier: Barrier, results: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    """Publish every key each round, in an order of this process's own, and report how
    many landed and whether every refusal named a holder."""
    with Connection(broker_url, transport_options={"table_prefix": prefix}) as conn:
        conn.default_channel.queue_declare("race")
        producer = conn.Producer()
        for round_number in range(ROUNDS):
            barrier.wait(WAIT)
            landed, unnamed = 0, 0
            order = list(range(KEYS))[number::2] + list(range(KEYS))[1 - number % 2::2]
            for key in order:
                task_id = f"p{number}-r{round_number}-k{key}"
                try:
                    producer.publish({"k": key}, routing_key="race", headers={"id": task_id},
                                     unique_key=f"key-{key}", unique_scope=scope,
                                     retry=False)
                    landed += 1
                except DuplicateTask as exc:
                    unnamed += exc.task_id is None
            results.put((number, round_number, landed, unnamed))
            barrier.wait(WAIT)  # the parent counts the rows and empties the table
            barrier.wait(WAIT)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("scope", ["active", 3600.0], ids=["active", "timed"])
def test_racing_processes_land_exactly_one_row_per_key_each_round(
        broker_url: str, engine: Engine, table_prefix: str, scope: str | float) -> None:
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(PROCESSES + 1)
    results = context.Queue()
    children = [context.Process(target=publisher, args=(broker_url, table_prefix, number,
                                                         scope, barrier, results))
                for number in range(PROCESSES)]
    for child in children:
        child.start()
    table = quoted(engine, table_of("race", table_prefix))
    timed = quoted(engine, f"{table_prefix}unique_keys")
    try:
        for _ in range(ROUNDS):
            barrier.wait(WAIT)  # go
            barrier.wait(WAIT)  # all published
            with engine.begin() as db:
                rows = db.execute(text(f"SELECT COUNT(*) FROM {table}")).scalar_one()
                if scope == "active":
                    keys = db.execute(text(f"SELECT sqlinbox_unique FROM {table}")).all()
                else:  # the timed keys' own table; its rows go with the time
                    keys = db.execute(text(f"SELECT unique_key FROM {timed}")).all()
                    db.execute(text(f"DELETE FROM {timed}"))
                distinct = set(keys)
                db.execute(text(f"DELETE FROM {table}"))  # every task done: the keys free
            assert rows == KEYS and len(distinct) == KEYS, (rows, distinct)
            barrier.wait(WAIT)
        reports = [results.get(timeout=WAIT) for _ in range(PROCESSES * ROUNDS)]
    finally:
        for child in children:
            child.join(WAIT)
            if child.is_alive():
                child.kill()
    for round_number in range(ROUNDS):
        landed = [r[2] for r in reports if r[1] == round_number]
        assert sum(landed) == KEYS, f"round {round_number}: {landed}"
    assert all(r[3] == 0 for r in reports), "every refusal names the holder"
    assert all(child.exitcode == 0 for child in children)
