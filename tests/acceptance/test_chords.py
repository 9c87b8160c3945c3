"""Chords counted in SQL, by real workers: each header task is counted in the transaction
of its result, and the one completing the count publishes the body in it (no
``celery.chord_unlock`` task); a failed header task, a counter row that is gone or a
header result not stored reach the body's error callbacks as a ChordError; a worker
killed mid-chord still runs the body once."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery, chord
from celery.exceptions import ChordError
from celery.signals import before_task_publish
from sqlalchemy import text
from sqlalchemy.engine import Engine

from tests.acceptance.conftest import RESULT_LIMIT, Acceptance, results_conf
from tests.processes import wait_until

LEASE = 2
UNLOCK = "celery.chord_unlock"


@pytest.fixture
def published() -> Iterator[list[str]]:
    """The names of the tasks this process publishes while the test runs."""
    names: list[str] = []

    def seen(sender: Any = None, headers: Any = None, **_: Any) -> None:
        names.append(str((headers or {}).get("task") or sender))

    before_task_publish.connect(seen, weak=False)
    yield names
    before_task_publish.disconnect(seen)


def chord_rows(acceptance: Acceptance, engine: Engine) -> int:
    table = engine.dialect.identifier_preparer.quote(acceptance.table_prefix + "chords")
    with engine.connect() as conn:
        return int(conn.execute(text(f"SELECT COUNT(*) FROM {table}")).scalar_one())


def test_a_chord_of_50_runs_its_body_once_with_every_result_in_order(
        acceptance: Acceptance, caller: Celery, db_url: str, engine: Engine,
        published: list[str]) -> None:
    worker = acceptance.worker("prefork", 4, **results_conf(db_url))
    header = [caller.signature("acc.add_late", args=(n, 1)) for n in range(50)]
    body = chord(header)(caller.signature("acc.collect"))
    assert body.get(timeout=RESULT_LIMIT) == [n + 1 for n in range(50)]
    assert worker.stop() == 0, worker.tail()
    assert acceptance.runs.starts()["body"] == 1
    assert UNLOCK not in published and UNLOCK not in worker.output()
    assert published.count("acc.add_late") == 50
    assert chord_rows(acceptance, engine) == 0


def test_a_failed_header_task_a_missing_counter_row_or_result_fail_the_body(
        acceptance: Acceptance, caller: Celery, db_url: str, engine: Engine) -> None:
    """Three chords sent before the worker starts, their header tasks then run one at a
    time: one whose counter row is deleted (its first header task fails the body, its
    second finds it failed); one with a failing header task; one with a header task
    that ignores its result. Each body is stored as failed with a ChordError, its error
    callback runs once, the body never."""
    def errback_chord(*header: Any) -> Any:
        return chord(list(header))(caller.signature("acc.collect").on_error(
            caller.signature("acc.errback")))

    table = engine.dialect.identifier_preparer.quote(acceptance.table_prefix + "chords")
    gone = errback_chord(*(caller.signature("acc.add_late", args=(n, n)) for n in range(2)))
    with engine.begin() as conn:
        assert conn.execute(text(f"DELETE FROM {table}")).rowcount == 1
    failed = errback_chord(caller.signature("acc.add_late", args=(1, 1)),
                           caller.signature("acc.fail_late", args=("card declined",)),
                           caller.signature("acc.add_late", args=(2, 2)))
    unstored = errback_chord(caller.signature("acc.add_late", args=(1, 1)),
                             caller.signature("acc.add_late", args=(2, 2), ignore_result=True))
    worker = acceptance.worker("prefork", 1, **results_conf(db_url))
    with pytest.raises(ChordError, match=r"its counter row is missing from \S+chords"):
        gone.get(timeout=RESULT_LIMIT, follow_parents=False)
    with pytest.raises(ChordError, match=r"Dependency \S+ raised ValueError\('card declined'"):
        failed.get(timeout=RESULT_LIMIT, follow_parents=False)
    with pytest.raises(ChordError, match=r"Dependency \S+ has no result stored"):
        unstored.get(timeout=RESULT_LIMIT, follow_parents=False)
    wait_until(lambda: acceptance.rows() == 0, 30, "the header tasks and callbacks to run",
               alive=[worker])
    assert worker.stop() == 0, worker.tail()
    assert acceptance.runs.starts()["errback"] == 3
    assert acceptance.runs.starts()["body"] == 0
    assert chord_rows(acceptance, engine) == 0


def test_get_on_the_body_raises_the_failed_header_tasks_own_error(
        acceptance: Acceptance, caller: Celery, db_url: str) -> None:
    """``get()`` follows the body's parents (its default), as with Celery's Redis backend:
    the header task that failed raises its own error, whatever round of the wait found
    the body's ChordError."""
    body = chord([caller.signature("acc.add_late", args=(1, 1)),
                  caller.signature("acc.fail_late", args=("card declined",))])(
        caller.signature("acc.collect"))
    worker = acceptance.worker("prefork", 1, **results_conf(db_url))
    with pytest.raises(ValueError, match="card declined"):
        body.get(timeout=RESULT_LIMIT)
    assert worker.stop() == 0, worker.tail()
    assert acceptance.runs.starts()["body"] == 0


