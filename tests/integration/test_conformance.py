"""The dialect conformance suite passes for each built-in dialect on its database, and
skips exactly the checks of the capabilities it does not declare."""

from __future__ import annotations

from sqlalchemy.engine import Engine

from kombu_sqlinbox.dialects import dialect_class
from kombu_sqlinbox.dialects.conformance import CHECKS, verify


def test_builtin_dialect_conforms(engine: Engine) -> None:
    dialect = dialect_class(engine.dialect.name)
    report = verify(engine.url, dialect)
    undeclared = [name for name, capability, _ in CHECKS
                  if capability is not None and not getattr(dialect.capabilities, capability)]
    assert report.skipped == undeclared
    assert len(report.passed) == len(CHECKS) - len(undeclared)
