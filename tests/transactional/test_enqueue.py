"""Transactional enqueue: a task sent inside the caller's transaction exists only if it commits.

From web code, the example's ``web.request_refund`` records the request and queues
the refund in the caller's Session (``celery_ext.bind(session)``). From inside a
task, the refund queues its receipt through the delivery's transaction:
``test_refunds`` shows the committed case, and the timed-out card call the
rolled-back one (the receipt job of the first delivery never runs).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import create_engine
from sqlalchemy.orm import Session

from kombu_sqlinbox.brokers import close_all
from kombu_sqlinbox.dialects.sqlite import SQLiteDialect
from tests.databases import fresh_database
from tests.transactional.apps.service import refunds_app, web
from tests.transactional.conftest import (
    REFUND,
    Service,
    drop_app_connections,
    pointed_at,
    queue_rows,
)


def test_a_refund_requested_in_a_web_transaction_exists_only_if_it_commits(
        service: Service, order_id: str) -> None:
    cancelled = f"{order_id}-cancelled"
    with Session(service.engine) as session:
        web.request_refund(session, cancelled, 100)
        assert service.queue_rows("refunds") == 0, "visible before the caller committed"
        session.rollback()
    assert service.queue_rows("refunds") == 0
    with Session(service.engine) as session:
        web.request_refund(session, order_id, 200)
        assert service.queue_rows("refunds") == 0, "visible before the caller committed"
        session.commit()
    service.check_refunded_once(order_id)
    assert len(service.runs_of(REFUND, order_id)) == 1
    assert service.runs_of(REFUND, cancelled) == []
    assert service.refund_rows(cancelled) == []
    requests = refunds_app.refund_requests
    assert service.count(requests, requests.c.order_id == cancelled) == 0
    assert service.count(requests, requests.c.order_id == order_id) == 1


def test_sqlite_enqueue_in_a_transaction_waits_for_no_other_write_lock(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A process's first publish (a new connection to ping, a queue to resolve and declare)
    from inside a transaction that holds SQLite's write lock: every step of its own that
    only reads must not wait for that lock."""
    monkeypatch.setattr(SQLiteDialect, "busy_timeout", 0.3)  # fail in seconds, not minutes
    with fresh_database("sqlite", tmp_path) as db_url, pointed_at(db_url):
        engine = create_engine(db_url)
        try:
            refunds_app.metadata.create_all(engine)
            with refunds_app.app.connection_for_write() as conn:  # as the workers leave it
                conn.default_channel.queue_declare("refunds")
            drop_app_connections()
            close_all()  # nothing of this process knows the queue or has a connection
            with Session(engine) as session:
                web.request_refund(session, "o-1", 100)  # writes first, then enqueues
                session.commit()
            assert queue_rows(engine, "refunds") == 1
        finally:
            engine.dispose()
