"""The operations commands and the outbox take a ``postgres://`` URL (Heroku's and many
hosts' spelling of ``DATABASE_URL``) as PostgreSQL, as the transport does."""

from __future__ import annotations

import pytest
from sqlalchemy import text
from sqlalchemy.engine import make_url

from celery_ext.outbox.store import engine_from_url
from tests.ops.conftest import Cli

pytestmark = pytest.mark.databases("postgresql")


def heroku(db_url: str) -> str:
    return make_url(db_url).set(drivername="postgres").render_as_string(hide_password=False)


def test_the_standalone_command_takes_a_postgres_url(cli: Cli, db_url: str) -> None:
    done = cli("queues", options={}, url=heroku(db_url))
    assert done.returncode == 0
    assert "Traceback" not in done.stderr


def test_the_outbox_takes_a_postgres_url(db_url: str) -> None:
    engine = engine_from_url(heroku(db_url))
    try:
        assert engine.dialect.name == "postgresql"
        with engine.connect() as conn:
            assert conn.execute(text("SELECT 1")).scalar() == 1
    finally:
        engine.dispose()
