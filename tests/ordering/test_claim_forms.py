"""Row-lock and advisory claims: what each promises, with real processes.

* Row lock: the claiming transaction stays open while the row is in work, so a
  consumer killed with ``kill -9`` frees its row at once -- no lease to wait for.
* Advisory: rows of one partition key are never in work at the same time across
  processes, while different keys run side by side.
* SQLite has neither: asking for them fails when the queue is declared.
"""

from __future__ import annotations

import time

import pytest

from kombu_sqlinbox import ConfigurationError
from tests.integration.support import get, get_within
from tests.ordering.apps.common import Entry, any_overlap_across, by_group, overlaps
from tests.ordering.conftest import Ordering, interleaved, publish, wait_for_count
from tests.processes import wait_until

SERVERS = ["postgresql", "mysql"]
#: far longer than the test waits: a row coming back in time came back without it
LONG_LEASE = 60


@pytest.mark.parametrize("database", ["sqlite"])
@pytest.mark.parametrize("claim", ["row_lock", "advisory"])
def test_lock_claims_refused_on_sqlite(ordering: Ordering, claim: str) -> None:
    conn = ordering.connect("jobs", "plain", claim=claim)
    with pytest.raises(ConfigurationError, match=rf"queue 'jobs': claim='{claim}' needs row or "
                       r"advisory locks, which sqlite does not have; use claim='lease'"):
        conn.default_channel.queue_declare("jobs")


@pytest.mark.slow
@pytest.mark.parametrize("database", SERVERS)
def test_row_lock_frees_the_row_of_a_killed_consumer_at_once(ordering: Ordering) -> None:
    options = {"claim": "row_lock", "visibility_timeout": LONG_LEASE}
    conn = ordering.connect("jobs", "plain", **options)
    publish(conn, "jobs", [({"grp": "a", "seq": 0}, {})])
    holder = ordering.consumer("holder", "jobs", "plain", mode="hold", options=options)
    wait_until(ordering.marker("holder", "held").exists, 20, "the holder to take the row",
               alive=[holder])
    assert get(conn, "jobs") is None, "a row in work under a row lock was delivered twice"

    holder.kill()
    killed = time.monotonic()
    message = get_within(conn, "jobs", timeout=10)
    waited = time.monotonic() - killed
    assert message.payload == {"grp": "a", "seq": 0}
    assert message.delivery_info["redelivered"] is True
    assert waited < 5, f"the row came back {waited:.1f} s after the kill"
    message.ack()


ADVISORY_KEYS, ADVISORY_ROWS = 8, 25


def advisory_run(ordering: Ordering) -> list[Entry]:
    """Two consumer processes (three threads each) drain interleaved rows of 8 keys,
    published once both consume: the first to start would drain a backlog alone while
    the second starts."""
    options = {"claim": "advisory"}
    conn = ordering.connect("jobs", "keyed", **options)
    conn.default_channel.queue_declare("jobs")
    consumers = [
        ordering.consumer(f"c{n}", "jobs", "keyed", options=options, concurrency=3,
                          prefetch=3, work=[0.005, 0.02], seed=n)
        for n in range(2)]
    publish(conn, "jobs", interleaved(ADVISORY_KEYS, ADVISORY_ROWS, "partition_key"))
    wait_for_count(ordering.log.done, ADVISORY_KEYS * ADVISORY_ROWS, "rows done", consumers)
    return ordering.log.entries()


@pytest.mark.slow
@pytest.mark.parametrize("database", SERVERS)
def test_advisory_runs_one_row_per_key_at_a_time_across_processes(ordering: Ordering) -> None:
    entries = advisory_run(ordering)
    for key, mine in by_group(entries).items():
        assert not overlaps(mine), f"key {key}: two rows in work at once: {overlaps(mine)[0]}"
        assert sorted(e.seq for e in mine) == list(range(ADVISORY_ROWS)), f"key {key}"
    assert any_overlap_across(entries), "different keys never ran side by side"
    assert len({e.pid for e in entries}) == 2, "both processes should have taken rows"


@pytest.mark.slow
@pytest.mark.parametrize("database", SERVERS)
def test_advisory_keeps_each_keys_order_across_processes(ordering: Ordering) -> None:
    for key, mine in by_group(advisory_run(ordering)).items():
        assert [e.seq for e in mine] == list(range(ADVISORY_ROWS)), f"key {key} out of order"