@pytest.mark.slow
def test_a_worker_killed_mid_chord_leaves_the_body_run_once_with_every_result(
        acceptance: Acceptance, caller: Celery, db_url: str) -> None:
    """Header tasks take 0.2 s each on four processes; the worker is killed after 8
    started, the rows it held come back after the lease. Each value the body gets is
    the token of its task's last run."""
    acceptance.configure(visibility_timeout=LEASE)
    keys = [f"h{n:02d}" for n in range(20)]
    header = [caller.signature("acc.run_late", args=(key, 0.2)) for key in keys]
    body = chord(header)(caller.signature("acc.collect"))
    first = acceptance.worker("prefork", 4, name="first", **results_conf(db_url))
    wait_until(lambda: len(acceptance.runs.records("h*")) >= 8, 30, "8 header runs",
               alive=[first])
    first.kill()
    last = acceptance.worker("prefork", 4, name="last", **results_conf(db_url))
    tokens = body.get(timeout=RESULT_LIMIT)
    assert last.stop() == 0, last.tail()
    assert tokens == [acceptance.runs.records(key)[-1]["token"] for key in keys]
    assert acceptance.runs.starts()["body"] == 1
    assert len(acceptance.runs.records("h*")) > len(keys), "no kill landed mid-run"


#: far below the 30 s SQLite busy timeout that a body's chord row written beside the
#: counting transaction waited for (ten times over, retried as a busy database)
NESTED_LIMIT = 20.0


@pytest.mark.parametrize("task", ["acc.add_late", "acc.add"])
def test_a_chord_whose_body_is_a_chord_runs_without_waiting_on_its_own_lock(
        acceptance: Acceptance, caller: Celery, db_url: str, engine: Engine,
        task: str) -> None:
    """A chord whose body is a chord (Celery's ``group | group | task``): the first's
    last header task counts it and publishes the body, whose counter row is written in
    that counting transaction (with the result and ack for a late ack, in one of its own
    otherwise). In a transaction of its own, it waited on SQLite for the write lock the
    counting transaction holds."""
    inner = chord([caller.signature("acc.total"), caller.signature("acc.total")],
                  caller.signature("acc.collect"))
    canvas = chord([caller.signature(task, args=(n, n)) for n in (1, 2)], inner)
    worker = acceptance.worker("prefork", 2, **results_conf(db_url))
    assert canvas.delay().get(timeout=NESTED_LIMIT) == [6, 6]
    assert worker.stop() == 0, worker.tail()
    assert acceptance.runs.starts()["body"] == 1
    assert chord_rows(acceptance, engine) == 0


def test_header_tasks_add_tasks_and_a_chord_to_their_chord_the_body_gets_their_results(
        acceptance: Acceptance, caller: Celery, db_url: str, engine: Engine) -> None:
    """``Task.add_to_chord`` from header tasks (Celery's ``test_add_to_chord`` and
    ``test_add_chord_to_chord``): each addition grows the chord's count by one in its
    counter row, and the body receives the header's values, then the added ones."""
    header = [caller.signature("acc.adds_to_chord", args=([1, 2, 3], 4)),
              caller.signature("acc.adds_to_chord", args=([1, 2, 3], 4, True)),
              caller.signature("acc.add_late", args=(10, 0))]
    body = chord(header)(caller.signature("acc.collect"))
    worker = acceptance.worker("prefork", 2, **results_conf(db_url))
    values = body.get(timeout=RESULT_LIMIT)
    assert values[:3] == [0, 0, 10] and sorted(values[3:]) == [5, 6, 7, 18]
    assert worker.stop() == 0, worker.tail()
    assert acceptance.runs.starts()["body"] == 1
    assert chord_rows(acceptance, engine) == 0


