"""A transactional task's ``outbox_id`` header, with the outbox on the same database.

The task marks its record processed in its own transaction, so a second delivery of
a processed record is skipped. A record the outbox does not hold -- another
service's outbox, a record already pruned -- is no duplicate: the task runs.
"""

from __future__ import annotations

import uuid

import pytest

from celery_ext.outbox import HEADER, Message
from tests.transactional.apps import service as service_app
from tests.transactional.conftest import Service


def missing_record() -> str | int:
    """An id of the outbox's kind (generated number, or UUID) that no record has."""
    return 2**40 + uuid.uuid4().int % 2**20 if service_app.OUTBOX.spec.generated_id \
        else uuid.uuid4().hex


def outbox_record(service: Service, processed: bool) -> str | int:
    """A record of the service's outbox, marked processed when asked."""
    outbox = service_app.OUTBOX
    record_id = outbox.record(Message(b"{}", "", "probe", {}, {}), None, "probe.effect")
    if processed:
        with service.engine.begin() as conn:
            assert outbox.mark_processed(conn, record_id)
    return record_id


@pytest.mark.pools("prefork")
@pytest.mark.parametrize(("record", "effects"),
                         [("missing", 1), ("unprocessed", 1), ("processed", 0)])
def test_only_a_processed_outbox_record_skips_the_task(service: Service, order_id: str,
                                                       record: str, effects: int) -> None:
    record_id = (missing_record() if record == "missing"
                 else outbox_record(service, processed=record == "processed"))
    sent = service_app.effect.apply_async((order_id,), queue="probe",
                                          headers={HEADER: record_id})
    service.wait(lambda: service.runs_of("probe.effect", order_id), "the delivery")
    service.wait_drained()
    assert service.effects(order_id) == effects
    assert service.failure(sent.id) is None
    if record != "missing":
        assert service_app.OUTBOX.is_processed(record_id)
