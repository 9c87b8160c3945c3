"""The plug-in dialect of docs/dialects.rst: the conformance suite rejects its draft
with the reasons the page shows, and passes the dialect that declares what it has."""

from __future__ import annotations

import pytest
from sqlalchemy.engine import Engine

from kombu_sqlinbox.dialects import dialect_class
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