def test_a_header_given_as_a_generator_is_published_as_it_comes(
        acceptance: Acceptance, caller: Celery, db_url: str, engine: Engine) -> None:
    """Celery publishes a generator's header tasks as they come (``test_generator``): the
    generator yields its last task only once the first has run. The body gets the values
    by group index, a task added from the header (``add_to_chord``) beside its adder's."""
    worker = acceptance.worker("prefork", 2, **results_conf(db_url))
    first = caller.signature("acc.add_late", args=(0, 1))
    first_id = first.freeze().id

    def header() -> Iterator[Any]:
        yield first
        yield from (caller.signature("acc.add_late", args=(n, 1)) for n in (1, 2))
        wait_until(lambda: caller.AsyncResult(first_id).ready(), RESULT_LIMIT,
                   "the first header task, before the header's end", alive=[worker])
        yield caller.signature("acc.adds_to_chord", args=([1, 2], 4))

    values = chord(header())(caller.signature("acc.collect")).get(timeout=RESULT_LIMIT)
    assert values[:3] == [1, 2, 3] and sorted(values[3:]) == [0, 5, 6]
    assert worker.stop() == 0, worker.tail()
    assert acceptance.runs.starts()["body"] == 1
    assert chord_rows(acceptance, engine) == 0


def test_adding_to_a_chord_whose_counter_row_is_gone_fails_the_adding_task_alone(
        acceptance: Acceptance, caller: Celery, db_url: str, engine: Engine) -> None:
    """``add_to_chord`` from the header tasks of a chord whose counter row was deleted
    (a task and a chord added): each adding task fails with a ChordError naming the
    missing row, before it sends anything; the body fails as with any missing row (its
    error callback once, the body never), and the worker goes on: a chord applied after
    it grows and runs its body."""
    gone = chord([caller.signature("acc.adds_to_chord", args=([1], 4)),
                  caller.signature("acc.adds_to_chord", args=([1, 2], 4, True))])(
        caller.signature("acc.collect").on_error(caller.signature("acc.errback")))
    adders = [result.id for result in gone.parent.results]
    table = engine.dialect.identifier_preparer.quote(acceptance.table_prefix + "chords")
    with engine.begin() as conn:
        assert conn.execute(text(f"DELETE FROM {table}")).rowcount == 1
    worker = acceptance.worker("prefork", 2, **results_conf(db_url))
    for adder in adders:
        with pytest.raises(ChordError, match=r"its counter row is missing from \S+chords "
                                             r"\(done, expired or deleted\): no task can"):
            caller.AsyncResult(adder).get(timeout=RESULT_LIMIT)
    with pytest.raises(ChordError, match=r"its counter row is missing from \S+chords"):
        gone.get(timeout=RESULT_LIMIT, follow_parents=False)

    grown = chord([caller.signature("acc.adds_to_chord", args=([1], 4))])(
        caller.signature("acc.collect"))
    assert grown.get(timeout=RESULT_LIMIT) == [0, 5]
    wait_until(lambda: acceptance.rows() == 0, 30, "the callbacks to run", alive=[worker])
    assert worker.stop() == 0, worker.tail()
    assert acceptance.runs.starts()["errback"] == 1
    assert acceptance.runs.starts()["body"] == 1  # the grown chord's
    results = engine.dialect.identifier_preparer.quote(acceptance.table_prefix + "task_results")
    with engine.connect() as conn:
        added = conn.execute(text(f"SELECT COUNT(*) FROM {results} WHERE task_name = :name"),
                             {"name": "acc.add_late"}).scalar_one()
    assert added == 1, "a task added to the chord whose row was gone was sent"
    assert chord_rows(acceptance, engine) == 0
