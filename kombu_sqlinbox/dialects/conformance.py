"""The dialect conformance suite: every statement the transport runs, run on a real database.

A service that plugs in a dialect for another database calls :func:`verify` from its
own tests (any test runner), with a URL of a scratch database and its dialect class::

    from kombu_sqlinbox.dialects.conformance import verify

    def test_my_dialect():
        verify("mydb://test@localhost/test", MyDialect)

Each check runs the dialect's statements the way the transport runs them, on tables
of its own (named ``conformance_<random>_...``, dropped afterwards), and checks what
they did. Checks of a capability the dialect does not declare are skipped. Every
check runs, whatever the others did; :func:`verify` then raises one
:class:`ConformanceError` listing each failed check, named by the capability or
statement it exercises. :func:`run` returns the :class:`Report` instead.
"""

from __future__ import annotations

import select
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection, create_engine, inspect, text
from sqlalchemy.engine import URL, Engine

from .. import clock as clocks
from ..errors import SchemaMismatch
from ..tables import Role, TableBuilder, TableSpec
from .base import ClaimedRow, Dialect

#: a lease no check outlives
LONG = 3600.0
#: an advisory-lock space of the suite's own
SPACE = 0x5EC7


class ConformanceError(AssertionError):
    """A dialect failed checks of the suite; ``report`` holds them all."""

    def __init__(self, report: Report) -> None:
        super().__init__(str(report))
        self.report = report


@dataclass(frozen=True)
class Failure:
    check: str
    message: str


@dataclass
class Report:
    """What a run found: the checks passed, skipped (capability not declared), failed."""

    dialect: str
    passed: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures

    def __str__(self) -> str:
        if self.ok:
            return f"{self.dialect}: {len(self.passed)} checks passed"
        lines = [f"{self.dialect}: {len(self.failures)} of "
                 f"{len(self.passed) + len(self.failures)} checks failed:"]
        lines += [f"- {failure.check}: {failure.message}" for failure in self.failures]
        return "\n".join(lines)


class CheckFailed(Exception):
    """One check found the dialect wrong; the message says how."""


