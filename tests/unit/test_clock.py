"""The clock: a database with none installed runs the very statements it always ran; with
one, every statement that reads the time reads it through the one bound value."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy import TextClause, create_engine

from celery_ext.declaration import default_outbox_table
from kombu_sqlinbox import clock as clocks
from kombu_sqlinbox.dialects import Dialect, dialect_for
from kombu_sqlinbox.tables import TableBuilder

URLS = ("postgresql+psycopg2://h/db", "mysql+pymysql://h/db", "sqlite:////tmp/clock.db")


def every_statement(dialect: Dialect) -> Iterator[TextClause]:
    """The queue statements of a table with every time role, and the outbox's."""
    spec = (TableBuilder("jobs").id().payload().headers().attempt().locked_until()
            .available_at().processed_at().priority().build())
    statements = dialect.statements(spec)
    for name in type(statements).__dataclass_fields__:
        value = getattr(statements, name)
        yield from value if isinstance(value, tuple) else [value] if value is not None else []
    outbox = default_outbox_table("outbox")
    yield from dialect.outbox_statements(
        outbox.table, outbox.schema, outbox.column_names(), outbox.generated_id).values()
    yield dialect.explain(spec)


@pytest.mark.parametrize("url", URLS)
def test_without_a_clock_no_statement_binds_a_time(url: str) -> None:
    dialect = dialect_for(create_engine(url))
    assert dialect.clock is None and dialect.now == type(dialect).now
    assert not any(clocks.PARAMETER in s.text for s in every_statement(dialect))


@pytest.mark.parametrize("url", URLS)
def test_with_a_clock_every_statement_reading_the_time_binds_it(url: str) -> None:
    engine = create_engine(url)
    clock = clocks.install(engine.url)
    try:
        dialect = dialect_for(engine)
        database_now = type(dialect).now
        reading = [s for s in every_statement(dialect) if database_now in s.text]
        assert len(reading) >= 10
        clock.pin(1000.0)
        for statement in reading:
            assert statement.text.count(database_now) == statement.text.count(clocks.PARAMETER)
            assert statement._bindparams[clocks.PARAMETER].effective_value == 1000.0
    finally:
        clocks.uninstall(engine.url)
    assert clock.pinned is None  # released: dialects made before read the database's time
    assert dialect_for(engine).clock is None


def test_advance_pins_first_and_release_unpins() -> None:
    clock = clocks.Clock()
    assert clock.value() is None
    clock.pin(100.0)
    assert clock.advance(60) == 160.0 == clock.value()
    clock.release()
    assert clock.advance(1) > 1e9  # pinned at this process's time, then moved on
