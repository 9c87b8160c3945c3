"""The refund example's promises under real workers, on every database and pool.

Each refund writes its ``refunds`` row, queues its receipt on the ``mail`` queue
through the delivery's transaction, and calls the card processor with the order
as idempotency key. Whatever happens -- a held transaction, a timed-out card
call, a second copy of the message, ``kill -9`` of the pool process -- the
database ends with one row, one receipt job that ran once, and the processor
with one refund.
"""

from __future__ import annotations

import os
import signal

import pytest

from tests.transactional.apps.service import refunds_app
from tests.transactional.conftest import REFUND, SETTLE_LIMIT, Service


def test_refund_commits_its_row_and_receipt_job_together(service: Service,
                                                         order_id: str) -> None:
    service.card.hold_once(order_id)
    refunds_app.refund.delay(order_id, 1250)
    # the task has written its row and the receipt job and waits in the card call
    assert service.card.wait_held(order_id, SETTLE_LIMIT), "the card call never came"
    assert service.refund_rows(order_id) == []
    assert service.queue_rows("mail") == 0, "the receipt job is visible before the commit"
    service.card.release(order_id)
    service.check_refunded_once(order_id)
    assert service.card.calls[order_id] == 1


def test_timed_out_card_call_retries_without_a_second_row_or_receipt(
        service: Service, order_id: str) -> None:
    service.card.time_out_once(order_id)
    refunds_app.refund.delay(order_id, 990)
    service.check_refunded_once(order_id)
    # the first delivery's row and receipt job rolled back; the retry asked again with
    # the same key and the processor answered with its first refund
    assert len(service.runs_of(REFUND, order_id)) == 2
    assert service.card.calls[order_id] == 2


def test_the_same_refund_published_twice_is_dropped_the_second_time(
        service: Service, order_id: str) -> None:
    refunds_app.refund.delay(order_id, 500)
    refunds_app.refund.delay(order_id, 500)
    service.wait(lambda: len(service.runs_of(REFUND, order_id)) == 2, "both deliveries")
    service.check_refunded_once(order_id)
    assert service.card.calls[order_id] == 1
    assert service.worker is not None
    assert "violated a unique key" in service.worker.output()


@pytest.mark.pools("prefork")
def test_kill_9_of_the_pool_process_before_commit_leaves_nothing_then_one_refund(
        service: Service, order_id: str) -> None:
    service.card.hold_once(order_id)
    refunds_app.refund.delay(order_id, 7000)
    assert service.card.wait_held(order_id, SETTLE_LIMIT), "the card call never came"
    (first,) = service.runs_of(REFUND, order_id)
    assert service.worker is not None and first["pid"] != service.worker.popen.pid
    assert service.refund_rows(order_id) == [], "written, not committed: invisible"
    os.kill(first["pid"], signal.SIGKILL)
    try:
        service.check_refunded_once(order_id)
    finally:
        service.card.release(order_id)  # the dead call's handler
    pids = {run["pid"] for run in service.runs_of(REFUND, order_id)}
    assert len(pids) == 2, "redelivered to the pool's new process"
    assert service.worker.popen.poll() is None, "the worker's main process lives on"
