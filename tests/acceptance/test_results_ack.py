"""A late-acked task's result written in the transaction that completes its row, by real
workers: a worker killed mid-run leaves each task one result, stored by its last run; a
delivery whose row was claimed again writes none; a transactional task's result commits
with its writes (a result too large rolls them back)."""

from __future__ import annotations

import os
import signal
import time
from collections import Counter

import pytest
from celery import Celery, chord
from sqlalchemy import text
from sqlalchemy.engine import Engine

from tests.acceptance.apps import tasks
from tests.acceptance.conftest import MAX_RESULT_BYTES, RESULT_LIMIT, Acceptance, results_conf
from tests.processes import Proc, wait_until

LEASE = 2
#: tasks of the kill test; its workers, the last of them never killed
TASKS = 30
WORKERS = ("a", "b", "last")


def result_rows(acceptance: Acceptance, engine: Engine) -> dict[str, tuple[str, int]]:
    """Every stored task's state and how many rows it has."""
    table = engine.dialect.identifier_preparer.quote(acceptance.table_prefix + "task_results")
    with engine.connect() as conn:
        rows = conn.execute(text(f"SELECT task_id, status FROM {table}")).all()
    ids = [row[0] if isinstance(row[0], str) else row[0].decode() for row in rows]
    counts = Counter(ids)
    return {task_id: (str(row[1]), counts[task_id]) for task_id, row in zip(ids, rows, strict=True)}


@pytest.mark.slow
def test_a_worker_killed_mid_run_leaves_each_task_one_result_from_its_last_run(
        acceptance: Acceptance, caller: Celery, db_url: str, engine: Engine) -> None:
    """Three workers share the tasks (0.2 s each); two are killed, one after the other,
    each once it has started runs (so with tasks running: their rows come back after
    the lease). A result stored apart from its ack could survive a kill whose row then
    runs again: here the run that stored a task's result is its last run."""
    acceptance.configure(visibility_timeout=LEASE)
    keys = [f"k{n:03d}" for n in range(TASKS)]
    sent = {key: caller.send_task("acc.run_late", args=(key, 0.2)) for key in keys}
    *victims, last = acceptance.workers(WORKERS, "prefork", 2, **results_conf(db_url))
    for victim in victims:
        wait_until(lambda name=victim.name: acceptance.runs.started_on(name) >= 2, 30,
                   f"runs to start on {victim.name}", alive=[victim])
        victim.kill()
    tokens = {key: result.get(timeout=RESULT_LIMIT) for key, result in sent.items()}
    assert last.stop() == 0, last.tail()
    assert LEFT not in last.output()  # the rows of killed workers ran again, acks in order

    stored = result_rows(acceptance, engine)
    assert {stored[sent[key].id] for key in keys} == {("SUCCESS", 1)}
    ran_again = {}
    for key in keys:
        order = [record["token"] for record in acceptance.runs.records(key)]
        assert tokens[key] in order, f"{key}: its result names no run of it"
        if order[-1] != tokens[key]:
            ran_again[key] = order
    assert not ran_again, f"tasks that ran again after their result was stored: {ran_again}"
    assert sum(acceptance.runs.starts().values()) > TASKS, "no kill landed mid-run"
    assert acceptance.rows() == 0


LEFT = "settled rows had already left this process"


def claimed_again_behind_a_stopped_worker(acceptance: Acceptance, db_url: str
                                         ) -> tuple[Proc, Proc]:
    """The held task run by a first worker whose main process is then stopped (nothing
    extends the lease), and its row claimed again by a second worker."""
    first = acceptance.worker("prefork", 1, name="first", **results_conf(db_url))
    wait_until(lambda: acceptance.runs.starts()["held"] >= 1, 30, "the first run",
               alive=[first])
    acceptance.suspend(first)
    second = acceptance.worker("prefork", 1, name="second", **results_conf(db_url))
    wait_until(lambda: acceptance.runs.starts()["held"] >= 2, 30,
               "the row to be claimed again", alive=[second])
    return first, second


