"""Checks that every time a statement reads follows a test's pinned clock."""

from __future__ import annotations

import time

from ... import clock as clocks
from .suite import LONG, Suite, expect, ids_of


def check_clock(suite: Suite) -> None:
    """A pinned clock (a test's): publishes, ready times and leases all follow it, so no
    statement reads the database's time except through ``now``."""
    spec = suite.table("clock", lambda b: b.available_at())
    clock = clocks.install(suite.engine.url)
    try:
        clocked = type(suite.dialect)(suite.engine)
        start = clock.pin(time.time() + 10 * LONG)
        (due_by_clock,) = suite.publish(spec, {"eta": start - 1})
        with suite.engine.begin() as conn:
            clocked.publish(conn, spec, [clocked.insert_params(b"now", None, 0, None)])
        expect(suite.claim(spec) == [], "rows due only by the pinned clock were claimed by "
               "the database's")
        with suite.engine.begin() as conn:
            got = clocked.claim(conn, spec, 10, LONG)
        expect(len(got) == 2 and due_by_clock in ids_of(got), f"a claim at the pinned time "
               f"got ids {ids_of(got)}: both rows are due then (one published at that time)")
        clock.advance(LONG + 1)
        with suite.engine.begin() as conn:
            again = clocked.claim(conn, spec, 10, LONG)
        expect([row.attempt for row in again] == [2, 2], "once the clock passed their lease "
               f"the rows came back with attempts {[row.attempt for row in again]}, not [2, 2]")
    finally:
        clocks.uninstall(suite.engine.url)
