"""The plug-in dialect of docs/dialects.rst: the conformance suite rejects its draft
with the reasons the page shows, and passes the dialect that declares what it has."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
from kombu import Connection
from sqlalchemy.engine import Engine

from kombu_sqlinbox.dialects import Dialect, PostgreSQLDialect, dialect_class, register
from kombu_sqlinbox.dialects.conformance import ConformanceError, verify

from .support import DOCS, load_example

cockroach = load_example("dialects/cockroach.py")
#: the shape of a CockroachDB server here: PostgreSQL's protocol
pytestmark = pytest.mark.parametrize("database", ["postgresql"])


def test_draft_rejected_with_what_it_lacks(engine: Engine) -> None:
    with pytest.raises(ConformanceError) as refused:
        verify(engine.url, cockroach.CockroachDraft)
    failures = [failure.check for failure in refused.value.report.failures]
    assert failures == ["key locks (try_key_locks, release_key_locks)",
                        "wake-ups (wake, listen, take_notifications)"]
    page = (DOCS / "dialects.rst").read_text()
    for line in str(refused.value).splitlines():
        assert "   " + line + "\n" in page, line


def test_dialect_declaring_what_it_has_passes(engine: Engine) -> None:
    report = verify(engine.url, cockroach.CockroachDialect)
    assert report.skipped == ["key locks (try_key_locks, release_key_locks)",
                              "wake-ups (wake, listen, take_notifications)"]
    assert dialect_class("cockroachdb") is cockroach.CockroachDialect


def written_from_the_page(name: str, leave_out: frozenset[str] = frozenset()) -> type[Dialect]:
    """A dialect as a reader of the page writes one: PostgreSQL's own code for each piece
    the page says a dialect must supply or may override (but ``leave_out``), the base
    class's for everything else, and no capability but ``returning``."""
    page = (DOCS / "dialects.rst").read_text()
    listed = page[page.index("must\nsupply:"):page.index("The conformance suite")]
    named = set(re.findall(r"``(\w+)", listed)) - leave_out
    body: dict[str, Any] = {"names": (name,), "lock_clause": "",
                            "capabilities": type(Dialect.capabilities)(returning=True)}
    for klass in PostgreSQLDialect.__mro__[:PostgreSQLDialect.__mro__.index(Dialect)]:
        for attribute in vars(klass):
            if attribute not in named and attribute not in body and hasattr(Dialect, attribute):
                body[attribute] = next(vars(base)[attribute] for base in Dialect.__mro__
                                       if attribute in vars(base))
    return type("FromThePage", (PostgreSQLDialect,), body)


@pytest.fixture
def in_place_of_postgresql() -> Iterator[None]:
    """The built-in PostgreSQL dialect put back after a test replaced it."""
    yield
    register(PostgreSQLDialect)


def test_a_dialect_of_what_the_page_lists_conforms_and_carries_messages(
        engine: Engine, table_prefix: str, in_place_of_postgresql: None) -> None:
    """What the page says a dialect supplies is all the transport calls: such a dialect
    passes the suite, and a connection on it routes, publishes and consumes."""
    verify(engine.url, written_from_the_page("fromthepage"))
    register(written_from_the_page("postgresql"))
    with Connection("sqlinbox+" + engine.url.render_as_string(hide_password=False),
                    transport_options={"table_prefix": table_prefix}) as conn:
        queue = conn.SimpleQueue("jobs")
        queue.put({"n": 1})
        message = queue.get(timeout=10)
        message.ack()
        assert message.payload == {"n": 1}
        queue.close()


def test_the_suite_refuses_a_dialect_lacking_what_routing_needs(engine: Engine) -> None:
    """The suite runs the routing tables' statements: a dialect without ``epoch`` fails
    there, not at the transport's first exchange."""
    with pytest.raises(ConformanceError) as refused:
        verify(engine.url, written_from_the_page("noepoch", leave_out=frozenset({"epoch"})))
    assert [failure.check for failure in refused.value.report.failures] == [
        "routing (declare, bind, route, size, transient claim)"]
