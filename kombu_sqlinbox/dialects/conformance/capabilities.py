"""Checks of what a dialect declares beyond plain SQL: row locks passed over (SKIP
LOCKED), advisory key locks, wake-ups."""

from __future__ import annotations

import select
import threading
import time
from typing import Any

from .suite import SPACE, Suite, expect, ids_of


def check_row_locks(suite: Suite) -> None:
    """lock_clause: a row held by one transaction is passed over by another's lock and
    claim (SKIP LOCKED), without waiting."""
    dialect = suite.dialect
    expect(bool(dialect.lock_clause), "row_locks is declared, but lock_clause is empty")
    expect(dialect.capabilities.skip_locked, "row_locks is declared without skip_locked: the "
           "transport's row-lock claims would wait on each other")
    spec = suite.table("row_locks", lambda b: b)
    held_id, free_id = suite.publish(spec, {}, {})
    (held,) = suite.claim(spec, limit=1, lease=-1)  # claimed, and ready again at once
    lock_row = dialect.statements(spec).lock_row
    with suite.engine.connect() as holder:
        holder.begin()
        locked = holder.execute(lock_row, {"id": held_id, "attempt": held.attempt}).first()
        expect(locked is not None, "lock_row did not return the row it locks")
        seen: dict[str, Any] = {}

        def other() -> None:
            try:
                with suite.engine.begin() as conn:
                    seen["lock"] = conn.execute(
                        lock_row, {"id": held_id, "attempt": held.attempt}).first()
                seen["claim"] = ids_of(suite.claim(spec))
            except Exception as exc:  # reported below
                seen["error"] = exc

        worker = threading.Thread(target=other, daemon=True)
        worker.start()
        worker.join(suite.patience)
        waited = worker.is_alive()
        holder.rollback()
    worker.join(suite.patience)
    expect(not waited, f"skip_locked is declared, but a second transaction waited more than "
           f"{suite.patience:.0f}s on a row another held")
    expect("error" not in seen, f"a second transaction failed on a held row: {seen.get('error')}")
    expect(seen.get("lock") is None, "lock_row in a second transaction took a row another holds")
    expect(seen.get("claim") == [free_id], f"a claim beside a held row got ids "
           f"{seen.get('claim')}, expected only {[free_id]}")


def check_key_locks(suite: Suite) -> None:
    """try_key_locks, release_key_locks: one session's key is refused to another until
    released; spaces are apart."""
    dialect = suite.dialect
    with suite.engine.connect() as one, suite.engine.connect() as two:
        one = one.execution_options(isolation_level="AUTOCOMMIT")
        two = two.execution_options(isolation_level="AUTOCOMMIT")
        try:
            got = dialect.try_key_locks(one, SPACE, ["a", "b"])
            expect(got == [True, True], f"try_key_locks of free keys gave {got}")
            got = dialect.try_key_locks(two, SPACE, ["a", "c"])
            expect(got == [False, True], f"try_key_locks of a key another session holds "
                   f"(a) and a free one (c) gave {got}, expected [False, True]")
            got = dialect.try_key_locks(two, SPACE + 1, ["b"])
            expect(got == [True], f"try_key_locks of a held key in another space gave {got}")
            dialect.release_key_locks(one, SPACE, ["a"])
            got = dialect.try_key_locks(two, SPACE, ["a"])
            expect(got == [True], f"try_key_locks of a released key gave {got}")
        finally:
            dialect.release_key_locks(one, SPACE, ["b"])
            dialect.release_key_locks(two, SPACE, ["a", "c"])
            dialect.release_key_locks(two, SPACE + 1, ["b"])


def check_wakeups(suite: Suite) -> None:
    """listen, take_notifications, and the wake of a publish and of wake()."""
    dialect = suite.dialect
    expect(dialect.notify, "wakeups is declared, but the dialect's notify is off")
    spec = suite.table("wakeups", lambda b: b)
    raw = suite.engine.raw_connection()
    listener: Any = raw.driver_connection
    raw.detach()
    listener.autocommit = True
    try:
        dialect.listen(listener, [dialect.channel(spec)])
        expect(not dialect.take_notifications(listener), "a wake-up arrived before any publish")
        suite.publish(spec, {})
        expect(woken(suite, listener), f"a publish did not wake a listener within "
               f"{suite.patience:.0f}s")
        expect(not dialect.take_notifications(listener),
               "take_notifications reported the same wake-up twice")
        with suite.engine.begin() as conn:
            dialect.wake(conn, spec)
        expect(woken(suite, listener), f"wake() did not wake a listener within "
               f"{suite.patience:.0f}s")
    finally:
        listener.close()


def woken(suite: Suite, listener: Any) -> bool:
    """Whether a wake-up arrives within the suite's patience (waiting on the socket)."""
    deadline = time.monotonic() + suite.patience
    while not suite.dialect.take_notifications(listener):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        select.select([listener], [], [], min(remaining, 0.5))
    return True
