"""Real workers storing results in the service's database (``result_backend =
"sqlinbox+<database URL>"``), read by a caller's ``get()``: values, failures, retries,
extended meta, a result too large, groups, and Celery's ``backend_cleanup``."""

from __future__ import annotations

import pytest
from celery import Celery, chord, group
from celery.result import GroupResult
from sqlalchemy import text
from sqlalchemy.engine import Engine, make_url

from tests.acceptance.conftest import MAX_RESULT_BYTES, RESULT_LIMIT, Acceptance, results_conf
from tests.processes import wait_until
from tests.tcp_proxy import Proxy


def test_a_worker_stores_values_failures_retries_and_extended_meta(
        acceptance: Acceptance, caller: Celery, db_url: str) -> None:
    acceptance.worker("prefork", 2, **results_conf(db_url))
    added = caller.send_task("acc.add", args=(2, 3))
    assert added.get(timeout=RESULT_LIMIT) == 5
    assert (added.name, added.args, added.kwargs) == ("acc.add", [2, 3], {})
    assert added.worker.startswith("w1@") and added.queue == "celery"

    failed = caller.send_task("acc.fail", args=("card declined",))
    with pytest.raises(ValueError, match="card declined"):
        failed.get(timeout=RESULT_LIMIT)
    assert "ValueError: card declined" in failed.traceback

    retried = caller.send_task("acc.retried")
    assert retried.get(timeout=RESULT_LIMIT) == 1
    assert retried.retries == 1


