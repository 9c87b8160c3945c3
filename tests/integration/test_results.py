"""The result backend (``result_backend = "sqlinbox+<database URL>"``) in this process:
states, results, extended meta, forget, groups, expiry, size limits, waiting."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from celery import Celery, states
from celery.app.task import Context
from celery.exceptions import ChordError
from celery.exceptions import TimeoutError as CeleryTimeout
from celery.result import AsyncResult, GroupResult
from kombu.utils.encoding import ensure_bytes
from sqlalchemy import text
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import OperationalError

from celery_ext.results import SqlInboxBackend
from kombu_sqlinbox import clock as clocks
from kombu_sqlinbox.errors import ConfigurationError, ResultTooLarge
from tests.tcp_proxy import Proxy

from .support import quoted

MakeApp = Callable[..., Celery]


@pytest.fixture
def make_app(db_url: str, table_prefix: str) -> Iterator[MakeApp]:
    """Celery apps whose result backend is the database under test (``conf``: more
    settings; ``options``: the backend's)."""
    made: list[Celery] = []

    def make(url: str | None = None, options: dict[str, Any] | None = None,
             **conf: Any) -> Celery:
        app = Celery("results", broker="memory://", backend=url or "sqlinbox+" + db_url,
                     set_as_current=False)
        app.conf.update(result_backend_transport_options={
            "table_prefix": table_prefix, **(options or {})}, **conf)
        made.append(app)
        return app

    yield make
    for app in made:
        app.close()


@pytest.fixture
def app(make_app: MakeApp) -> Celery:
    return make_app()


def tasks_table(engine: Engine, prefix: str) -> str:
    return quoted(engine, prefix + "task_results")


@pytest.mark.drivers
def test_states_results_and_date_done_round_trip(app: Celery) -> None:
    backend = app.backend
    assert isinstance(backend, SqlInboxBackend)
    backend.mark_as_started("t-1", pid=7)
    started = app.AsyncResult("t-1")
    assert started.state == states.STARTED and started.date_done is None
    assert started.info == {"pid": 7}
    backend.mark_as_done("t-1", {"total": 3, "items": [1, "two"]})
    done = app.AsyncResult("t-1")
    assert done.get(timeout=5) == {"total": 3, "items": [1, "two"]}
    assert done.state == states.SUCCESS
    assert abs(done.date_done - datetime.now(timezone.utc)) < timedelta(seconds=60)
    assert app.AsyncResult("never-sent").state == states.PENDING


def test_a_failure_keeps_its_exception_and_traceback(app: Celery) -> None:
    try:
        raise KeyError("order 12")
    except KeyError as exc:
        app.backend.mark_as_failure("t-2", exc, traceback="Traceback: here")
    failed = app.AsyncResult("t-2")
    with pytest.raises(KeyError, match="order 12"):
        failed.get(timeout=5)
    assert failed.state == states.FAILURE
    assert failed.traceback == "Traceback: here"


def test_a_success_is_not_replaced_by_a_later_state(app: Celery) -> None:
    app.backend.mark_as_done("t-3", "first")
    app.backend.mark_as_failure("t-3", ValueError("a second run"))
    app.backend.mark_as_done("t-3", "second")
    result = app.AsyncResult("t-3")
    assert (result.state, result.get(timeout=5)) == (states.SUCCESS, "first")


def test_extended_results_keep_the_task_its_arguments_and_worker(
        make_app: MakeApp, engine: Engine, table_prefix: str) -> None:
    app = make_app(result_extended=True)
    request = Context(task="shop.refund", args=[12], kwargs={"amount": 5}, hostname="w1@h",
                      retries=2, delivery_info={"routing_key": "refunds"})
    app.backend.mark_as_done("t-4", "refunded", request=request)
    result = app.AsyncResult("t-4")
    assert (result.name, result.args, result.kwargs) == ("shop.refund", [12], {"amount": 5})
    assert (result.worker, result.retries, result.queue) == ("w1@h", 2, "refunds")
    with engine.connect() as conn:
        row = conn.execute(text(f"SELECT task_name, worker, status FROM "
                                f"{tasks_table(engine, table_prefix)}")).one()
    assert tuple(row) == ("shop.refund", "w1@h", "SUCCESS")


def test_a_task_or_worker_name_longer_than_its_column_keeps_the_result(
        make_app: MakeApp, engine: Engine, table_prefix: str) -> None:
    """The name columns are labels (255 characters on MariaDB): a longer task or worker
    name is stored cut to fit, never failing the result's write; the result keeps the
    whole names."""
    app = make_app(result_extended=True)
    name, worker = "shop." + "n" * 400, "w@" + "h" * 400
    app.backend.mark_as_done("t-long", "ok", request=Context(task=name, hostname=worker,
                                                              args=[], kwargs={}))
    result = app.AsyncResult("t-long")
    assert (result.get(timeout=5), result.name, result.worker) == ("ok", name, worker)
    with engine.connect() as conn:
        row = conn.execute(text(f"SELECT task_name, worker FROM "
                                f"{tasks_table(engine, table_prefix)}")).one()
    assert name.startswith(row.task_name) and worker.startswith(row.worker)
    assert len(row.task_name) >= 255 and len(row.worker) >= 255


def test_forget_deletes_the_result(app: Celery, engine: Engine, table_prefix: str) -> None:
    app.backend.mark_as_done("t-5", 5)
    app.AsyncResult("t-5").forget()
    assert app.AsyncResult("t-5").state == states.PENDING
    with engine.connect() as conn:
        count = conn.execute(text(
            f"SELECT COUNT(*) FROM {tasks_table(engine, table_prefix)}")).scalar_one()
    assert count == 0


def test_a_saved_group_is_restored_and_deleted(app: Celery) -> None:
    for task_id, value in (("g-a", 1), ("g-b", 2)):
        app.backend.mark_as_done(task_id, value)
    saved = GroupResult("group-1", [AsyncResult("g-a", app=app), AsyncResult("g-b", app=app)],
                        app=app)
    saved.save()
    restored = GroupResult.restore("group-1", app=app)
    assert restored is not None
    assert [child.id for child in restored.results] == ["g-a", "g-b"]
    assert restored.join(timeout=5) == [1, 2]
    restored.delete()
    assert GroupResult.restore("group-1", app=app) is None


def test_cleanup_deletes_what_expired_in_batches(
        make_app: MakeApp, engine: Engine, table_prefix: str) -> None:
    """Results and groups done, and chords' counter rows saved, longer than
    ``result_expires`` ago go, a few rows per transaction; fresh ones stay."""
    clock = clocks.install(make_url(str(engine.url)))
    try:
        app = make_app(options={"cleanup_batch": 2}, result_expires=3600)
        clock.pin(time.time() - 7200)
        for n in range(5):
            app.backend.mark_as_done(f"old-{n}", n)
        GroupResult("old-group", [AsyncResult("old-0", app=app)], app=app).save()
        app.backend.store.save_chord("old-chord", b"{}")
        clock.release()
        app.backend.mark_as_done("fresh", "kept")
        app.backend.store.save_chord("fresh-chord", b"{}")
        assert app.backend.store.expire(3600, batch=2) == 7
        chords = engine.dialect.identifier_preparer.quote(table_prefix + "chords")
        with engine.connect() as conn:
            kept = [row[0] for row in conn.execute(text(f"SELECT group_id FROM {chords}"))]
        assert [key if isinstance(key, str) else key.decode() for key in kept] == [
            "fresh-chord"]
        assert app.AsyncResult("fresh").get(timeout=5) == "kept"
        assert [app.AsyncResult(f"old-{n}").state for n in range(5)] == [states.PENDING] * 5
        assert GroupResult.restore("old-group", app=app) is None
    finally:
        clocks.uninstall(make_url(str(engine.url)))


def test_backend_cleanup_runs_the_backends_cleanup(
        make_app: MakeApp, engine: Engine, table_prefix: str) -> None:
    """Celery's ``celery.backend_cleanup`` task (which beat runs daily) deletes what
    ``result_expires`` let expire: a finished task's result, and the last state of a task
    that never finished (its worker died while it was started or waiting to retry)."""
    app = make_app(result_expires=60)
    app.backend.mark_as_done("expired", 1)
    app.backend.store_result("started", None, states.STARTED)
    app.backend.store_result("retrying", None, states.RETRY)
    app.backend.mark_as_done("recent", 2)
    app.backend.store_result("running", None, states.STARTED)
    with engine.begin() as conn:
        conn.execute(text(f"UPDATE {tasks_table(engine, table_prefix)} "
                          "SET date_done = date_done - 3600 WHERE task_id IN "
                          "('expired', 'started', 'retrying')"))
    app.tasks["celery.backend_cleanup"]()
    for task_id in ("expired", "started", "retrying"):
        assert app.AsyncResult(task_id).state == states.PENDING
    assert app.AsyncResult("recent").state == states.SUCCESS
    assert app.AsyncResult("running").state == states.STARTED
    assert app.AsyncResult("running").date_done is None  # shown once it has finished


def test_a_result_over_the_size_limit_is_refused_saying_so(make_app: MakeApp) -> None:
    app = make_app(options={"max_result_bytes": 1000})
    with pytest.raises(ResultTooLarge, match=r"task big: its result takes \d+ bytes encoded, "
                       r"more than the result table \S+task_results stores \(1000 bytes: "
                       r"the result backend's max_result_bytes option\)"):
        app.backend.mark_as_done("big", "x" * 2000)
    app.backend.mark_as_done("small", "x" * 500)
    assert app.AsyncResult("small").get(timeout=5) == "x" * 500


@pytest.mark.databases("mysql")
def test_a_result_over_the_servers_packet_limit_is_refused_before_it_is_sent(
        app: Celery, engine: Engine) -> None:
    with engine.connect() as conn:
        packet = int(conn.exec_driver_sql("SELECT @@max_allowed_packet").scalar_one())
    with pytest.raises(ResultTooLarge, match="max_allowed_packet"):
        app.backend.mark_as_done("huge", "x" * packet)


@pytest.mark.databases("mysql")
def test_a_result_whose_escapes_overflow_the_packet_is_refused_not_sent(
        app: Celery, engine: Engine) -> None:
    """The driver puts a bound value in the statement's text (PyMySQL in hex, twice its
    size; mysqlclient escaping quotes, backslashes and newlines as two bytes): a result
    under max_allowed_packet as encoded but over it as sent is refused with
    ResultTooLarge, not sent for the server to drop the connection; one that fits as
    sent is stored."""
    with engine.connect() as conn:
        packet = int(conn.exec_driver_sql("SELECT @@max_allowed_packet").scalar_one())
    quotes = '"' * (packet // 3)  # JSON: 2 bytes each; sent: 4
    assert len(ensure_bytes(app.backend.encode({"result": quotes}))) < packet - 65536
    with pytest.raises(ResultTooLarge, match="max_allowed_packet"):
        app.backend.mark_as_done("escaped", quotes)
    fits = "x" * (packet // 2 - 65536)  # sent: at most twice
    app.backend.mark_as_done("fits", fits)
    assert app.AsyncResult("fits").get(timeout=30) == fits


def test_without_create_tables_a_missing_table_is_an_error_giving_the_ddl(
        make_app: MakeApp, table_prefix: str) -> None:
    app = make_app(options={"create_tables": False})
    with pytest.raises(ConfigurationError, match=(
            rf"the result tables {table_prefix}task_results, {table_prefix}group_results, "
            rf"{table_prefix}chords, {table_prefix}chord_parts do not exist \(create_tables "
            r"is off\); create them "
            r"with:\nCREATE TABLE")):
        app.backend.mark_as_done("t-6", 1)


@pytest.mark.databases("postgresql")
def test_the_postgres_spelling_of_a_url_reaches_postgresql(
        make_app: MakeApp, db_url: str) -> None:
    url = make_url(db_url).set(drivername="postgres").render_as_string(hide_password=False)
    app = make_app(url="sqlinbox+" + url)
    app.backend.mark_as_done("t-7", "spelt")
    assert app.AsyncResult("t-7").get(timeout=5) == "spelt"


def test_get_returns_soon_after_the_result_is_stored_not_at_its_interval(app: Celery) -> None:
    """The result is stored once ``get()`` waits (its first round): it returns at the
    NOTIFY (PostgreSQL), the same-host signal (SQLite) or an early poll (MariaDB), well
    before the 30 s interval it would otherwise sleep."""
    stored: list[float] = []

    def store_once() -> None:
        if not stored:
            app.backend.mark_as_done("t-8", "woken")
            stored.append(time.monotonic())

    assert app.AsyncResult("t-8").get(timeout=20, interval=30, on_interval=store_once) == "woken"
    assert time.monotonic() - stored[0] < 2.0


def test_get_raises_a_parents_failure_stored_in_the_round_its_own_result_came(
        app: Celery) -> None:
    """A chord's body failed with a ChordError just after its header task failed, both
    in one round of ``get()``: ``get()`` checks the parents after the read finding the
    body's result too (as with Celery's Redis backend), so it raises the header task's
    own error, not the ChordError."""
    def fail_both(*_: Any) -> None:
        if app.backend.get_state("t-13") == states.PENDING:
            app.backend.mark_as_failure("t-12", ValueError("card declined"))
            app.backend.mark_as_failure("t-13", ChordError("Dependency t-12 raised"))

    body = AsyncResult("t-13", app=app, parent=AsyncResult("t-12", app=app))
    with pytest.raises(ValueError, match="card declined"):
        body.get(timeout=20, interval=30, on_interval=fail_both)


def test_get_gives_up_at_its_timeout(app: Celery) -> None:
    started = time.monotonic()
    with pytest.raises(CeleryTimeout):
        app.AsyncResult("t-9").get(timeout=0.5, interval=30)
    assert 0.5 <= time.monotonic() - started < 3.0


@pytest.mark.databases("mysql", "sqlite")
def test_a_result_no_signal_announces_is_found_by_polling(app: Celery, engine: Engine) -> None:
    """A worker on another host reaches no same-host signal: its result, written here
    straight into the table, is found by the waiter's polls, soon, not at the interval."""
    stored: list[float] = []
    meta = ensure_bytes(app.backend.encode({"status": states.SUCCESS, "result": "polled",
                                            "traceback": None, "children": [],
                                            "task_id": "t-10"}))

    def write_unannounced() -> None:
        if not stored:
            with engine.begin() as conn:
                conn.execute(app.backend.store.sql.store, {
                    "task_id": "t-10", "status": states.SUCCESS, "meta": meta, "ready": 1,
                    "task_name": None, "worker": None})
            stored.append(time.monotonic())

    result = app.AsyncResult("t-10")
    assert result.get(timeout=20, interval=30, on_interval=write_unannounced) == "polled"
    assert time.monotonic() - stored[0] < 2.0


@pytest.mark.databases("postgresql")
def test_a_waiter_whose_listen_connection_dies_still_gets_the_result(
        app: Celery, engine: Engine) -> None:
    """The server ends the waiter's LISTEN session while it waits: the wait notices the
    dead socket, reads the row again, and connects again for the next wait."""
    ended: list[float] = []

    def end_the_listener_then_store() -> None:
        if not ended:
            (waiter,) = app.backend.store._waiters
            pid = waiter._own.driver.info.backend_pid
            with engine.begin() as conn:
                conn.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
            app.backend.mark_as_done("t-11", "after the loss")
            ended.append(time.monotonic())

    result = app.AsyncResult("t-11")
    assert result.get(timeout=20, interval=30,
                      on_interval=end_the_listener_then_store) == "after the loss"
    assert time.monotonic() - ended[0] < 2.0
    app.backend.mark_as_done("t-12", "listening again")
    assert app.AsyncResult("t-12").get(timeout=5, interval=30) == "listening again"


def test_join_native_reads_a_groups_results_in_order_and_gives_up_at_its_timeout(
        app: Celery) -> None:
    """``join_native()`` returns the results in the group's order whatever order they
    were stored in; with one never stored it raises Celery's TimeoutError at its
    timeout, not at its interval's multiple."""
    for task_id, value in (("j-2", 2), ("j-0", 0), ("j-1", 1)):
        app.backend.mark_as_done(task_id, value)
    results = [AsyncResult(f"j-{n}", app=app) for n in range(3)]
    assert GroupResult("joined", results, app=app).join_native(timeout=5) == [0, 1, 2]
    pending = GroupResult("pending", [*results, AsyncResult("j-never", app=app)], app=app)
    started = time.monotonic()
    with pytest.raises(CeleryTimeout):
        pending.join_native(timeout=0.3, interval=5)
    assert time.monotonic() - started < 2


def test_with_another_broker_a_chord_runs_through_chord_unlock(
        app: Celery, engine: Engine, table_prefix: str) -> None:
    """Counting in SQL needs the broker on the results' database (its body is published
    in the counting transaction): with another broker Celery's chord_unlock runs it, and
    ``add_to_chord`` is Celery's NotImplementedError, as with any backend but Redis."""
    from celery import chord
    from celery.signals import before_task_publish

    names: list[str] = []

    def seen(headers: Any = None, **_: Any) -> None:
        names.append(str((headers or {}).get("task")))

    @app.task(name="results.add")
    def add(x: int, y: int) -> int:
        return x + y

    before_task_publish.connect(seen, weak=False)
    try:
        chord([add.s(1, 1), add.s(2, 2)])(add.s(0))
    finally:
        before_task_publish.disconnect(seen)
    assert "celery.chord_unlock" in names
    with pytest.raises(NotImplementedError, match="add_to_chord"):
        app.backend.add_to_chord("some chord", app.AsyncResult("added"))
    app.backend.store.ensure()
    with engine.connect() as conn:
        assert conn.execute(text(
            f"SELECT COUNT(*) FROM {quoted(engine, table_prefix + 'chords')}")).scalar_one() == 0


@pytest.mark.databases("postgresql")
def test_threads_that_waited_leave_at_most_a_few_listen_connections_open(
        app: Celery, engine: Engine, table_prefix: str) -> None:
    """A web server's threads come and go: each ``get()`` borrows a LISTEN connection
    for its wait, and no more than IDLE_WAITERS stay open once the threads have
    ended (one per thread ever used would run the server out of connections)."""
    import threading

    from kombu_sqlinbox.results import IDLE_WAITERS

    ids = [f"w-{n}" for n in range(IDLE_WAITERS + 4)]
    waiting = [threading.Thread(target=app.AsyncResult(task_id).get,
                                kwargs={"timeout": 20, "interval": 0.05}) for task_id in ids]
    for thread in waiting:
        thread.start()
    for task_id in ids:
        app.backend.mark_as_done(task_id, task_id)
    for thread in waiting:
        thread.join(25)
    channels = [app.backend.store.dialect.result_channel(table_prefix, task_id)
                for task_id in ids]
    with engine.connect() as conn:
        sessions = [row[0] for row in conn.execute(text(
            "SELECT query FROM pg_stat_activity WHERE query LIKE 'UNLISTEN %'"))]
    assert not any(thread.is_alive() for thread in waiting)
    assert sum(1 for query in sessions
               if any(channel in query for channel in channels)) <= IDLE_WAITERS


@pytest.mark.databases("postgresql", "mysql")
@pytest.mark.drivers
def test_get_waits_through_a_lost_connection_to_the_database(
        make_app: MakeApp, app: Celery, proxy: Proxy, db_url: str) -> None:
    """The caller's connections to the database are cut, and new ones refused, as
    ``get()`` waits, the result stored meanwhile: the read that fails is logged, and
    ``get()`` reads again and returns the result once the database answers (it raised
    the driver's error at once)."""
    cut = make_app(url="sqlinbox+" + proxy.url(db_url))
    cut.backend.store.ensure()
    refusing = contextlib.ExitStack()
    failed: list[str] = []

    class EndTheCut(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "reading the result of t-13 failed" in record.getMessage():
                failed.append(record.getMessage())
                refusing.close()

    def cut_then_store() -> None:
        refusing.enter_context(proxy.refuse())
        app.backend.mark_as_done("t-13", "after the cut")

    handler = EndTheCut()
    logging.getLogger("kombu_sqlinbox.results").addHandler(handler)
    try:
        with refusing:
            assert cut.AsyncResult("t-13").get(timeout=20, interval=0.05,
                                               on_interval=cut_then_store) == "after the cut"
    finally:
        logging.getLogger("kombu_sqlinbox.results").removeHandler(handler)
    assert len(failed) == 1


@pytest.mark.databases("postgresql", "mysql")
def test_get_raises_the_connection_error_at_its_timeout_when_the_database_stays_away(
        make_app: MakeApp, proxy: Proxy, db_url: str) -> None:
    cut = make_app(url="sqlinbox+" + proxy.url(db_url))
    cut.backend.store.ensure()
    with proxy.refuse():
        started = time.monotonic()
        with pytest.raises(OperationalError):
            cut.AsyncResult("t-14").get(timeout=1.5, interval=0.05)
    assert 1.5 <= time.monotonic() - started < 6
