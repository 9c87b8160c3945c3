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

from collections.abc import Callable

from sqlalchemy import create_engine
from sqlalchemy.engine import URL, Engine

from ..base import Dialect
from .capabilities import check_key_locks, check_row_locks, check_wakeups
from .clock import check_clock
from .operations import check_operations
from .outbox import check_outbox
from .queue import (
    check_claim_order,
    check_errors,
    check_extension,
    check_fifo,
    check_keys,
    check_lease_fencing,
    check_publish,
    check_purge_and_drop,
    check_retry_delay,
)
from .routing import check_routing
from .schema import check_ddl
from .suite import CheckFailed, ConformanceError, Failure, Report, Suite

__all__ = ["CHECKS", "ConformanceError", "Failure", "Report", "run", "verify"]


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
    ("routing (declare, bind, route, size, transient claim)", None, check_routing),
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
