"""Row mode keeps FIFO groups: rows written with plain SQL, in rounds, while several
``celery worker`` processes race for them, run one row of a group at a time, in order,
also when deliveries are requeued or retried in place."""

from __future__ import annotations

import json
import random

import pytest
from sqlalchemy import text

from kombu_sqlinbox import Role
from kombu_sqlinbox.codec import DEATH_HEADER
from kombu_sqlinbox.dialects import dialect_for
from kombu_sqlinbox.tables import table_name_for_queue
from tests.ordering.apps import tasks
from tests.ordering.apps.common import any_overlap_across, check_serial_in_order
from tests.ordering.conftest import Ordering, wait_for_count
from tests.processes import wait_until, worker_argv

GROUPS, ROWS, ROUNDS = 10, 30, 3


@pytest.mark.slow
def test_row_mode_fifo_groups_hold_order_across_racing_workers(ordering: Ordering) -> None:
    workers = ordering.workers([f"w{n}" for n in range(3)], "jobs", "rows", pool="threads",
                               concurrency=4)
    table = ordering.engine.dialect.identifier_preparer.quote(f"{ordering.prefix}rows_jobs")
    insert = text(f"INSERT INTO {table} (grp, payload) VALUES (:grp, :payload)")
    per_round = ROWS // ROUNDS
    for round_no in range(ROUNDS):
        turns = [g for g in range(GROUPS) for _ in range(per_round)]
        random.shuffle(turns)  # the groups' rows interleave at random
        sent = {g: round_no * per_round for g in range(GROUPS)}
        rows = []
        for g in turns:
            kwargs = {"grp": f"g{g}", "seq": sent[g], "requeue_rate": 0.1, "retry_rate": 0.1}
            rows.append({"grp": f"g{g}", "payload": json.dumps(kwargs).encode()})
            sent[g] += 1
        with ordering.engine.begin() as conn:
            conn.execute(insert, rows)
        # the next round is written while this one is in work
        started = round_no * GROUPS * per_round + 1
        wait_until(lambda floor=started: ordering.log.done() >= floor, 60,
                   f"round {round_no} to start", alive=workers)
    wait_for_count(ordering.log.done, GROUPS * ROWS, "rows done", workers, limit=180)

    entries = ordering.log.entries()
    check_serial_in_order(entries, {f"g{g}": ROWS for g in range(GROUPS)})
    assert {"requeue", "retry"} <= {e.outcome for e in entries}, "no random failure happened"
    assert any_overlap_across(entries), "groups never ran side by side"
    # a worker claims a group's next row in the transaction that settles its head, so a
    # group tends to stay with one worker; requeues and retries hand rows to the others
    assert len({e.pid for e in entries}) >= 2, "no two workers took rows"


@pytest.mark.slow
def test_a_row_that_cannot_be_read_is_parked_and_the_rows_behind_it_run(
        ordering: Ordering) -> None:
    """A payload that is not UTF-8 (at its first claim, and past ``max_attempts``) stops no
    worker: both rows are parked with why, and the rows of their group written after them
    run, in order."""
    workers = ordering.workers(["w1"], "jobs", "rows", pool="threads", concurrency=2,
                               max_attempts=3, dead_letter_queue="jobs.dead")
    table = ordering.engine.dialect.identifier_preparer.quote(f"{ordering.prefix}rows_jobs")
    rows = [{"grp": "g0", "payload": b"\xff\xfe{}", "attempt": 0},
            {"grp": "g0", "payload": b"\xff{}", "attempt": 7}]
    rows += [{"grp": "g0", "payload": json.dumps({"grp": "g0", "seq": seq}).encode(),
              "attempt": 0} for seq in range(5)]
    with ordering.engine.begin() as conn:
        conn.execute(text(f"INSERT INTO {table} (grp, payload, attempt) "
                          "VALUES (:grp, :payload, :attempt)"), rows)
    wait_for_count(ordering.log.done, 5, "rows behind the unreadable ones", workers, limit=60)
    check_serial_in_order(ordering.log.entries(), {"g0": 5})
    dead = ordering.engine.dialect.identifier_preparer.quote(
        table_name_for_queue("jobs.dead", ordering.prefix))
    with ordering.engine.connect() as conn:
        reasons = conn.execute(text(f"SELECT headers FROM {dead} ORDER BY id")).scalars().all()
    assert [json.loads(r)["headers"][DEATH_HEADER]["reason"][:28] for r in reasons] == [
        "the payload column is not UT", "delivered 8 times, max_attem"]
    assert "Unrecoverable error" not in workers[0].output()


@pytest.mark.databases("sqlite")
def test_a_worker_refuses_a_sqlite_row_mode_table_whose_ids_repeat(ordering: Ordering) -> None:
    """``id INTEGER PRIMARY KEY`` without AUTOINCREMENT: a row written after the last one
    was deleted takes its id, and so its task id. The worker says so at start-up and
    exits, running nothing, rather than run two rows as one task."""
    dialect = dialect_for(ordering.engine)
    types = dialect.column_types
    table = dialect.quote(f"{ordering.prefix}rows_jobs")
    with ordering.engine.begin() as conn:
        conn.execute(text(
            f"CREATE TABLE {table} (id INTEGER PRIMARY KEY, payload {types[Role.PAYLOAD]}, "
            f"grp TEXT, available_at {types[Role.AVAILABLE_AT]}, "
            f"locked_until {types[Role.LOCKED_UNTIL]}, attempt {types[Role.ATTEMPT]})"))
        conn.execute(text(f"INSERT INTO {table} (grp, payload) VALUES ('g0', :payload)"),
                     {"payload": json.dumps({"grp": "g0", "seq": 0}).encode()})
    worker = ordering.processes.spawn("w1", [
        *worker_argv("tests.ordering.apps.tasks", "threads", 2), "-n", "w1@%h"],
        tasks.worker_env(ordering.broker_url, ordering.db_url, ordering.prefix, "jobs", "rows"))
    wait_until(lambda: worker.popen.poll() is not None or ordering.log.done(), 60,
               "the worker to refuse the table or run its row")
    assert ordering.log.done() == 0, "a row of a table whose ids repeat ran"
    assert worker.wait(30) != 0
    assert "id INTEGER PRIMARY KEY without AUTOINCREMENT" in worker.output()