def test_a_success_whose_result_completed_its_row_needs_no_ack_a_row_claimed_again_is_reported(
        acceptance: Acceptance, caller: Celery, db_url: str) -> None:
    """Late-acked tasks whose results complete their rows: the worker's acks of them have
    nothing left to do, and it reports no row that had already left. A delivery whose
    row was claimed again (its worker's main process stopped past the lease, its result
    ignored) still is reported once that process acks it."""
    acceptance.configure(visibility_timeout=LEASE)
    plain = acceptance.worker("prefork", 2, name="plain", **results_conf(db_url))
    sent = [caller.send_task("acc.add_late", args=(n, 1)) for n in range(20)]
    assert [result.get(timeout=RESULT_LIMIT) for result in sent] == list(range(1, 21))
    assert plain.stop() == 0, plain.tail()  # its keeper writes what is queued first
    assert "Task acc.add_late" in plain.output() and LEFT not in plain.output()

    caller.send_task("acc.run_late", args=("held",), kwargs={"hold": True}, ignore_result=True)
    first, second = claimed_again_behind_a_stopped_worker(acceptance, db_url)
    acceptance.runs.release("held")
    wait_until(lambda: acceptance.runs.done()["held"] == 2, 30, "both runs to end")
    os.kill(first.popen.pid, signal.SIGCONT)
    wait_until(lambda: f"1 of 1 {LEFT}" in first.output(), 30,
               "the first delivery's ack to be reported", alive=[first])
    assert LEFT not in second.output()


@pytest.mark.slow
def test_a_delivery_whose_row_was_claimed_again_stores_no_result_and_counts_nothing(
        acceptance: Acceptance, caller: Celery, db_url: str) -> None:
    """The first worker's main process is stopped while its pool process runs the task
    (the header of a chord): nothing extends the lease, and a second worker claims the
    row again. Both runs end; only the second delivery's result is stored and counted:
    the body runs once with it, its error callback never."""
    acceptance.configure(visibility_timeout=LEASE)
    body = chord([caller.signature("acc.run_late", args=("held",), kwargs={"hold": True})])(
        caller.signature("acc.collect").on_error(caller.signature("acc.errback")))
    result = body.parent.results[0]
    first, _ = claimed_again_behind_a_stopped_worker(acceptance, db_url)
    acceptance.runs.release("held")
    token = result.get(timeout=RESULT_LIMIT)
    wait_until(lambda: "is no longer this delivery's; its SUCCESS is not stored"
               in first.output(), 30, "the first delivery's write to be refused")
    wait_until(lambda: f"Task acc.run_late[{result.id}] succeeded" in first.output(), 30,
               "the first delivery's end (its chord part returned)")
    first_run, second_run = acceptance.runs.records("held")
    assert result.worker.startswith("second@")
    assert acceptance.runs.done()["held"] == 2
    assert token == second_run["token"] != first_run["token"]
    assert body.get(timeout=RESULT_LIMIT) == [token]
    wait_until(lambda: acceptance.rows() == 0, 30, "the body's row to be done")
    assert acceptance.runs.starts()["body"] == 1
    assert acceptance.runs.starts()["errback"] == 0


def test_a_transactional_tasks_result_commits_with_its_writes(
        acceptance: Acceptance, caller: Celery, db_url: str, engine: Engine) -> None:
    """A result too large fails inside the task's transaction: its insert rolls back, and
    the failure is stored instead."""
    marks = engine.dialect.identifier_preparer.quote(acceptance.table_prefix + tasks.MARKS)
    with engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {marks} (mark VARCHAR(64) NOT NULL)"))
    acceptance.worker("prefork", 1, **results_conf(db_url))
    assert caller.send_task("acc.marked", args=("small", 10)).get(
        timeout=RESULT_LIMIT) == "x" * 10
    too_large = caller.send_task("acc.marked", args=("large", 2 * MAX_RESULT_BYTES))
    with pytest.raises(Exception, match="more than the result table") as refused:
        too_large.get(timeout=RESULT_LIMIT)
    assert type(refused.value).__name__ == "ResultTooLarge"
    with engine.connect() as conn:
        assert [row[0] for row in conn.execute(text(f"SELECT mark FROM {marks}"))] == ["small"]
    assert acceptance.rows() == 0


def test_a_failure_the_worker_rejects_is_stored_and_its_row_dead_lettered(
        acceptance: Acceptance, caller: Celery, db_url: str) -> None:
    """A ``Reject`` and a failure of a task that does not acknowledge failures: the
    worker rejects their rows, so their results do not complete them; both are stored
    as failures and both rows reach the dead-letter queue."""
    acceptance.configure(dead_letter_queue="dead")
    acceptance.declare("dead")
    acceptance.worker("prefork", 1, **results_conf(db_url))
    failed = [caller.send_task("acc.rejected", args=("no",)),
              caller.send_task("acc.fail_rejected", args=("card declined",))]
    for result in failed:
        with pytest.raises(Exception, match=r"no|card declined"):
            result.get(timeout=RESULT_LIMIT)
        assert result.state == "FAILURE"
    wait_until(lambda: acceptance.rows("dead") == 2, 30, "both rows to be dead-lettered")
    assert acceptance.rows() == 0


