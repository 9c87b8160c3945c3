"""Checks of the queue's hot path: publish, claims, settlements under their fence,
partition keys, FIFO groups, purge and drop, and the driver's error codes."""

from __future__ import annotations

import time

from sqlalchemy import inspect, text

from .suite import LONG, CheckFailed, Suite, expect, ids_of


def check_publish(suite: Suite) -> None:
    """insert_statement (publish) and the claim's values, read by name."""
    spec = suite.table("publish", lambda b: b.headers().group("grp").partition_key("pkey"))
    payload = bytes(range(256))
    (first, second) = suite.publish(
        spec, {"payload": payload, "headers": '{"a": 1}', "group": "g", "partition_key": "k"},
        {"payload": b"", "headers": None})
    expect(suite.scalar(spec, "size") == 2, "size: two published rows are not counted as two")
    rows = {row.id: row for row in suite.claim(spec)}
    expect(set(rows) == {first, second}, f"claim returned ids {sorted(rows)}, not both rows")
    row = rows[first]
    expect(row.payload == payload, f"payload came back as {row.payload[:16]!r}..., not the "
           "bytes published (all 256 byte values)")
    expect(row.headers == '{"a": 1}', f"headers came back as {row.headers!r}")
    expect((row.group, row.partition_key) == ("g", "k"),
           f"group and partition key came back as {(row.group, row.partition_key)!r}")
    expect(rows[second].headers is None and rows[second].payload == b"",
           "an empty payload or NULL headers did not come back as published")
    expect(row.attempt == 1, f"a first claim gave attempt {row.attempt}, not 1")


def check_claim_order(suite: Suite) -> None:
    """claim: priority (higher first), then ready time, then id; due rows only; a lease
    keeps a row from the next claim."""
    spec = suite.table("order", lambda b: b.priority().available_at())
    now = time.time()
    low, high, high_later, early = suite.publish(
        spec, {"priority": 0}, {"priority": 5}, {"priority": 5}, {"eta": now - 100})
    suite.publish(spec, {"priority": 9, "eta": now + LONG})
    got = ids_of(suite.claim(spec, limit=3))
    expect(got == [high, high_later, early], f"a claim got ids {got}, expected "
           f"{[high, high_later, early]} (priority first, then ready time, then id)")
    got = ids_of(suite.claim(spec))
    expect(got == [low], f"a second claim got ids {got}, expected only {[low]}: leased rows "
           "and rows not yet due must not be claimed")


def check_lease_fencing(suite: Suite) -> None:
    """complete, release, extend: a stale attempt (an earlier claim's token) touches nothing."""
    spec = suite.table("fencing", lambda b: b)
    (row_id,) = suite.publish(spec, {})
    (first,) = suite.claim(spec)
    expect(suite.settle(spec, "release", first.attempt, [row_id]) == 1,
           "release did not give back the held row")
    (second,) = suite.claim(spec)
    expect(second.attempt == first.attempt + 1,
           f"a second claim gave attempt {second.attempt} after {first.attempt}")
    for statement in ("complete", "release", "extend"):
        touched = suite.settle(spec, statement, first.attempt, [row_id], lease=LONG)
        expect(touched == 0, f"{statement} with a stale attempt touched {touched} rows")
    expect(suite.settle(spec, "complete", second.attempt, [row_id]) == 1,
           "complete with the current attempt did not settle the row")
    expect(suite.scalar(spec, "size") == 0, "a completed row is still counted")


def check_extension(suite: Suite) -> None:
    """extend keeps a lease alive, never revives a settled one; release_uncounted gives a
    row back with its attempt not counted."""
    spec = suite.table("extend", lambda b: b)
    (row_id,) = suite.publish(spec, {})
    (held,) = suite.claim(spec, lease=-1)  # already run out
    expect(suite.settle(spec, "extend", held.attempt, [row_id], lease=LONG) == 1,
           "extend did not touch the held row")
    expect(suite.claim(spec) == [], "a row whose lease was extended was claimed again")
    suite.settle(spec, "release", held.attempt, [row_id])
    expect(suite.settle(spec, "extend", held.attempt, [row_id], lease=LONG) == 0,
           "extend leased again a row already given back")
    (again,) = suite.claim(spec)
    suite.settle(spec, "release_uncounted", again.attempt, [row_id])
    (last,) = suite.claim(spec)
    expect(last.attempt == again.attempt,
           f"release_uncounted: the next claim gave attempt {last.attempt}, not {again.attempt}")


