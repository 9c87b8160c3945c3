"""Per-queue transaction settings, and what a transactional task refuses.

Probe tasks of the test service note what their delivery's transaction is: its
isolation level on PostgreSQL and MariaDB (``isolation_level``), and on SQLite
whether it holds the write lock from its ``BEGIN`` (``sqlite_begin``).
"""

from __future__ import annotations

from functools import partial

import pytest

from tests.transactional.apps import service as service_app
from tests.transactional.conftest import Service

SERVER_LEVELS = {
    "probe": "READ COMMITTED",  # the server's (PostgreSQL) or the transport's (MariaDB)
    "probe.repeatable": "REPEATABLE READ",
    "probe.serializable": "SERIALIZABLE",
}
EXPECTED = {
    "postgresql": SERVER_LEVELS,
    "mysql": SERVER_LEVELS,
    "sqlite": {
        "probe": "write lock held",  # IMMEDIATE unless a queue says otherwise
        "probe.immediate": "write lock held",
        "probe.deferred": "write lock free",  # taken at the first write
    },
}


def test_each_queue_runs_its_transactional_tasks_as_configured(service: Service,
                                                               order_id: str) -> None:
    seen = {}
    for queue in EXPECTED[service.kind]:  # one at a time: a probe must not see another's lock
        key = f"{order_id}-{queue}"
        sent = service_app.observe.apply_async((key,), queue=queue)
        seen[queue] = service.wait(partial(service.note, key), f"the probe on {queue}")
        service.wait_drained()
        failure = service.failure(sent.id)
        if queue == "probe.deferred" and failure is not None:
            # a write committed between its first read and its first write (a lease
            # extension, say): SQLite refuses the upgrade; docs/exactly-once.rst warns
            assert "database is locked" in failure["message"], failure
        else:
            assert failure is None, failure
    assert seen == EXPECTED[service.kind]


@pytest.mark.databases("postgresql", "mysql")  # SQLite refuses claim='row_lock' at start-up
def test_a_transactional_task_on_a_row_lock_queue_fails_with_transactional_task_error(
        service: Service, order_id: str) -> None:
    sent = service_app.observe.apply_async((order_id,), queue="probe.rowlock")
    failure = service.wait(lambda: service.failure(sent.id), "the task to fail")
    assert failure["type"] == "TransactionalTaskError"
    assert "row_lock" in failure["message"]
    assert service.note(order_id) is None, "the body ran"
    service.wait_drained()


def test_celery_retry_from_a_transactional_task_runs_it_again(service: Service,
                                                             order_id: str) -> None:
    service_app.retry_once.delay(order_id)

    def outcome() -> str | None:
        # The retry is in place: the first delivery's row is updated, never deleted, so the
        # row stays in the queue until the run that does not retry completes it, and that
        # run's note is written before its commit. Hence the queues are read first and
        # the marker files after: no note once the queues were seen drained means no run
        # completed the row. (The other way round, a look at the files, then the retry run
        # and committed during the queues' reads, read as a loss: CI saw it.)
        drained = service.drained()
        if service.note(order_id) is not None:
            return "ran again"
        runs = len(service.runs_of("probe.retry_once", order_id))
        if drained and runs:
            return f"lost: {runs} run(s), no note, every queue drained"
        return None

    assert service.wait(outcome, "the retry or its loss") == "ran again"


@pytest.mark.databases("postgresql", "mysql")
@pytest.mark.pools("threads")
def test_a_long_transaction_does_not_stop_the_leases_of_other_rows(service: Service,
                                                                   order_id: str) -> None:
    """A transactional task holds its row locked; the rows held beside it keep their lease."""
    holding, napping = f"{order_id}-hold", f"{order_id}-nap"
    service_app.hold.apply_async((holding,), queue="probe")
    service.wait(lambda: service.note(holding), "the transaction to be open")
    # past its lease: the keeper must have extended it meanwhile
    service_app.nap.apply_async((napping, 1.5 * service_app.SHORT_LEASE), queue="probe.short")
    service.wait(lambda: service.note(napping), "the nap")
    (service.runs / f"{holding}.release").touch()
    service.wait_drained()
    assert len(service.runs_of("probe.nap", napping)) == 1
