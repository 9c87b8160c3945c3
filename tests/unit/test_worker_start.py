"""What a worker on this transport sets in itself at start-up: its blocking loop does not
wait in the prefork pool (so it answers remote control while busy), unless the user chose
otherwise, and nothing changes for the event loop or another broker; a ``celery worker``
and a worker built in Python (Celery's ``start_worker``, which sends no ``celeryd_init``)
alike."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from celery.apps.worker import Worker
from celery.contrib.testing.worker import TestWorkController
from kombu.exceptions import OperationalError as KombuOperationalError

import kombu_sqlinbox  # noqa: F401  (the start-up hook and the sqlinbox+ alias)
from kombu_sqlinbox.errors import ConfigurationError, DatabaseUnreachable
from kombu_sqlinbox.worker import ONE_LINE_MISTAKES, check_broker


def built(app: Celery, **options: Any) -> Worker:
    """A worker as ``celery worker`` builds it (its start-up signal sent), not started."""
    worker = Worker(app=app, pool_cls="prefork", concurrency=1, hostname="start@test",
                    quiet=True, without_mingle=True, without_gossip=True, **options)
    app.close()
    return worker


def started(broker: str, **conf: Any) -> Worker:
    """:func:`built` for an app with these settings."""
    app = Celery("start", broker=broker, set_as_current=False)
    app.conf.update(worker_redirect_stdouts=False, **conf)
    return built(app)


@pytest.fixture
def sqlite(tmp_path: Path) -> str:
    return f"sqlinbox+sqlite:///{tmp_path / 'broker.db'}"


def test_the_blocking_loop_takes_tasks_without_waiting_for_a_free_process(sqlite: str) -> None:
    assert started(sqlite).pool_putlocks is False


def in_python(broker: str, **options: Any) -> TestWorkController:
    """A worker as Celery's ``start_worker`` builds it (no ``celeryd_init``), not started."""
    app = Celery("start", broker=broker, set_as_current=False)
    worker = TestWorkController(app=app, pool="prefork", concurrency=1, hostname="py@test",
                                without_mingle=True, without_gossip=True, **options)
    app.close()
    return worker


def test_a_worker_built_in_python_takes_tasks_without_waiting_too(sqlite: str) -> None:
    worker = in_python(sqlite)
    assert worker.pool_putlocks is False
    assert worker.pool.putlocks is False  # what the pool it built was given


@pytest.mark.parametrize("chosen", [True, False])
def test_a_putlocks_argument_of_a_worker_built_in_python_is_kept(
        sqlite: str, chosen: bool) -> None:
    assert in_python(sqlite, pool_putlocks=chosen).pool.putlocks is chosen
    assert in_python("memory://").pool.putlocks is True


@pytest.mark.parametrize("chosen", [True, False])
def test_a_putlocks_setting_the_user_chose_is_kept(sqlite: str, chosen: bool) -> None:
    assert started(sqlite, worker_pool_putlocks=chosen).pool_putlocks is chosen


def test_a_putlocks_setting_from_a_config_object_is_kept(sqlite: str) -> None:
    app = Celery("start", broker=sqlite, set_as_current=False)

    class Config:
        worker_pool_putlocks = True
        worker_redirect_stdouts = False

    app.config_from_object(Config)
    assert built(app).pool_putlocks is True


@pytest.mark.parametrize("broker, options", [
    ("memory://", {}),
    (None, {"event_loop": True}),
])
def test_other_brokers_and_the_event_loop_keep_celerys_default(
        sqlite: str, broker: str | None, options: dict[str, Any]) -> None:
    worker = started(broker or sqlite, broker_transport_options=options)
    assert worker.pool_putlocks is True


def test_without_a_prefetch_limit_the_wait_stays(sqlite: str) -> None:
    """The pool would take in the whole queue, and a warm shutdown would run it all."""
    assert started(sqlite, worker_prefetch_multiplier=0).pool_putlocks is True
    app = Celery("start", broker=sqlite, set_as_current=False)
    assert built(app, prefetch_multiplier=0).pool_putlocks is True