def check_retry_delay(suite: Suite) -> None:
    """retry: a settled row comes back after its delay, not before."""
    spec = suite.table("retry", lambda b: b.available_at())
    later, soon = suite.publish(spec, {}, {})
    rows = suite.claim(spec)
    suite.settle(spec, "retry", rows[0].attempt, [later], delay=LONG)
    suite.settle(spec, "retry", rows[0].attempt, [soon], delay=0)
    got = suite.claim(spec)
    expect(ids_of(got) == [soon], f"after retries with delays of 0 and {LONG:.0f} seconds a "
           f"claim got ids {ids_of(got)}, expected only {[soon]}")
    expect(got[0].attempt == 2, f"a retried row came back with attempt {got[0].attempt}, not 2")


def check_keys(suite: Suite) -> None:
    """candidates, and the claims by ids and passing over partition keys in work."""
    spec = suite.table("keys", lambda b: b.partition_key("pkey"))
    k1, k1_next, k2, keyless = suite.publish(
        spec, {"partition_key": "k1"}, {"partition_key": "k1"}, {"partition_key": "k2"}, {})
    with suite.engine.begin() as conn:
        found = [tuple(row) for row in conn.execute(
            suite.dialect.statements(spec).candidates,
            {"limit": 10, "floor": suite.dialect.claim_floor(conn, spec)})]
    expected = [(k1, "k1"), (k2, "k2"), (keyless, None)]
    expect(found == expected, f"candidates: got {found}, expected each key's first row "
           f"{expected}")
    got = ids_of(suite.claim(spec, skip=["k1"]))
    expect(got == [k2, keyless], f"a claim passing over key k1 got ids {got}, "
           f"expected {[k2, keyless]}")
    got = ids_of(suite.claim(spec, ids=[k1, k2]))
    expect(got == [k1], f"a claim of ids {[k1, k2]} got {got}, expected {[k1]} (the other is "
           "leased)")
    expect(k1_next not in got, "a claim by ids took a row not asked for")


def check_fifo(suite: Suite) -> None:
    """FIFO groups: one row of a group in flight; complete (in place) frees the next."""
    spec = suite.table("fifo", lambda b: b.group("grp", fifo=True).processed_at())
    a, b, c = suite.publish(spec, {"group": "g1"}, {"group": "g1"}, {"group": "g2"})
    first = suite.claim(spec)
    expect(ids_of(first) == [a, c], f"FIFO heads: a claim got ids {ids_of(first)}, expected "
           f"{[a, c]} (one row per group)")
    suite.settle(spec, "complete", first[0].attempt, [a])
    expect(ids_of(suite.claim(spec)) == [b], "completing a group's head did not free the next")
    expect(suite.scalar(spec, "size") == 0, "size counts processed or leased rows")


def check_purge_and_drop(suite: Suite) -> None:
    """purge removes the waiting rows, not leased ones; drop removes the table."""
    spec = suite.table("purge", lambda b: b)
    suite.publish(spec, {}, {}, {})
    suite.claim(spec, limit=1)
    with suite.engine.begin() as conn:
        purged = conn.execute(suite.dialect.statements(spec).purge).rowcount
    expect(purged == 2, f"purge removed {purged} rows, expected the 2 not leased")
    with suite.engine.begin() as conn:
        conn.execute(suite.dialect.statements(spec).drop)
    with suite.engine.begin() as conn:
        expect(not inspect(conn).has_table(spec.table), "drop left the table")


def check_errors(suite: Suite) -> None:
    """is_unique_violation: a duplicate key is one, a NOT NULL refusal is not."""
    spec = suite.table("errors", lambda b: b)
    table = suite.dialect.fields(spec)
    (row_id,) = suite.publish(spec, {})
    for sql, duplicate in ((f"INSERT INTO {table['table']} ({table['id']}, {table['payload']}) "
                            "VALUES (:id, :payload)", True),
                           (f"INSERT INTO {table['table']} ({table['payload']}) VALUES (NULL)",
                            False)):
        try:
            with suite.engine.begin() as conn:
                conn.execute(text(sql), {"id": row_id, "payload": b"x"})
        except Exception as exc:
            what = "a duplicate id" if duplicate else "a NULL payload"
            expect(suite.dialect.is_unique_violation(exc) == duplicate,
                   f"is_unique_violation gave {not duplicate} for {what}: {exc}")
        else:
            raise CheckFailed(f"the database accepted: {sql}")
