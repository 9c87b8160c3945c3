"""Advisory claims when something fails: key locks are never leaked, and a lock session
that dies is noticed (the process takes back what it can and forgets the rest)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kombu import Connection as KombuConnection
from kombu.message import Message
from sqlalchemy import Connection, text
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError

from kombu_sqlinbox.claims import AdvisoryClaims

from .conftest import Connect
from .support import broker_of, get_within, publish, quoted, settled, table_of, wait_for

ADVISORY = {"claim": "advisory"}


pytestmark = pytest.mark.databases("postgresql", "mysql")  # SQLite has no advisory locks


@pytest.fixture
def other_session(engine: Engine) -> Iterator[Connection]:
    """A session of another process, to look at and take key locks."""
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        yield conn


def form_of(conn: KombuConnection) -> AdvisoryClaims:
    form = broker_of(conn).forms["advisory"]
    assert isinstance(form, AdvisoryClaims)
    return form


def holder(conn: KombuConnection, session: Connection, queue: str, key: str) -> int | None:
    """The server's id of the session holding ``key``'s lock, if any (looked up, not taken)."""
    form = form_of(conn)
    space = form.space(broker_of(conn).table(queue))
    if session.dialect.name == "postgresql":
        found = session.execute(text(
            "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 2 "
            "AND classid = CAST(:space AS bigint) & 4294967295 "
            "AND objid = CAST(hashtext(:key) AS bigint) & 4294967295 AND granted"),
            {"space": space, "key": key}).scalar()
    else:
        (name,) = form.dialect.lock_names(space, [key]).values()
        found = session.execute(text("SELECT IS_USED_LOCK(:name)"), {"name": name}).scalar()
    return None if found is None else int(found)


def backend_id(session: Connection) -> int:
    own_id = ("SELECT pg_backend_pid()" if session.dialect.name == "postgresql"
              else "SELECT CONNECTION_ID()")
    return int(session.execute(text(own_id)).scalar_one())


def kill_lock_session(form: AdvisoryClaims, session: Connection) -> None:
    """End the process's lock session from the server side, as a restart or KILL would,
    and wait until the server has dropped it (and its locks)."""
    with form._lock:
        backend = backend_id(form._locks())
    if session.dialect.name == "postgresql":
        kill = "SELECT pg_terminate_backend(:id)"
        alive = "SELECT COUNT(*) FROM pg_stat_activity WHERE pid = :id"
    else:
        kill = "KILL :id"
        alive = "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE ID = :id"
    session.execute(text(kill), {"id": backend})
    wait_for(lambda: not session.execute(text(alive), {"id": backend}).scalar_one(),
             "the killed session to end")


def first_of_two(connect: Connect) -> tuple[KombuConnection, AdvisoryClaims, Message]:
    """Rows 1 and 2 (keys id:1 and id:2) published on an advisory queue, the first in work."""
    conn = connect(**ADVISORY)
    for n in range(2):
        publish(conn, "jobs", {"n": n})
    return conn, form_of(conn), get_within(conn, "jobs")


def test_failed_claim_leaves_no_key_locked(
    connect: Connect, engine: Engine, table_prefix: str, other_session: Connection,
    database: str,
) -> None:
    """The claim fails after the key locks were taken (a trigger refuses the lease): the
    locks are given back, so other processes can still take the keys."""
    conn = connect(**ADVISORY)
    publish(conn, "jobs", {"n": 1})
    table = quoted(engine, table_of("jobs", table_prefix))
    refuse = quoted(engine, f"{table_prefix}refuse")
    if database == "postgresql":
        other_session.execute(text(
            f"CREATE FUNCTION {refuse}() RETURNS trigger LANGUAGE plpgsql AS "
            "$$ BEGIN RAISE EXCEPTION 'no lease today'; END $$"))
        other_session.execute(text(
            f"CREATE TRIGGER {refuse} BEFORE UPDATE ON {table} "
            f"FOR EACH ROW EXECUTE FUNCTION {refuse}()"))
    else:
        other_session.execute(text(
            f"CREATE TRIGGER {refuse} BEFORE UPDATE ON {table} FOR EACH ROW "
            "SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'no lease today'"))
    try:
        with pytest.raises(DBAPIError, match="no lease today"):
            conn.default_channel.basic_get("jobs")
        assert holder(conn, other_session, "jobs", "id:1") is None
    finally:
        other_session.execute(text(f"DROP TRIGGER {refuse}" + (
            f" ON {table}" if database == "postgresql" else "")))
        if database == "postgresql":
            other_session.execute(text(f"DROP FUNCTION {refuse}()"))
    assert get_within(conn, "jobs").decode() == {"n": 1}


def test_dead_lock_session_is_replaced_and_keys_in_work_taken_back(
    connect: Connect, other_session: Connection,
) -> None:
    conn, form, first = first_of_two(connect)
    kill_lock_session(form, other_session)
    assert holder(conn, other_session, "jobs", "id:1") is None
    second = get_within(conn, "jobs")  # the claim finds the session dead and replaces it
    assert second.decode() == {"n": 1}
    with form._lock:
        renewed = backend_id(form._locks())
    assert holder(conn, other_session, "jobs", "id:1") == renewed
    assert holder(conn, other_session, "jobs", "id:2") == renewed
    first.ack()
    second.ack()
    settled(conn)
    wait_for(lambda: not any(holder(conn, other_session, "jobs", key)
                             for key in ("id:1", "id:2")), "both keys to be released")


def test_key_taken_elsewhere_while_the_session_was_dead_is_forgotten(
    connect: Connect, other_session: Connection,
) -> None:
    """Another process locked the key in the gap: this one forgets it (its row stays
    leased, so nobody else runs it) and does not release the other process's lock."""
    conn, form, first = first_of_two(connect)
    kill_lock_session(form, other_session)
    space = form.space(broker_of(conn).table("jobs"))
    assert form.dialect.try_key_locks(other_session, space, ["id:1"]) == [True]
    second = get_within(conn, "jobs")
    first.ack()
    second.ack()
    settled(conn)
    wait_for(lambda: holder(conn, other_session, "jobs", "id:2") is None,
             "id:2 to be released")
    assert holder(conn, other_session, "jobs", "id:1") == backend_id(other_session)
    form.dialect.release_key_locks(other_session, space, ["id:1"])


def test_settling_on_a_dead_lock_session_keeps_the_other_keys_locked(
    connect: Connect, other_session: Connection,
) -> None:
    conn, form, first = first_of_two(connect)
    second = get_within(conn, "jobs")
    kill_lock_session(form, other_session)
    first.ack()  # the keeper releases id:1 on the dead session: it takes id:2 back
    wait_for(lambda: holder(conn, other_session, "jobs", "id:2") is not None,
             "id:2 to be locked again")
    assert holder(conn, other_session, "jobs", "id:1") is None
    second.ack()
    settled(conn)
    wait_for(lambda: holder(conn, other_session, "jobs", "id:2") is None,
             "id:2 to be released")
