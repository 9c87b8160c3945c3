"""Checks of the operations' statements: a queue's figures, a dead letter's move."""

from __future__ import annotations

import time

from .suite import LONG, Suite, expect, ids_of


def check_operations(suite: Suite) -> None:
    """The operations' statements: queue_stats counts each row in one state, and a dead
    letter's move (stored_locked, remove, restore with its attempt) is one
    transaction."""
    dialect = suite.dialect
    spec = suite.table("operations", lambda b: b.group("grp", fifo=True).available_at())
    head, behind, ready, later = suite.publish(
        spec, {"group": "g"}, {"group": "g"}, {}, {"eta": time.time() + LONG})
    expect(ids_of(suite.claim(spec, limit=1)) == [head], "a claim did not take the head")
    with suite.engine.begin() as conn:
        stats = dict(conn.execute(dialect.queue_stats(spec)).one()._mapping)
    counts = {name: int(stats[name]) for name in (
        "ready", "delayed", "in_work", "blocked", "blocked_groups", "lapsed")}
    expected = {"ready": 1, "delayed": 1, "in_work": 1, "blocked": 1, "blocked_groups": 1,
                "lapsed": 0}
    expect(counts == expected, f"queue_stats counted {counts}, expected {expected}")
    expect(0 <= float(stats["oldest_ready_age"]) < 60,
           f"queue_stats: oldest_ready_age {stats['oldest_ready_age']}, expected a few seconds")
    expect(LONG - 60 < float(stats["lease_left"]) <= LONG,
           f"queue_stats: lease_left {stats['lease_left']}, expected about {LONG:.0f}")
    with suite.engine.begin() as conn:
        page = [row.id for row in conn.execute(dialect.stored_page(spec), {
            "after": 0, "upto": later, "limit": 10})]
        expect(page == [behind, ready, later], f"stored_page gave ids {page}, expected "
               f"those not in work {[behind, ready, later]}")
        waiting = [row.id for row in conn.execute(dialect.stored_locked(spec), {
            "ids": [later, head, ready]})]
        expect(waiting == [ready, later], f"stored_locked gave ids {waiting}, expected "
               f"those asked for not in work {[ready, later]}")
        conn.execute(dialect.remove(spec), {"ids": [ready]})
        restore = dialect.restore(spec)
        assert restore is not None  # a table of the default statement
        conn.execute(restore, dialect.insert_params(b"body", None, 0, None) | {"attempt": 7})
    with suite.engine.begin() as conn:
        ids = suite.ids(conn, spec)
        rows = conn.execute(dialect.stored_one(spec), {"id": max(ids)}).all()
    expect(ready not in ids, "remove left the row")
    expect([row.attempt for row in rows] == [7], f"restore wrote attempts "
           f"{[row.attempt for row in rows]}, expected [7]")