@pytest.mark.databases("postgresql", "mysql")  # a database file has no connection to cut
def test_a_result_whose_database_is_away_as_the_task_ends_is_written_once_it_answers(
        acceptance: Acceptance, caller: Celery, db_url: str) -> None:
    """The queue's and the results' database refuses every connection as a late-acked
    task ends: the worker writes the result with the row's completion once the database
    answers again, without Celery's result_backend_always_retry (it lost the result: the
    worker's acknowledgement, retried, completed the row without it)."""
    from sqlalchemy.engine import make_url

    from tests.tcp_proxy import Proxy

    target = make_url(db_url)
    proxy = Proxy(str(target.host), int(target.port or 0))
    try:
        worker = acceptance.worker("prefork", 1, broker_url="sqlinbox+" + proxy.url(db_url),
                                   **results_conf(proxy.url(db_url)))
        sent = caller.send_task("acc.run_late", args=("away",), kwargs={"hold": True})
        wait_until(lambda: acceptance.runs.records("away"), RESULT_LIMIT,
                   "the task to start", [worker])
        with proxy.refuse():
            acceptance.runs.release("away")
            wait_until(lambda: acceptance.runs.done()["away"] and proxy.refused,
                       RESULT_LIMIT, "the task to end and its result's write to be refused",
                       [worker])
        assert sent.get(timeout=RESULT_LIMIT) == acceptance.runs.records("away")[0]["token"]
        wait_until(lambda: acceptance.rows() == 0, RESULT_LIMIT, "the row to be completed",
                   [worker])
        assert acceptance.runs.starts()["away"] == 1
    finally:
        proxy.close()


def claim_and_give_back(caller: Celery) -> None:
    """Claim the queue's next row in this process and release it (as a worker shutting
    down gives back a row it had reserved): its next delivery is a redelivery."""
    with caller.connection_for_write() as conn:
        channel = conn.default_channel
        wait_until(lambda: channel.basic_get("celery", no_ack=False), 30,
                   "a row to claim").requeue()


def test_a_redelivered_task_celery_deduplicates_completes_its_row(
        acceptance: Acceptance, caller: Celery, db_url: str) -> None:
    """With worker_deduplicate_successful_tasks, a redelivered task whose id already has a
    SUCCESS (its id sent twice) is not run: Celery reports a success and no result is
    written, so nothing completed its row but the worker's ack."""
    acceptance.configure(visibility_timeout=LEASE)
    conf = results_conf(db_url, worker_deduplicate_successful_tasks=True)
    first = acceptance.worker("prefork", 1, name="first", **conf)
    sent = caller.send_task("acc.run_late", args=("dup",))
    token = sent.get(timeout=RESULT_LIMIT)
    assert first.stop() == 0, first.tail()
    caller.send_task("acc.run_late", args=("dup",), task_id=sent.id)
    claim_and_give_back(caller)
    second = acceptance.worker("prefork", 1, name="second", **conf)
    wait_until(lambda: "Task already completed successfully" in second.output(), 30,
               "the redelivery to be deduplicated", alive=[second])
    wait_until(lambda: acceptance.rows() == 0, 4 * LEASE + 10,
               "the deduplicated row to be completed", alive=[second])
    assert second.stop() == 0, second.tail()
    assert second.output().count("Task already completed successfully") == 1
    assert acceptance.runs.starts()["dup"] == 1
    assert sent.get(timeout=RESULT_LIMIT) == token


@pytest.mark.slow
def test_a_row_its_worker_claimed_again_keeps_its_lease_after_the_first_run_ends(
        acceptance: Acceptance, caller: Celery, db_url: str) -> None:
    """The worker's main process is stopped past the lease while its pool process runs
    the task (10 s); the row is claimed and given back meanwhile, and the worker, resumed,
    claims it again: two runs of one row in one worker. The first run ends (its write
    refused) with more than a lease of the second to go: the second delivery's lease is
    still extended, so the task runs twice, not again after every lease."""
    acceptance.configure(visibility_timeout=LEASE)
    worker = acceptance.worker("prefork", 2, **results_conf(db_url))
    sent = caller.send_task("acc.run_late", args=("twice", 10.0))
    wait_until(lambda: acceptance.runs.starts()["twice"] >= 1, 30, "the first run",
               alive=[worker])
    acceptance.suspend(worker)
    claim_and_give_back(caller)
    stopped_until = time.monotonic() + 2 * LEASE  # the second run ends 2 leases after the first
    wait_until(lambda: time.monotonic() > stopped_until, 10, "two more leases")
    os.kill(worker.popen.pid, signal.SIGCONT)
    wait_until(lambda: acceptance.runs.starts()["twice"] >= 2, 30,
               "the worker to claim the row again", alive=[worker])
    wait_until(lambda: acceptance.runs.done()["twice"] >= 2, 30, "both runs to end",
               alive=[worker])
    assert acceptance.runs.starts()["twice"] == 2
    assert sent.get(timeout=RESULT_LIMIT) == acceptance.runs.records("twice")[1]["token"]
    wait_until(lambda: acceptance.rows() == 0, 30, "the row to be completed", alive=[worker])


