"""A pool process forked while another thread of the parent holds the lock of a
process-wide registry (a Celery prefork pool forks, and forks again with
``worker_max_tasks_per_child`` or autoscale, while the parent's threads run): the child's
copy of that lock would be held for ever, and the child hang at its first use of it, or
in the fork itself where an at-fork hook takes it."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
from celery import Celery, states

import celery_ext
from kombu_sqlinbox import brokers, results
from kombu_sqlinbox.options import TransportOptions

from .support import exit_code_within

#: a lock is the same in every database: one file is enough
pytestmark = pytest.mark.databases("sqlite")


@contextmanager
def held_by_a_thread(lock: threading.Lock) -> Iterator[None]:
    """``lock`` held by another thread until the block ends."""
    inside, leave = threading.Event(), threading.Event()

    def hold() -> None:
        with lock:
            inside.set()
            leave.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert inside.wait(10)
        yield
    finally:
        leave.set()
        holder.join(10)


def forked_exit_code(lock: threading.Lock, in_child: Callable[[], bool]) -> int | None:
    """Fork while another thread holds ``lock``; the child exits 0 when ``in_child`` is
    true, 2 when false, 1 on an error; None when it did not end in time (it hung)."""
    with held_by_a_thread(lock):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = 0 if in_child() else 2
            finally:
                os._exit(code)
    return exit_code_within(pid, 30)


def test_a_child_forked_while_a_thread_looks_up_a_broker_opens_its_own(
        broker_url: str) -> None:
    parents = brokers.broker_for(broker_url, TransportOptions())
    code = forked_exit_code(brokers._BROKERS_LOCK, lambda: brokers.broker_for(
        broker_url, TransportOptions()).pid == os.getpid())
    assert code == 0, "the child hung looking up its broker"
    assert brokers.broker_for(broker_url, TransportOptions()) is parents
    brokers.close_all()


def test_a_child_forked_while_a_thread_looks_up_a_result_store_opens_its_own(
        db_url: str, table_prefix: str) -> None:
    parents = results.store_for(db_url, table_prefix)
    code = forked_exit_code(results._STORES_LOCK, lambda: results.store_for(
        db_url, table_prefix).pid == os.getpid())
    assert code == 0, "the child hung in the fork or looking up its result store"
    assert results.store_for(db_url, table_prefix) is parents
    results.close_all()


def test_a_child_forked_while_a_thread_creates_the_result_tables_stores_results(
        db_url: str, table_prefix: str) -> None:
    """The backend of the forking thread passes to the child (a prefork pool process)
    with the store it found: the parent's, whose lock a thread of the parent holds while
    it creates the tables. The child's backend uses a store of its own."""
    app = Celery("fork", broker="memory://", backend="sqlinbox+" + db_url,
                 set_as_current=False)
    app.conf.result_backend_transport_options = {"table_prefix": table_prefix}
    backend = app.backend

    def store_and_read() -> bool:
        backend.store_result("forked", 42, states.SUCCESS)
        return bool(backend.get_task_meta("forked")["result"] == 42)

    try:
        assert forked_exit_code(backend.store._lock, store_and_read) == 0, (
            "the child hung storing its result")
        assert backend.get_task_meta("forked")["result"] == 42
    finally:
        app.close()
        results.close_all()


def test_a_child_forked_while_a_thread_prepares_the_outbox_records_all_the_same(
        db_url: str, table_prefix: str) -> None:
    """The installed outbox passes to the child (its tasks publish through it); a thread
    of the parent (the republish on start) may hold the outbox's lock while it looks at
    the table."""
    app = Celery("fork", broker="memory://", set_as_current=False)
    outbox = celery_ext.install(app, db_url, table=f"{table_prefix}outbox",
                                republish_on_start=False)
    try:
        code = forked_exit_code(outbox.store._lock, lambda: bool(
            outbox.store.prepared(outbox.engine)))
        assert code == 0, "the child hung preparing the outbox's statements"
    finally:
        outbox.uninstall()
        outbox.close()
        app.close()
