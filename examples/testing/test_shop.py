"""The shop's tests: a real inbox, no sleeping for countdowns or leases."""

from __future__ import annotations

import shop


# test-clock-start
def test_a_reminder_due_in_an_hour_runs_once_the_clock_reaches_it(
        sqlinbox_drain, sqlinbox_clock):
    shop.remind.apply_async((5,), countdown=3600)
    assert sqlinbox_drain() == []  # not due yet

    sqlinbox_clock.advance(3600)
    (ran,) = sqlinbox_drain()
    assert (ran.task, ran.args, ran.state, ran.result) == (
        "shop.remind", (5,), "SUCCESS", "reminded 5")
# test-clock-end


# test-retry-start
def test_a_retry_a_minute_later_runs_once_the_clock_has_moved_a_minute(
        sqlinbox_drain, sqlinbox_clock):
    shop.notify_courier.delay(8)
    assert [ran.state for ran in sqlinbox_drain()] == ["RETRY"]

    sqlinbox_clock.advance(60)
    assert [ran.result for ran in sqlinbox_drain()] == ["courier notified of order 8"]
# test-retry-end


# test-lease-start
def test_a_task_whose_worker_died_runs_again_once_its_lease_expires(
        sqlinbox, sqlinbox_drain, sqlinbox_clock):
    shop.charge.delay(7)
    assert sqlinbox.crash() == 1  # a worker took it, then died holding its lease
    assert sqlinbox_drain() == []

    sqlinbox_clock.advance(31)  # past the 30 s visibility_timeout
    assert [ran.result for ran in sqlinbox_drain()] == ["charged 7"]
# test-lease-end


# test-dead-letters-start
def test_a_message_given_back_every_time_is_parked_after_three_deliveries(
        sqlinbox_drain, sqlinbox_dead_letters):
    shop.flaky_import.delay(9)
    assert [ran.state for ran in sqlinbox_drain()] == ["REJECTED"] * 3

    (parked,) = sqlinbox_dead_letters()
    assert (parked.task, parked.args) == ("shop.flaky_import", (9,))
    assert "max_attempts" in parked.reason
# test-dead-letters-end


# test-outbox-start
def test_a_send_the_broker_lost_goes_out_again_after_the_grace_period(
        sqlinbox_app, sqlinbox_outbox, sqlinbox_drain, sqlinbox_clock):
    shop.ship.delay(3)
    with sqlinbox_app.connection_for_write() as conn:
        conn.default_channel.queue_purge("celery")  # the message is lost
    assert sqlinbox_outbox.republish().sent == 0  # within its grace period

    sqlinbox_clock.advance(61)
    assert sqlinbox_outbox.republish().sent == 1
    assert [ran.result for ran in sqlinbox_drain()] == ["shipped 3"]
    assert sqlinbox_outbox.status().unprocessed == 0
# test-outbox-end


# test-worker-start
def test_the_worker_ships_an_order(sqlinbox_worker):
    shop.shipped.clear()
    shop.ship.delay(4)
    assert shop.shipped.wait(timeout=30)
# test-worker-end


# test-worker-process-start
def test_a_worker_process_ships_an_order(sqlinbox, sqlinbox_worker_process, sqlinbox_outbox):
    shop.ship.delay(6)
    # the record of the send is marked processed once the worker has run it
    sqlinbox.wait_for(lambda: sqlinbox_outbox.status().processed == 1)
# test-worker-process-end
