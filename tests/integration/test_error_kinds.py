"""What a database error means, as each dialect reads real errors of its database.

A unique (or primary) key violated is the same work done twice; NOT NULL and
CHECK violations are ordinary errors; a lock that could not be had in time is
transient (the same work may simply run again).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError

from kombu_sqlinbox.dialects import Dialect, dialect_for

#: the statement that makes a session give up on a lock after a moment
LOCK_TIMEOUT = {"postgresql": "SET lock_timeout = '100ms'",
                "mysql": "SET SESSION innodb_lock_wait_timeout = 1"}


@pytest.fixture
def kinds(engine: Engine, table_prefix: str) -> Iterator[str]:
    """A table with one row, a primary key, a NOT NULL and a CHECK constraint."""
    name = engine.dialect.identifier_preparer.quote(f"{table_prefix}kinds")
    with engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (k VARCHAR(20) PRIMARY KEY, "
                          "v INTEGER NOT NULL, CHECK (v >= 0))"))
        conn.execute(text(f"INSERT INTO {name} (k, v) VALUES ('one', 1)"))
    yield name


def error_of(engine: Engine, statement: str) -> DBAPIError:
    with pytest.raises(DBAPIError) as caught, engine.begin() as conn:
        conn.execute(text(statement))
    return caught.value


@pytest.mark.parametrize(("values", "unique"), [
    ("('one', 2)", True),  # the primary key again
    ("('two', NULL)", False),
    ("('two', -1)", False),  # the CHECK constraint
])
def test_only_a_unique_key_violation_is_work_done_before(engine: Engine, kinds: str,
                                                         values: str, unique: bool) -> None:
    dialect: Dialect = dialect_for(engine)
    error = error_of(engine, f"INSERT INTO {kinds} (k, v) VALUES {values}")
    assert dialect.is_unique_violation(error) is unique, error
    assert not dialect.is_transient(error)


def test_a_lock_not_had_in_time_is_transient(database: str, db_url: str, engine: Engine,
                                             kinds: str) -> None:
    dialect: Dialect = dialect_for(engine)
    update = f"UPDATE {kinds} SET v = 5 WHERE k = 'one'"
    if database == "sqlite":
        holder = sqlite3.connect(str(engine.url.database), isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")
        impatient = create_engine(db_url, connect_args={"timeout": 0.1})
        try:
            error = error_of(impatient, update)
        finally:
            holder.execute("ROLLBACK")
            holder.close()
            impatient.dispose()
    else:
        with engine.connect() as holder:
            holder.execute(text(update))  # holds the row's lock until the rollback
            with engine.connect() as conn:
                conn.execute(text(LOCK_TIMEOUT[database]))
                with pytest.raises(DBAPIError) as caught:
                    conn.execute(text(update))
                error = caught.value
                conn.rollback()
            holder.rollback()
    assert dialect.is_transient(error), error
    assert not dialect.is_unique_violation(error)
