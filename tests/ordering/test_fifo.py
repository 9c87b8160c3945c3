"""FIFO groups: one row of a group in work at a time, everywhere, in id order.

The head of a group (its first unfinished row) is the only row of the group a
claim can take; requeue and retry in place keep the head where it is; a head
past ``max_attempts`` moves to the dead-letter queue and the group goes on.
"""

from __future__ import annotations

import random
import time

import pytest

from tests.integration.support import death, get, get_within, rows, settled
from tests.ordering.apps.common import any_overlap_across, check_serial_in_order
from tests.ordering.conftest import Ordering, publish, wait_for_count
from tests.processes import wait_until

GROUPS, ROWS = 20, 100


@pytest.mark.slow
def test_fifo_groups_hold_order_across_four_workers(ordering: Ordering) -> None:
    """4 ``celery worker`` processes, 20 groups, random requeues and in-place retries."""
    app = ordering.app("jobs", "fifo")
    turns = [g for g in range(GROUPS) for _ in range(ROWS)]
    random.shuffle(turns)  # the groups' rows interleave at random
    sent = dict.fromkeys(range(GROUPS), 0)
    with app.producer_or_acquire() as producer:
        for g in turns:
            app.send_task("ord.step", args=(f"g{g}", sent[g], 0.1, 0.1),
                          headers={"group_key": f"g{g}"}, producer=producer)
            sent[g] += 1
    workers = ordering.workers([f"w{n}" for n in range(4)], "jobs", "fifo", pool="threads",
                               concurrency=4)
    wait_for_count(ordering.log.done, GROUPS * ROWS, "rows done", workers, limit=240)

    entries = ordering.log.entries()
    check_serial_in_order(entries, {f"g{g}": ROWS for g in range(GROUPS)})
    outcomes = {e.outcome for e in entries}
    assert {"requeue", "retry"} <= outcomes, "the random failures never happened"
    assert any_overlap_across(entries), "groups never ran side by side"
    assert len({e.pid for e in entries}) == 4, "every worker should have taken rows"


LONG, SHORT, OTHERS = 120, 30, 4


@pytest.mark.slow
def test_groups_behind_a_long_group_run_while_it_drains_across_three_workers(
        ordering: Ordering) -> None:
    """A group of LONG rows queued before the others fills every claim's window with rows
    waiting behind its head in work: the other groups' heads are found group by group
    (the claim's second statement), by 3 ``celery worker`` processes racing for them."""
    app = ordering.app("jobs", "fifo")
    turns = ["g0"] * LONG + [f"g{g}" for _ in range(SHORT) for g in range(1, OTHERS + 1)]
    sent: dict[str, int] = {}
    with app.producer_or_acquire() as producer:
        for grp in turns:
            app.send_task("ord.step", args=(grp, sent.setdefault(grp, 0), 0.1, 0.1),
                          headers={"group_key": grp}, producer=producer)
            sent[grp] += 1
    workers = ordering.workers([f"w{n}" for n in range(3)], "jobs", "fifo", pool="threads",
                               concurrency=4)
    wait_for_count(ordering.log.done, len(turns), "rows done", workers, limit=240)

    entries = ordering.log.entries()
    check_serial_in_order(entries, sent)
    last_long = max(e.started for e in entries if e.grp == "g0")
    assert any(e.started < last_long for e in entries if e.grp != "g0"), (
        "the other groups waited for the long group to drain")


#: every claim form on every database that has it
FORMS = [("postgresql", "lease"), ("mysql", "lease"), ("sqlite", "lease"),
         ("postgresql", "row_lock"), ("mysql", "row_lock"),
         ("postgresql", "advisory"), ("mysql", "advisory")]
#: the holder's lease (seconds; short beside the default 30 s): its keeper extends it every
#: third of it, so an extension may come up to two seconds late (a loaded machine's stalled
#: process or slow commit) before it lapses
SHORT_LEASE = 3


@pytest.mark.slow
@pytest.mark.parametrize(("database", "claim"), FORMS)
def test_row_behind_a_head_held_elsewhere_waits_until_the_head_is_given_up(
        ordering: Ordering, claim: str) -> None:
    options = {"claim": claim, "visibility_timeout": SHORT_LEASE}
    conn = ordering.connect("jobs", "fifo", **options)
    publish(conn, "jobs", [({"grp": "g0", "seq": 0}, {"group_key": "g0"}),
                           ({"grp": "g0", "seq": 1}, {"group_key": "g0"}),
                           ({"grp": "g1", "seq": 0}, {"group_key": "g1"})])
    holder = ordering.consumer("holder", "jobs", "fifo", mode="hold", options=options)
    wait_until(ordering.marker("holder", "held").exists, 20, "the holder to take g0's head",
               alive=[holder])

    other = get_within(conn, "jobs")
    assert other.payload == {"grp": "g1", "seq": 0}, "another group should run meanwhile"
    other.ack()
    # g0's second row waits: on the lease form past the holder's lease, which its keeper
    # extends meanwhile; the other forms hold a lock, not a lease, and show it in any window
    watch_until = time.monotonic() + (1.5 * SHORT_LEASE if claim == "lease" else 3)
    while time.monotonic() < watch_until:
        assert get(conn, "jobs") is None, "a row was delivered while its group's head is held"
        time.sleep(0.1)

    holder.kill()
    head = get_within(conn, "jobs", timeout=SHORT_LEASE + 10)
    assert head.payload == {"grp": "g0", "seq": 0}
    assert head.delivery_info["redelivered"] is True
    assert get(conn, "jobs") is None, "the row behind the head overtook it"
    head.ack()
    settled(conn)
    assert get_within(conn, "jobs").payload == {"grp": "g0", "seq": 1}


def test_poison_head_is_parked_after_max_attempts_and_the_group_goes_on(
        ordering: Ordering) -> None:
    conn = ordering.connect("jobs", "fifo", max_attempts=3, dead_letter_queue="jobs.parked")
    publish(conn, "jobs", [({"grp": "g0", "seq": 0}, {"group_key": "g0"}),
                           ({"grp": "g0", "seq": 1}, {"group_key": "g0"})])
    for attempt in (1, 2, 3):
        message = get_within(conn, "jobs")
        assert message.payload == {"grp": "g0", "seq": 0}, f"delivery {attempt}"
        message.requeue()
        settled(conn)

    after = get_within(conn, "jobs")
    assert after.payload == {"grp": "g0", "seq": 1}
    after.ack()
    parked = get_within(conn, "jobs.parked")
    assert parked.payload == {"grp": "g0", "seq": 0}
    assert death(parked)["attempts"] == 4 and death(parked)["queue"] == "jobs"
    parked.ack()


def test_a_head_that_expired_in_the_queue_is_revoked_and_the_group_goes_on(
        ordering: Ordering) -> None:
    """A Celery task's ``expires`` passes while it heads its group: the worker records it
    revoked and the rows behind it run, in order."""
    app = ordering.app("jobs", "fifo")
    with app.producer_or_acquire() as producer:
        for seq in range(3):
            app.send_task("ord.step", args=("g0", seq), headers={"group_key": "g0"},
                          expires=0.5 if seq == 0 else None, producer=producer)
    time.sleep(1.0)  # the head expires before any worker runs
    workers = ordering.workers(["w1"], "jobs", "fifo")
    wait_for_count(ordering.log.done, 2, "the rows behind the expired head", workers)
    assert [entry.seq for entry in ordering.log.entries()] == [1, 2]
    wait_until(lambda: not rows(ordering.engine, f"{ordering.prefix}fifo_jobs"), 10,
               "the revoked head's row to go", alive=workers)
