"""``retry_after`` on a queue whose table has no ``available_at`` column.

Such a table cannot hide a row until later: the row is requeued in place at once
(a ``RetryAfter`` is a ``Reject(requeue=True)``, which is what any other broker
does with it), with a warning naming the queue, and is never left held.
"""

from __future__ import annotations

from functools import partial

import pytest

from tests.transactional.apps import service as service_app
from tests.transactional.conftest import Service


@pytest.mark.pools("prefork")
def test_retry_after_on_a_table_without_available_at_requeues_at_once(
        service: Service, order_id: str) -> None:
    # a delay far past the wait below: the row must come back without it
    sent = service_app.retry_later.apply_async((order_id, 3600.0), queue="probe.prompt")
    assert service.wait(partial(service.note, order_id), "the second run") == "ran again"
    service.wait_drained()
    assert service.failure(sent.id) is None
    assert service.worker is not None
    assert ("queue 'probe.prompt' has no available_at column: retry_after requeues at once"
            in service.worker.output())
