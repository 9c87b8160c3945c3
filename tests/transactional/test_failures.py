"""Failures inside a transactional task: what fails, what runs again, what is dropped.

A constraint the body breaks other than a unique key is an ordinary failure (the
task's retry policy, then a failure that shows); a unique key broken is the same
work done twice, dropped; a connection lost mid-task commits nothing and runs the
task again. Probe tasks of the test service write one ``probe_effects`` row per key.
"""

from __future__ import annotations

from functools import partial

import pytest
from sqlalchemy import create_engine, text

from tests.transactional.apps import service as service_app
from tests.transactional.conftest import Service


@pytest.mark.pools("prefork")
@pytest.mark.parametrize("violation", [
    "not_null", "check",
    # SQLite checks foreign keys only with PRAGMA foreign_keys=ON
    pytest.param("foreign_key", marks=pytest.mark.databases("postgresql", "mysql"))])
def test_a_constraint_other_than_a_unique_key_fails_the_task(service: Service, order_id: str,
                                                             violation: str) -> None:
    sent = service_app.effect.apply_async((order_id, violation), queue="probe")
    failure = service.wait(lambda: service.failure(sent.id), "the task to fail")
    assert failure["type"] in ("IntegrityError", "OperationalError"), failure  # MariaDB: CHECK
    service.wait_drained()
    assert len(service.runs_of("probe.effect", order_id)) == 1
    assert service.effects(order_id) == 0


@pytest.mark.pools("prefork")
def test_a_constraint_violation_follows_the_retry_policy_then_fails(service: Service,
                                                                    order_id: str) -> None:
    sent = service_app.effect_retried.apply_async((order_id, "not_null"), queue="probe")
    failure = service.wait(lambda: service.failure(sent.id), "the task to fail")
    assert failure["type"] == "IntegrityError", failure
    service.wait_drained()
    assert len(service.runs_of("probe.effect_retried", order_id)) == 2  # max_retries=1
    assert service.effects(order_id) == 0


@pytest.mark.pools("prefork")
def test_a_unique_key_violation_drops_the_second_copy(service: Service, order_id: str) -> None:
    first = service_app.effect.apply_async((order_id,), queue="probe")
    service.wait(lambda: service.effects(order_id), "the first copy's effect")
    second = service_app.effect.apply_async((order_id,), queue="probe")
    service.wait(lambda: len(service.runs_of("probe.effect", order_id)) == 2, "the second copy")
    service.wait_drained()
    assert service.effects(order_id) == 1
    assert service.failure(first.id) is None and service.failure(second.id) is None
    assert service.worker is not None
    assert f"task probe.effect[{second.id}] violated a unique key" in service.worker.output()


KILL = {"postgresql": "SELECT pg_terminate_backend({})", "mysql": "KILL {}"}


@pytest.mark.databases("postgresql", "mysql")  # SQLite has no connection to lose
@pytest.mark.pools("prefork", "threads")
def test_a_connection_lost_mid_task_runs_the_task_again_and_commits_once(
        service: Service, order_id: str) -> None:
    sent = service_app.effect_held.apply_async((order_id,), queue="probe")
    backend = service.wait(partial(service.note, order_id), "the task's connection id")
    killer = create_engine(service.db_url)
    try:
        with killer.begin() as conn:
            conn.execute(text(KILL[service.kind].format(int(backend))))
    finally:
        killer.dispose()
    (service.runs / f"{order_id}.release").touch()
    service.wait(lambda: len(service.runs_of("probe.effect_held", order_id)) == 2,
                 "the task to run again")
    service.wait_drained()
    assert service.effects(order_id) == 1
    assert service.failure(sent.id) is None