def expect(condition: bool, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


class Suite:
    """One run: the engine, the dialect under test and the tables it made."""

    def __init__(self, engine: Engine, dialect: Dialect, patience: float) -> None:
        self.engine = engine
        self.dialect = dialect
        #: seconds any one wait of the suite may take (a lock, a wake-up)
        self.patience = patience
        self.prefix = f"conformance_{uuid.uuid4().hex[:8]}_"

    def name(self, suffix: str) -> str:
        """A table name of this run (every one is dropped at its end)."""
        return self.prefix + suffix

    def table(self, suffix: str, build: Callable[[TableBuilder], TableBuilder]) -> TableSpec:
        """A new table of the given layout, created by the dialect's own DDL."""
        spec = build(TableBuilder(self.name(suffix)).id().payload().attempt().locked_until()
                     ).build()
        with self.engine.begin() as conn:
            self.dialect.ensure_table(conn, spec, create=True)
        return spec

    def publish(self, spec: TableSpec, *rows: dict[str, Any]) -> list[int]:
        """Publish rows (keyword arguments of :meth:`Dialect.insert_params`); their ids."""
        with self.engine.begin() as conn:
            before = self.ids(conn, spec)
            self.dialect.publish(conn, spec, [self.dialect.insert_params(
                **{"payload": b"body", "headers": None, "priority": 0, "eta": None, **row})
                for row in rows])
            return sorted(set(self.ids(conn, spec)) - set(before))

    def ids(self, conn: Connection, spec: TableSpec) -> list[int]:
        f = self.dialect.fields(spec)
        return list(conn.execute(text(f"SELECT {f['id']} FROM {f['table']}")).scalars())

    def claim(self, spec: TableSpec, limit: int = 10, lease: float = LONG,
              **kwargs: Any) -> list[ClaimedRow]:
        with self.engine.begin() as conn:
            return self.dialect.claim(conn, spec, limit, lease, **kwargs)

    def settle(self, spec: TableSpec, statement: str, attempt: int, ids: Sequence[int],
               **extra: Any) -> int:
        with self.engine.begin() as conn:
            return self.dialect.settle(conn, getattr(self.dialect.statements(spec), statement),
                                       {attempt: list(ids)}, extra)

    def scalar(self, spec: TableSpec, statement: str) -> Any:
        with self.engine.begin() as conn:
            return conn.execute(getattr(self.dialect.statements(spec), statement)).scalar()

    def drop_all(self) -> None:
        with self.engine.begin() as conn:
            quote = self.dialect.quote
            for name in inspect(conn).get_table_names():
                if name.startswith(self.prefix):
                    conn.exec_driver_sql(f"DROP TABLE IF EXISTS {quote(name)}")


def ids_of(rows: Sequence[ClaimedRow]) -> list[int]:
    return [row.id for row in rows]


def refusal(suite: Suite, spec: TableSpec, accepted: str) -> str:
    """What ensure_table (not creating) says of a table that does not fit ``spec``; fails
    with ``accepted`` when it says nothing."""
    with suite.engine.begin() as conn:
        try:
            suite.dialect.ensure_table(conn, spec, create=False)
        except SchemaMismatch as exc:
            return str(exc)
    raise CheckFailed(accepted)


# -- the checks ---------------------------------------------------------------------------
def check_ddl(suite: Suite) -> None:
    """create_ddl, ensure_table's checks, add_column_ddl, transactional_ddl."""
    dialect = suite.dialect
    spec = TableBuilder(suite.name("ddl")).id().payload().headers().priority().available_at(
        ).locked_until().attempt().group("grp").partition_key("pkey").processed_at().build()
    refused = refusal(suite, spec, "ensure_table(create=False) accepted a missing table")
    expect("does not exist" in refused, f"a missing table was reported as: {refused}")
    with suite.engine.begin() as conn:
        text_payload = dialect.ensure_table(conn, spec, create=True)
    expect(not text_payload, "ensure_table: the default payload column reads as text, not binary")
    with suite.engine.begin() as conn:
        dialect.ensure_table(conn, spec, create=False)  # the DDL's own types pass the check
    missing = TableBuilder(suite.name("ddl_missing")).id().payload().build()
    with suite.engine.begin() as conn:
        dialect.ensure_table(conn, missing, create=True)
    more = TableBuilder(missing.table).id().payload().priority().build()
    refused = refusal(suite, more, "ensure_table accepted a table lacking a declared column")
    expect("'priority'" in refused and "is missing" in refused,
           f"a missing column was reported as: {refused}")
    with suite.engine.begin() as conn:
        conn.exec_driver_sql(dialect.add_column_ddl(more, more.columns[2]))
    with suite.engine.begin() as conn:
        dialect.ensure_table(conn, more, create=False)  # the column it suggested fits
    wrong = TableBuilder(suite.name("ddl_wrong")).id().payload().attempt().build()
    columns = [dialect.column_ddl(column) for column in wrong.columns[:2]]
    columns.append(f"{dialect.quote('attempt')} {dialect.column_types[Role.LOCKED_UNTIL]}")
    with suite.engine.begin() as conn:
        conn.exec_driver_sql(f"CREATE TABLE {dialect.table_ref(wrong)} ({', '.join(columns)})")
    refused = refusal(suite, wrong, "type_problem: a time column was accepted for the attempt "
                      "role")
    expect("'attempt'" in refused, f"a wrong column type was reported as: {refused}")
    if dialect.transactional_ddl:
        rolled_back = TableBuilder(suite.name("ddl_rollback")).id().payload().build()
        with suite.engine.connect() as conn:
            conn.begin()
            for statement in dialect.create_ddl(rolled_back):
                conn.exec_driver_sql(statement)
            conn.rollback()
        with suite.engine.begin() as conn:
            expect(not inspect(conn).has_table(rolled_back.table),
                   "transactional_ddl is declared, but a CREATE TABLE rolled back stayed")


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


def check_outbox(suite: Suite) -> None:
    """The outbox's statements: create, insert (generated and given ids), mark, processed,
    due, claim, unclaim, prune, status, drop."""
    dialect = suite.dialect
    columns = {role: role for role in dialect.outbox_column_types}
    record = {"task_id": "t", "task_name": "n", "exchange": "", "routing_key": "q",
              "headers": "{}", "properties": "{}", "body": b"body"}
    for generated in (True, False):
        scan = {"after": 0 if generated else "", "limit": 10}
        table = suite.name("outbox_generated" if generated else "outbox_given")
        with suite.engine.begin() as conn:
            for statement in dialect.outbox_create_ddl(table, None, columns, generated):
                conn.exec_driver_sql(statement)
        run = dialect.outbox_statements(table, None, columns, generated)
        with suite.engine.begin() as conn:
            if generated:
                first = dialect.outbox_insert(conn, run["insert"], record)
                second = dialect.outbox_insert(conn, run["insert"], record)
                expect(first is not None and second is not None and first != second,
                       f"outbox_insert returned ids {first!r}, {second!r}: not two new ids")
            else:
                first, second = "a" * 32, "b" * 32
                for given in (first, second):
                    conn.execute(run["insert"], {**record, "id": given})
        fields = dialect.outbox_fields(table, None, columns)
        with suite.engine.begin() as conn:  # written a minute ago, as far as due and status go
            conn.execute(text(f"UPDATE {fields['table']} SET {fields['created_at']} = "
                              f"{dialect.outbox_ago()}"), {"older_than": 60})
            conn.execute(run["mark"], {"id": first})
            processed = conn.execute(run["processed"], {"id": first}).scalar()
            expect(processed == 1, f"outbox processed: a marked record gave {processed}")
            due = [row[0] for row in conn.execute(run["due"], {"older_than": 30, **scan})]
            expect(due == [second], f"outbox due: got ids {due}, expected {[second]}")
            conn.execute(run["claim"], {"ids": [second]})
        with suite.engine.begin() as conn:
            due = [row[0] for row in conn.execute(run["due"], {"older_than": 30, **scan})]
            expect(due == [], "outbox claim: a claimed record is still due")
            conn.execute(run["unclaim"], {"ids": [second]})
            due = [row[0] for row in conn.execute(run["due"], {"older_than": 30, **scan})]
            expect(due == [second], "outbox unclaim: the record is not due again")
            unprocessed, done, age = conn.execute(run["status"]).one()
            expect((unprocessed, done) == (1, 1) and 30 < float(age) < 600,
                   f"outbox status gave {(unprocessed, done, age)}, expected (1, 1, about 60)")
            pruned = conn.execute(run["prune"], {"older_than": -1, "limit": 10}).rowcount
            expect(pruned == 1, f"outbox prune removed {pruned} records, expected the "
                   "processed one")
            conn.execute(run["drop"])


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


Check = Callable[[Suite], None]
#: (name, declared capability it needs or None, check), in the order they run
CHECKS: tuple[tuple[str, str | None, Check], ...] = (
    ("DDL (create_ddl, ensure_table, add_column_ddl)", None, check_ddl),
    ("publish (insert_statement)", None, check_publish),
    ("claim order", None, check_claim_order),
    ("lease fencing (complete, release, extend)", None, check_lease_fencing),
    ("lease extension (extend, release_uncounted)", None, check_extension),
    ("retry delay (retry)", None, check_retry_delay),
    ("partition keys (candidates, claim by ids, claim skipping)", None, check_keys),
    ("FIFO heads", None, check_fifo),
    ("purge and drop", None, check_purge_and_drop),
    ("errors (is_unique_violation)", None, check_errors),
    ("row locks (lock_clause, SKIP LOCKED)", "row_locks", check_row_locks),
    ("key locks (try_key_locks, release_key_locks)", "key_locks", check_key_locks),
    ("wake-ups (wake, listen, take_notifications)", "wakeups", check_wakeups),
    ("outbox statements", None, check_outbox),
    ("operations (queue_stats, stored_page, stored_locked, remove, restore)", None,
     check_operations),
    ("a pinned clock (now, eta_value, later)", None, check_clock),
)


def run(target: str | URL | Engine, dialect: type[Dialect], patience: float = 10.0) -> Report:
    """Run every check of ``dialect`` on the database at ``target`` (a URL, or an engine
    the suite then prepares as the transport prepares its own: pass a fresh one); the
    report of them all. ``patience`` bounds each wait (a lock, a wake-up) in seconds."""
    engine = target if isinstance(target, Engine) else create_engine(
        target, **dialect.engine_defaults)
    under_test = dialect(engine)
    under_test.prepare_engine(engine)
    suite = Suite(engine, under_test, patience)
    report = Report(dialect.__name__)
    try:
        for name, capability, check in CHECKS:
            if capability is not None and not getattr(dialect.capabilities, capability):
                report.skipped.append(name)
                continue
            try:
                check(suite)
            except CheckFailed as exc:
                report.failures.append(Failure(name, str(exc)))
            except Exception as exc:
                report.failures.append(Failure(name, f"{type(exc).__name__}: {exc}"))
            else:
                report.passed.append(name)
    finally:
        suite.drop_all()
        if engine is not target:
            engine.dispose()
    return report


def verify(target: str | URL | Engine, dialect: type[Dialect], patience: float = 10.0) -> Report:
    """:func:`run`, raising :class:`ConformanceError` (listing every failed check) unless
    all passed."""
    report = run(target, dialect, patience)
    if not report.ok:
        raise ConformanceError(report)
    return report