def test_a_success_whose_result_was_not_written_with_its_row_is_acked_once(
        acceptance: Acceptance, caller: Celery, db_url: str) -> None:
    """Late-acked tasks that return but whose results did not complete their rows: one
    too large and one not encodable (Celery stores their failures instead), one whose
    caller ignores its result. Each row is completed by the worker and runs once; none
    comes back after its lease."""
    acceptance.configure(visibility_timeout=LEASE)
    worker = acceptance.worker("prefork", 2, **results_conf(db_url))
    failed = [caller.send_task("acc.sized_late", args=(2 * MAX_RESULT_BYTES,)),
              caller.send_task("acc.unencodable_late")]
    ignored = caller.send_task("acc.run_late", args=("ignored",), ignore_result=True)
    for result in failed:
        with pytest.raises(Exception, match=r"more than the result table|serializ|JSON"):
            result.get(timeout=RESULT_LIMIT)
    wait_until(lambda: acceptance.runs.done()["ignored"] == 1, 30, "the ignored run",
               alive=[worker])
    wait_until(lambda: acceptance.rows() == 0, 30, "every row to be completed",
               alive=[worker])
    lapsed = time.monotonic() + 2 * LEASE  # a row left to its lease would be back by then
    wait_until(lambda: time.monotonic() > lapsed, 10, "two leases")
    assert worker.stop() == 0, worker.tail()
    for task_id in [result.id for result in failed] + [ignored.id]:
        assert worker.output().count(f"[{task_id}] received") == 1, worker.tail()
    assert acceptance.runs.starts()["ignored"] == 1


def test_a_result_whose_tables_are_missing_is_written_once_they_are_created(
        acceptance: Acceptance, caller: Celery, db_url: str) -> None:
    """With ``create_tables`` off and the result tables not created yet (an operator's
    migration not run), a late-acked task's result is held and written again, as for a
    database that does not answer, until they are there: the write's error used to
    complete the row with no result (prefork) or stop the worker (solo), the row then
    running again at each start."""
    conf = results_conf(db_url)
    conf["result_backend_transport_options"] = {"create_tables": False}
    worker = acceptance.worker("solo", 1, **conf)
    sent = caller.send_task("acc.run_late", args=("early",))
    wait_until(lambda: "writing its result failed" in worker.output(), RESULT_LIMIT,
               "the result's write to fail for want of its tables", [worker])
    assert acceptance.rows() == 1  # held, not completed without its result
    caller.backend.store.ensure()  # the migration runs
    assert sent.get(timeout=RESULT_LIMIT) == acceptance.runs.records("early")[0]["token"]
    wait_until(lambda: acceptance.rows() == 0, RESULT_LIMIT, "the row to be completed",
               [worker])
    assert acceptance.runs.starts()["early"] == 1


def test_result_tables_dropped_under_a_running_worker_are_created_again_for_its_next_result(
        acceptance: Acceptance, caller: Celery, db_url: str, engine: Engine) -> None:
    """The result tables dropped while a worker runs (found there at its first result):
    its next late-acked result's write fails, finds them gone, creates them again and is
    written, where the error used to complete the row with no result or stop the
    worker."""
    from kombu_sqlinbox.dialects import dialect_for

    worker = acceptance.worker("solo", 1, **results_conf(db_url))
    first = caller.send_task("acc.run_late", args=("first",))
    assert first.get(timeout=RESULT_LIMIT) == acceptance.runs.records("first")[0]["token"]
    with engine.begin() as conn:
        for statement in dialect_for(engine).result_statements(acceptance.table_prefix).drop:
            conn.exec_driver_sql(statement)
    second = caller.send_task("acc.run_late", args=("second",))
    wait_until(lambda: acceptance.runs.done()["second"] and acceptance.rows() == 0,
               RESULT_LIMIT, "the second task to run and its row to be completed", [worker])
    assert second.get(timeout=RESULT_LIMIT) == acceptance.runs.records("second")[0]["token"]
    assert acceptance.runs.starts()["second"] == 1
