"""The database ends the wake-up's LISTEN session (``pg_terminate_backend``): the next
use finds it dead, drops it without an ERROR in the log, and connects a new one.
Each PostgreSQL driver reports a dead connection its own way, so both run. And a claim
of several statements runs there in a transaction of its own."""

from __future__ import annotations

import logging
import uuid

import pytest
from sqlalchemy import Connection, create_engine, text
from sqlalchemy.engine import Engine, make_url

from kombu_sqlinbox.database import Database
from kombu_sqlinbox.dialects.postgresql import LISTEN_APPLICATION
from kombu_sqlinbox.wakeups import Wakeup


@pytest.mark.databases("postgresql")
@pytest.mark.parametrize("driver", ["psycopg", "psycopg2"])
def test_a_dead_listen_session_is_dropped_without_an_error(
        db_url: str, driver: str, caplog: pytest.LogCaptureFixture) -> None:
    url = make_url(db_url).set(drivername=f"postgresql+{driver}")
    database = Database.open(url)
    wakeup = Wakeup(database)
    admin = create_engine(url)
    try:
        wakeup.listen("first")
        wakeup.sources()  # connects the LISTEN session
        assert application_name(admin, wakeup, driver) == LISTEN_APPLICATION
        pid = backend_pid(wakeup, driver)
        with admin.connect() as conn:
            assert conn.execute(text("SELECT pg_terminate_backend(:pid)"),
                                {"pid": pid}).scalar_one()
        with caplog.at_level(logging.DEBUG):
            wakeup.listen("second")  # a new consumer's queue, on the dead session
            wakeup.sources()  # a new session, listening on both
        assert wakeup._listener is not None
        errors = [record for record in caplog.records if record.levelno >= logging.ERROR]
        assert not errors, [record.getMessage() for record in errors]
        wakeup.listen("third")  # a channel more on the live session: no naming again
        assert application_name(admin, wakeup, driver) == LISTEN_APPLICATION  # named anew
    finally:
        wakeup.close()
        database.dispose()
        admin.dispose()


@pytest.mark.databases("postgresql")
def test_a_claim_in_a_transaction_runs_on_the_listen_session_and_a_failed_one_rolls_back(
        db_url: str) -> None:
    """A limited claim's transaction runs on the LISTEN session, committed there; one whose
    work fails is rolled back (its row locks go with it) and the session stays in use."""
    database = Database.open(db_url)
    wakeup = Wakeup(database)
    table = f"lt_{uuid.uuid4().hex[:8]}"
    admin = create_engine(db_url)
    try:
        with admin.begin() as conn:
            conn.execute(text(f"CREATE TABLE {table} (id INTEGER PRIMARY KEY, n INTEGER)"))
            conn.execute(text(f"INSERT INTO {table} VALUES (1, 0)"))
        wakeup.listen("claims")
        wakeup.sources()  # connects the LISTEN session
        listener = wakeup._listener
        pid = wakeup._session.exec_driver_sql("SELECT pg_backend_pid()").scalar_one()

        def bump(conn: Connection) -> int:
            conn.execute(text(f"UPDATE {table} SET n = n + 1 WHERE id = 1"))
            return int(conn.execute(text("SELECT pg_backend_pid()")).scalar_one())

        assert wakeup.claim_in_transaction(bump) == pid

        def failing(conn: Connection) -> None:
            bump(conn)
            raise ValueError("the claim's own failure")

        with pytest.raises(ValueError, match="own failure"):
            wakeup.claim_in_transaction(failing)
        with admin.begin() as conn:
            # the failed claim's lock is gone (NOWAIT would fail on it) and its write too
            assert conn.execute(text(
                f"SELECT n FROM {table} WHERE id = 1 FOR UPDATE NOWAIT")).scalar_one() == 1
        assert wakeup.claim_in_transaction(bump) == pid
        assert wakeup._listener is listener
    finally:
        wakeup.close()
        database.dispose()
        with admin.begin() as conn:
            conn.execute(text(f"DROP TABLE IF EXISTS {table}"))
        admin.dispose()


def backend_pid(wakeup: Wakeup, driver: str) -> int:
    listener = wakeup._listener
    return int(listener.info.backend_pid if driver == "psycopg" else listener.get_backend_pid())


def application_name(admin: Engine, wakeup: Wakeup, driver: str) -> str:
    """How the wake-up's LISTEN session shows in ``pg_stat_activity``."""
    with admin.connect() as conn:
        return str(conn.execute(text(
            "SELECT application_name FROM pg_stat_activity WHERE pid = :pid"),
            {"pid": backend_pid(wakeup, driver)}).scalar_one())


@pytest.mark.databases("postgresql")
@pytest.mark.parametrize("driver", ["psycopg", "psycopg2"])
def test_a_claim_in_a_transaction_whose_listen_session_dies_runs_on_the_pool(
        db_url: str, driver: str) -> None:
    """The LISTEN session ends in the middle of a claim's transaction: the claim is run
    again on a pooled connection (its transaction never committed), not raised."""
    url = make_url(db_url).set(drivername=f"postgresql+{driver}")
    database = Database.open(url)
    wakeup = Wakeup(database)
    try:
        wakeup.listen("claims")
        wakeup.sources()  # connects the LISTEN session
        listen_pid = backend_pid(wakeup, driver)
        runs: list[int] = []

        def dying(conn: Connection) -> int:
            pid = int(conn.execute(text("SELECT pg_backend_pid()")).scalar_one())
            runs.append(pid)
            if pid == listen_pid:
                conn.execute(text("SELECT pg_terminate_backend(pg_backend_pid())"))
            return pid

        assert wakeup.claim_in_transaction(dying) != listen_pid
        assert runs[0] == listen_pid and len(runs) == 2
    finally:
        wakeup.close()
        database.dispose()
