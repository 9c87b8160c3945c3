"""The database ends the wake-up's LISTEN session (``pg_terminate_backend``): the next
use finds it dead, drops it without an ERROR in the log, and connects a new one.
Each PostgreSQL driver reports a dead connection its own way, so both run."""

from __future__ import annotations

import logging

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

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
        pid = wakeup._listener.info.backend_pid if driver == "psycopg" else (
            wakeup._listener.get_backend_pid())
        with admin.connect() as conn:
            assert conn.execute(text(
                "SELECT application_name FROM pg_stat_activity WHERE pid = :pid"),
                {"pid": pid}).scalar_one() == LISTEN_APPLICATION
            assert conn.execute(text("SELECT pg_terminate_backend(:pid)"),
                                {"pid": pid}).scalar_one()
        with caplog.at_level(logging.DEBUG):
            wakeup.listen("second")  # a new consumer's queue, on the dead session
            wakeup.sources()  # a new session, listening on both
        assert wakeup._listener is not None
        errors = [record for record in caplog.records if record.levelno >= logging.ERROR]
        assert not errors, [record.getMessage() for record in errors]
    finally:
        wakeup.close()
        database.dispose()
        admin.dispose()