def test_custom_task_ids_up_to_the_id_limit_get_their_results_longer_ones_are_refused(
        acceptance: Acceptance, caller: Celery, db_url: str) -> None:
    """Task ids a caller chooses (``task_id=...``), longer than 255 characters and in
    utf8mb4, store their results (early and late acked); one longer than the column
    holds is refused as it is sent, not left without a result for ``get()`` to wait on."""
    from kombu_sqlinbox.dialects.results import RESULT_ID_BYTES
    from kombu_sqlinbox.errors import ResultIdTooLong

    acceptance.worker("prefork", 1, **results_conf(db_url))
    longest = "report:\U0001f4e6:" + "é" * ((RESULT_ID_BYTES - 12) // 2)
    assert len(longest.encode()) == RESULT_ID_BYTES
    for name, task_id in (("acc.add", "order-" + "7" * 400), ("acc.add_late", longest)):
        assert caller.send_task(name, args=(1, 2), task_id=task_id).get(
            timeout=RESULT_LIMIT) == 3
        assert caller.AsyncResult(task_id).name == name
    with pytest.raises(ResultIdTooLong, match=rf"{RESULT_ID_BYTES + 1} bytes"):
        caller.send_task("acc.add", args=(1, 2), task_id=longest + "x")


@pytest.mark.databases("postgresql", "mysql")
def test_with_always_retry_a_result_is_written_once_its_database_answers_again(
        acceptance: Acceptance, caller: Celery, db_url: str) -> None:
    """Results in another database than the queue (here: reached through a proxy), which
    refuses every connection as an early-acked task ends: with Celery's
    ``result_backend_always_retry`` the worker writes the result once the database
    answers again (it lost it: the error was not one the backend called safe to retry).
    A late-acked task's is written again without it (test_results_ack)."""
    target = make_url(db_url)
    proxy = Proxy(str(target.host), int(target.port or 0))
    worker = acceptance.worker("prefork", 1, **results_conf(
        proxy.url(db_url), result_backend_always_retry=True))
    sent = caller.send_task("acc.run", args=("away",), kwargs={"hold": True})
    wait_until(lambda: acceptance.runs.records("away"), RESULT_LIMIT, "the task to start",
               [worker])
    with proxy.refuse():
        acceptance.runs.release("away")
        wait_until(lambda: acceptance.runs.done()["away"] and proxy.refused, RESULT_LIMIT,
                   "the task to end and its result's write to be refused", [worker])
    assert sent.get(timeout=RESULT_LIMIT) == acceptance.runs.records("away")[0]["token"]
    assert acceptance.runs.starts()["away"] == 1
    proxy.close()


def test_arguments_too_large_to_store_leave_the_result_stored_without_them(
        acceptance: Acceptance, caller: Celery, db_url: str) -> None:
    """``result_extended`` stores a task's arguments with its result: arguments larger
    than the result tables take are left out (``args`` None), not the result (nothing was
    stored: neither the result nor the failure, whose meta carried them too)."""
    worker = acceptance.worker("prefork", 1, **results_conf(db_url))
    summed = caller.send_task("acc.total", args=([1] * MAX_RESULT_BYTES,))
    assert summed.get(timeout=RESULT_LIMIT) == MAX_RESULT_BYTES
    assert (summed.name, summed.args, summed.kwargs) == ("acc.total", None, None)
    assert f"task {summed.id}: its arguments are left out of its stored result" in \
        worker.output()


def test_a_result_too_large_fails_the_task_with_an_error_saying_so(
        acceptance: Acceptance, caller: Celery, db_url: str) -> None:
    acceptance.worker("prefork", 1, **results_conf(db_url))
    too_large = caller.send_task("acc.sized", args=(2 * MAX_RESULT_BYTES,))
    with pytest.raises(Exception, match=(
            r"its result takes \d+ bytes encoded, more than the result table \S+task_results "
            rf"stores \({MAX_RESULT_BYTES} bytes")) as refused:
        too_large.get(timeout=RESULT_LIMIT)
    assert type(refused.value).__name__ == "ResultTooLarge"
    assert too_large.state == "FAILURE"
    assert caller.send_task("acc.sized", args=(100,)).get(timeout=RESULT_LIMIT) == "x" * 100


def test_a_saved_group_is_restored_and_a_chord_runs_its_body(
        acceptance: Acceptance, caller: Celery, db_url: str) -> None:
    """A group saved by its id is restored and joined (``join_native``: one select per
    wake-up); a chord of early-acked tasks, each counted in a transaction after its
    result's, runs its body once its header is done."""
    acceptance.worker("prefork", 2, **results_conf(db_url))
    sent = group(caller.signature("acc.add", args=(n, n)) for n in range(4)).apply_async()
    sent.save()
    restored = GroupResult.restore(sent.id, app=caller)
    assert restored is not None
    assert restored.get(timeout=RESULT_LIMIT) == [0, 2, 4, 6]
    header = [caller.signature("acc.add", args=(n, 1)) for n in range(3)]
    body = chord(header)(caller.signature("acc.total"))
    assert body.get(timeout=RESULT_LIMIT) == 6


def test_backend_cleanup_on_a_worker_deletes_the_expired_results(
        acceptance: Acceptance, caller: Celery, db_url: str, engine: Engine) -> None:
    acceptance.worker("prefork", 1, **results_conf(db_url, result_expires=60))
    old = caller.send_task("acc.add", args=(1, 1))
    new = caller.send_task("acc.add", args=(2, 2))
    assert (old.get(timeout=RESULT_LIMIT), new.get(timeout=RESULT_LIMIT)) == (2, 4)
    table = engine.dialect.identifier_preparer.quote(acceptance.table_prefix + "task_results")
    with engine.begin() as conn:  # done an hour ago
        conn.execute(text(f"UPDATE {table} SET date_done = date_done - 3600 "
                          "WHERE task_id = :id"), {"id": old.id})
    caller.send_task("celery.backend_cleanup").get(timeout=RESULT_LIMIT)
    with engine.connect() as conn:
        kept = {row[0] if isinstance(row[0], str) else row[0].decode()
                for row in conn.execute(text(f"SELECT task_id FROM {table}"))}
    assert old.id not in kept and new.id in kept


@pytest.mark.databases("postgresql")
def test_the_workers_banner_shows_the_backend_url_without_its_password(
        acceptance: Acceptance, db_url: str) -> None:
    """PostgreSQL here trusts local connections, so a password in the URL is shown (or
    not) without being checked."""
    url = make_url(db_url).set(password="s3cret-pw").render_as_string(hide_password=False)
    worker = acceptance.worker("solo", 1, **results_conf(url))
    banner = next(line for line in worker.output().splitlines() if "results:" in line)
    assert "s3cret-pw" not in worker.output()
    assert banner.split("results:", 1)[1].strip() == "sqlinbox+" + make_url(url).render_as_string(
        hide_password=True).replace(":***@", ":**@")


def test_a_task_whose_id_no_result_row_keys_runs_once_and_leaves_the_worker_running(
        acceptance: Acceptance, caller: Celery, db_url: str) -> None:
    """Ids the result tables cannot key (longer than their key; with a NUL, which
    PostgreSQL's text refuses), sent by a producer that does not check them (an app
    without this backend): a solo worker runs each task once, logs that its result is not
    stored, acknowledges it and goes on, where the write's error stopped the worker at
    each start (the row, never acknowledged, came back to the next one). A caller of
    this backend is refused such an id as it sends."""
    from kombu_sqlinbox.dialects.results import RESULT_ID_BYTES
    from kombu_sqlinbox.errors import ResultIdRefused

    worker = acceptance.worker("solo", 1, **results_conf(db_url))
    for task_id in ("x" * (RESULT_ID_BYTES + 1), "nul\x00id"):
        acceptance.app.send_task("acc.add_late", args=(1, 2), task_id=task_id)
    acceptance.wait_acked(worker)
    assert caller.send_task("acc.add_late", args=(2, 2)).get(timeout=RESULT_LIMIT) == 4
    assert worker.output().count("its result is not stored") == 2, worker.tail()
    with pytest.raises(ResultIdRefused, match="NUL"):
        caller.send_task("acc.add", args=(1, 2), task_id="nul\x00id")