def stopping_record(exc: BaseException, level: int = logging.CRITICAL,
                    name: str = "celery.worker", msg: str = "Unrecoverable error: %r"
                    ) -> logging.LogRecord:
    """The record Celery's worker logs for the error that stops it, ``exc`` raised (or
    another record of ``exc``)."""
    try:
        raise exc
    except BaseException:
        return logging.getLogger(name).makeRecord(name, level, __file__, 1, msg, (exc,),
                                                  sys.exc_info())


def test_a_bug_that_stops_a_worker_keeps_its_traceback() -> None:
    record = stopping_record(RuntimeError("a bug"))
    assert ONE_LINE_MISTAKES.filter(record)
    assert record.exc_info is not None and record.getMessage().startswith(
        "Unrecoverable error: RuntimeError")


def test_a_mistake_kombu_re_raised_is_found_behind_its_error() -> None:
    """kombu raises a connection error that ran out of retries as its own, from it."""
    try:
        try:
            raise DatabaseUnreachable("sqlinbox+sqlite:///x/q.db", "unable to open", False)
        except DatabaseUnreachable as exc:
            raise KombuOperationalError(str(exc)) from exc
    except KombuOperationalError as exc:
        record = stopping_record(exc)
    logger = logging.getLogger("celery.worker")
    level = logger.level
    logger.setLevel(logging.INFO)  # as ``celery worker -l info`` runs
    try:
        assert ONE_LINE_MISTAKES.filter(record) and record.exc_info is None
    finally:
        logger.setLevel(level)
    assert record.getMessage().startswith(
        "cannot connect to the broker database sqlinbox+sqlite:///x/q.db: unable to open\n"
        "Check that the file's directory exists")


def test_a_bug_raised_while_handling_a_mistake_keeps_its_traceback() -> None:
    try:
        try:
            raise ConfigurationError("a mistake")
        except ConfigurationError:
            raise RuntimeError("a bug in the handling") from None
    except RuntimeError as exc:
        record = stopping_record(exc)
    assert ONE_LINE_MISTAKES.filter(record) and record.exc_info is not None


def test_a_lost_connection_the_worker_retries_keeps_its_message_and_traceback() -> None:
    """Celery's consumer logs a connection lost while running as a warning, with its
    traceback, and connects again: not a stop, whatever the error."""
    lost = DatabaseUnreachable("sqlinbox+sqlite:///x/q.db", "unable to open", False)
    record = stopping_record(
        lost, logging.WARNING, "celery.worker.consumer.consumer",
        "consumer: Connection to broker lost. Trying to re-establish the connection... %r")
    assert ONE_LINE_MISTAKES.filter(record) and record.exc_info is not None
    assert record.getMessage().startswith("consumer: Connection to broker lost.")


def test_the_start_up_check_leaves_another_brokers_failover_urls_alone() -> None:
    """Query strings in failover URLs are refused for this transport only (kombu's
    failover cannot pass them on to it)."""
    other = Celery("start", broker="redis://a/0?ssl_cert_reqs=none;redis://b/0?ssl_cert_reqs=none",
                   set_as_current=False)
    check_broker(other)
    ours = Celery("start", broker="sqlinbox+sqlite:///a.db?timeout=5;sqlinbox+sqlite:///b.db",
                  set_as_current=False)
    with pytest.raises(ConfigurationError, match="no URL may have a query string"):
        check_broker(ours)


@pytest.mark.parametrize("transport", ["no_such_alias", "no.such.module:Transport",
                                       "kombu_sqlinbox.transport:NoSuchClass"])
def test_a_broker_transport_that_names_nothing_is_left_for_celery_to_refuse(
        transport: str) -> None:
    """The start-up check reads ``broker_transport`` to learn whether a plain URL is
    this transport's; one that resolves to nothing is Celery's to refuse (its own error
    names it), so the check claims none of the URLs rather than failing on its own."""
    app = Celery("start", broker="postgresql://nobody@nowhere/none", set_as_current=False)
    app.conf.broker_transport = transport
    check_broker(app)
    with pytest.raises((KeyError, ImportError, AttributeError, ValueError)):
        app.connection_for_write().connect()
