"""Unique keys: a publish whose key a row of the queue holds writes nothing and names the
holder's task; the key is the row's, so it goes with the row (acknowledged, dead-lettered)
and, in the ``waiting`` scope, with the row's lease. The column and index are added to a
table on its first keyed publish, or refused with their DDL where the transport does not
create tables."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from celery import Celery, group
from celery.worker.request import Request
from kombu import Connection
from sqlalchemy import create_engine, text
from sqlalchemy.engine import Engine
from sqlalchemy.exc import OperationalError

from celery_ext.binding import bind
from celery_ext.unique import UniqueTask
from kombu_sqlinbox import ConfigurationError, SchemaMismatch, TableBuilder
from kombu_sqlinbox.errors import DuplicateTask
from kombu_sqlinbox.unique import MAX_KEY_LENGTH

from .conftest import Connect
from .support import (
    broker_of,
    count_rows,
    get_within,
    quoted,
    settled,
    table_of,
    wait_for,
)


def send(conn: Connection, key: object, task_id: str, queue: str = "jobs",
         **properties: object) -> None:
    """Publish a task-like message (its id in the ``id`` header) with a unique key."""
    conn.default_channel.queue_declare(queue)
    conn.Producer().publish({"id": task_id}, routing_key=queue, headers={"id": task_id},
                            unique_key=key, **properties)


def held_by(conn: Connection, key: object, task_id: str, **properties: object) -> str | None:
    """The holder's task id a keyed publish was refused for, or None when it was written."""
    try:
        send(conn, key, task_id, **properties)
    except DuplicateTask as exc:
        return exc.task_id
    return None


def test_a_second_publish_with_a_held_key_writes_nothing_and_names_the_holder(
        connect: Connect, engine: Engine, table_prefix: str) -> None:
    conn = connect()
    table = table_of("jobs", table_prefix)
    assert held_by(conn, "order-1", "first") is None
    assert held_by(conn, "order-1", "second") == "first"
    assert held_by(conn, "order-2", "third") is None, "another key is free"
    assert count_rows(engine, table) == 2
    with pytest.raises(DuplicateTask, match=r"order-1.*first"):
        send(conn, "order-1", "fourth")
    first = get_within(conn, "jobs")
    assert first.payload == {"id": "first"}
    assert held_by(conn, "order-1", "fifth") == "first", "a running task holds its key"
    first.ack()
    settled(conn)
    assert held_by(conn, "order-1", "sixth") is None, "an acknowledged row frees its key"


def test_keys_compare_byte_for_byte_whatever_they_hold(
        connect: Connect, engine: Engine, table_prefix: str) -> None:
    conn = connect()
    hostile = "k\x00'\";--\u00e9" + "x" * (MAX_KEY_LENGTH - 9)
    keys = ["Key", "key", "key ", "kéy", "ke\u0301y", hostile]
    assert [held_by(conn, key, f"t{n}") for n, key in enumerate(keys)] == [None] * len(keys)
    assert [held_by(conn, key, "again") for key in keys] == [f"t{n}" for n in range(len(keys))]
    assert count_rows(engine, table_of("jobs", table_prefix)) == len(keys)


@pytest.mark.parametrize("key", [42, b"bytes", "", "x" * (MAX_KEY_LENGTH + 1)])
def test_a_key_that_is_no_short_string_is_refused(connect: Connect, engine: Engine,
                                                  table_prefix: str, key: object) -> None:
    conn = connect()
    with pytest.raises(ConfigurationError, match="unique_key must be a non-empty string"):
        send(conn, key, "t")
    with pytest.raises(ConfigurationError, match="unique_scope must be one of"):
        send(conn, "k", "t", unique_scope="forever")
    assert count_rows(engine, table_of("jobs", table_prefix)) == 0


def test_the_waiting_scope_frees_the_key_of_a_row_under_a_lease(
        connect: Connect, engine: Engine, table_prefix: str) -> None:
    conn = connect()
    assert held_by(conn, "report", "first", unique_scope="waiting") is None
    assert held_by(conn, "report", "second", unique_scope="waiting") == "first"
    running = get_within(conn, "jobs")
    assert held_by(conn, "report", "third", unique_scope="waiting") is None
    assert held_by(conn, "report", "fourth", unique_scope="waiting") == "third"
    assert held_by(conn, "report", "fifth") == "third", "active: the waiting row holds it"
    running.ack()
    settled(conn)
    assert count_rows(engine, table_of("jobs", table_prefix)) == 1


def test_a_retry_of_the_running_task_takes_over_its_own_key(
        connect: Connect, engine: Engine, table_prefix: str) -> None:
    conn = connect()
    assert held_by(conn, "sync", "task-1") is None
    running = get_within(conn, "jobs")
    assert held_by(conn, "sync", "task-1", countdown=0) is None, "its retry is written"
    assert held_by(conn, "sync", "task-2") == "task-1", "the retry holds the key"
    running.ack()
    settled(conn)
    assert held_by(conn, "sync", "task-3") == "task-1", "the retry still waits"
    assert count_rows(engine, table_of("jobs", table_prefix)) == 1


def test_the_same_task_sent_again_while_it_waits_is_a_duplicate(connect: Connect) -> None:
    conn = connect()
    assert held_by(conn, "k", "task-1") is None
    assert held_by(conn, "k", "task-1") == "task-1"


def test_a_delayed_row_holds_its_key_until_it_has_run(
        connect: Connect, engine: Engine, table_prefix: str) -> None:
    conn = connect()
    conn.default_channel.queue_declare("jobs")
    conn.Producer().publish({"id": "later"}, routing_key="jobs", unique_key="d",
                            headers={"id": "later", "eta": "2037-01-01T00:00:00+00:00"})
    assert held_by(conn, "d", "now") == "later"


def test_a_dead_lettered_row_frees_its_key(connect: Connect, engine: Engine,
                                           table_prefix: str) -> None:
    conn = connect(queues={"jobs": {"dead_letter_queue": "jobs.dead"}})
    assert held_by(conn, "k", "first") is None
    get_within(conn, "jobs").reject(requeue=False)
    assert held_by(conn, "k", "second") is None
    assert count_rows(engine, table_of("jobs.dead", table_prefix)) == 1


def test_a_bound_publish_holds_its_key_in_the_callers_transaction(
        connect: Connect, engine: Engine, table_prefix: str) -> None:
    conn = connect()
    # the table gets its key column outside the caller's transaction (on MariaDB a
    # transaction that began before it could not read the table again)
    assert held_by(conn, "other", "first") is None
    with engine.connect() as caller:
        caller.begin()
        with bind(caller):
            conn.Producer().publish({"n": 0}, routing_key="jobs")  # held for the batch
            assert held_by(conn, "k", "rolled-back") is None
            assert held_by(conn, "k", "same-transaction") == "rolled-back"
        caller.rollback()
    assert count_rows(engine, table_of("jobs", table_prefix)) == 1
    with engine.connect() as caller:
        caller.begin()
        with bind(caller):
            assert held_by(conn, "k", "kept") is None
        caller.commit()
    assert held_by(conn, "k", "after") == "kept"


def test_an_earlier_table_gets_the_key_column_or_names_the_ddl_that_adds_it(
        connect: Connect, engine: Engine, table_prefix: str) -> None:
    made = connect()
    made.default_channel.queue_declare("jobs")  # a table made before any key
    broker = broker_of(made)
    spec = broker.table("jobs").spec
    with engine.connect() as db:
        assert not broker.dialect.has_unique(db, spec)
    refusing = connect(create_tables=False)
    with pytest.raises(SchemaMismatch, match=r"has no unique key column(.|\n)*ALTER TABLE"):
        send(refusing, "k", "t")
    assert held_by(made, "k", "t") is None
    with engine.connect() as db:
        assert broker.dialect.has_unique(db, spec)
        broker.dialect.add_unique(db, spec)  # another process's DDL, late: found done
        assert broker.dialect.has_unique(db, spec)
        assert broker.dialect.claim_plan_problem(db, spec) is None, "claims as before"
    assert held_by(refusing, "k", "t2") == "t"


def test_a_transient_queue_refuses_a_key(connect: Connect) -> None:
    conn = connect()
    conn.default_channel.queue_declare("replies", durable=False, auto_delete=True)
    with pytest.raises(ConfigurationError, match="unique keys need a queue table"):
        conn.Producer().publish({}, routing_key="replies", unique_key="k")


def test_keys_are_per_queue(connect: Connect, engine: Engine, table_prefix: str) -> None:
    conn = connect()
    assert held_by(conn, "k", "a") is None
    send(conn, "k", "b", queue="other")
    assert count_rows(engine, table_of("other", table_prefix)) == 1


@pytest.fixture
def app(broker_url: str, table_prefix: str) -> Iterator[Celery]:
    """A Celery app sending to the database under test (no worker: sends alone)."""
    made = Celery("unique", broker=broker_url, set_as_current=False)
    made.conf.update(broker_transport_options={"table_prefix": table_prefix},
                     task_default_queue="jobs")
    yield made
    made.close()


def test_a_unique_task_sent_again_returns_the_waiting_task(
        app: Celery, engine: Engine, table_prefix: str) -> None:
    @app.task(base=UniqueTask, unique="active", shared=False)
    def charge(order_id: int, amount: int = 0) -> None: ...

    @app.task(base=UniqueTask, unique="waiting", unique_key=lambda order_id: f"o{order_id}",
              unique_raise=True, shared=False)
    def refund(order_id: int) -> None: ...

    first = charge.delay(1, amount=5)
    assert charge.delay(1, amount=5).id == first.id, "the waiting task's result"
    with pytest.raises(DuplicateTask) as raised:
        charge.apply_async((1,), {"amount": 5}, unique_raise=True)
    assert raised.value.task_id == first.id
    assert charge.delay(1, amount=6).id != first.id, "other arguments, another key"
    held = refund.delay(7)
    with pytest.raises(DuplicateTask, match="'o7'"):
        refund.delay(7)
    assert refund.apply_async((7,), unique_key="custom").id != held.id
    plain = app.send_task("other.task", (1,), unique_key="same")
    with pytest.raises(DuplicateTask):
        app.send_task("other.task", (2,), unique_key="same")
    assert count_rows(engine, table_of("jobs", table_prefix)) == 5
    assert plain.id


def test_a_key_function_returning_no_string_is_refused(app: Celery) -> None:
    @app.task(base=UniqueTask, unique="active", unique_key=lambda n: n, shared=False)
    def numbered(n: int) -> None: ...

    with pytest.raises(ConfigurationError, match="unique_key must be"):
        numbered.delay(3)


def test_a_group_of_unique_tasks_queues_each_key_once(
        app: Celery, engine: Engine, table_prefix: str) -> None:
    @app.task(base=UniqueTask, unique="active", shared=False)
    def charge(order_id: int) -> None: ...

    charge.delay(1)
    result = group(charge.s(1), charge.s(2), charge.s(2), charge.s(3)).apply_async()
    assert len(result.results) == 4, "Celery's group names the ids it gave, sent or not"
    assert count_rows(engine, table_of("jobs", table_prefix)) == 3


@pytest.mark.databases("postgresql", "mysql")  # SQLite's caller holds the one write lock
def test_a_callers_snapshot_older_than_the_holder_still_names_it(
        connect: Connect, engine: Engine, table_prefix: str) -> None:
    """A caller in REPEATABLE READ whose snapshot was taken before the holder committed:
    its send is refused naming the holder (MariaDB reads the holder with a locking read;
    PostgreSQL refuses such an INSERT ... ON CONFLICT with a serialization failure)."""
    conn = connect()
    assert held_by(conn, "ready", "first") is None  # the table has its key column
    table = quoted(engine, table_of("jobs", table_prefix))
    with engine.connect().execution_options(isolation_level="REPEATABLE READ") as caller:
        caller.begin()
        caller.execute(text(f"SELECT COUNT(*) FROM {table}")).scalar_one()  # the snapshot
        assert held_by(conn, "k", "holder") is None  # committed after it
        with bind(caller):
            if engine.dialect.name == "postgresql":
                with pytest.raises(OperationalError, match="could not serialize"):
                    send(conn, "k", "late")
            else:
                assert held_by(conn, "k", "late") == "holder"
        caller.rollback()


def test_a_declared_table_keeping_processed_rows_frees_a_key_once_processed(
        connect: Connect, engine: Engine, table_prefix: str) -> None:
    """A declared table gets no column of the transport's own: the first keyed send names
    the DDL. Its processed rows hold no key (PostgreSQL, SQLite: the index leaves them out);
    MariaDB/MySQL, whose indexes are not partial, refuses keys on such a table."""
    spec = (TableBuilder(f"{table_prefix}kept").id().payload().headers().attempt()
            .locked_until().available_at().processed_at().build())
    conn = connect(queues={"kept": {"table": spec}})
    dialect = broker_of(conn).dialect
    if dialect.unique_refusal(spec) is not None:
        with pytest.raises(ConfigurationError, match="keeps processed rows"):
            send(conn, "k", "a", queue="kept")
        return
    with pytest.raises(SchemaMismatch, match="has no unique key column"):
        send(conn, "k", "a", queue="kept")
    with engine.begin() as db:
        for statement in dialect.unique_ddl(spec):
            db.exec_driver_sql(statement)
    assert held_by(conn, "k", "a", queue="kept") is None
    assert held_by(conn, "k", "b", queue="kept") == "a"
    get_within(conn, "kept").ack()
    settled(conn)
    assert held_by(conn, "k", "c", queue="kept") is None, "a processed row holds no key"
    assert count_rows(engine, spec.table) == 2


def test_a_timed_key_is_held_for_its_seconds_whatever_becomes_of_the_row(
        connect: Connect, engine: Engine, table_prefix: str) -> None:
    conn = connect()
    assert held_by(conn, "daily", "first", unique_scope=2) is None
    assert held_by(conn, "daily", "second", unique_scope=2) == "first"
    assert held_by(conn, "daily", "first", unique_scope=2) is None, "its own retry is written"
    for _ in range(2):
        get_within(conn, "jobs").ack()
    settled(conn)
    assert count_rows(engine, table_of("jobs", table_prefix)) == 0
    assert held_by(conn, "daily", "third", unique_scope=2) == "first", "the row went, the key not"
    assert held_by(conn, "daily", "fourth") is None, "a key of another scope is another key"
    wait_for(lambda: held_by(conn, "daily", "fifth", unique_scope=2) is None or None, "the key's "
             "seconds to pass", timeout=15)
    assert held_by(conn, "daily", "sixth", unique_scope=2) == "fifth"
    assert count_rows(engine, f"{table_prefix}unique_keys") == 1


@pytest.mark.parametrize("scope", [0, -1, float("nan"), float("inf"), True, "1h"])
def test_a_scope_that_is_no_number_of_seconds_is_refused(connect: Connect,
                                                         scope: object) -> None:
    with pytest.raises(ConfigurationError, match="unique_scope"):
        send(connect(), "k", "t", unique_scope=scope)


def test_the_timed_keys_table_is_named_with_its_ddl_where_tables_are_not_created(
        connect: Connect, engine: Engine, table_prefix: str) -> None:
    connect().default_channel.queue_declare("jobs")
    refusing = connect(create_tables=False)
    with pytest.raises(SchemaMismatch, match=r"unique_keys' \(timed unique keys\)(.|\n)*CREATE"):
        send(refusing, "k", "t", unique_scope=60)
    assert held_by(connect(), "k", "t", unique_scope=60) is None
    assert held_by(refusing, "k", "u", unique_scope=60) == "t"


@pytest.mark.databases("postgresql")
def test_the_timed_keys_table_another_process_makes_at_that_moment_is_used(
        connect: Connect, engine: Engine, table_prefix: str) -> None:
    """Another transaction creating the timed keys' table at the same moment: the publish's
    CREATE waits for it, then fails on PostgreSQL's duplicate type, and finds the table."""
    conn = connect()
    conn.default_channel.queue_declare("jobs")
    found: list[str | None] = []
    publisher = threading.Thread(
        target=lambda: found.append(held_by(conn, "k", "t", unique_scope=60)))
    def waiting() -> object:
        with engine.connect() as watcher:  # a new look each time: statistics are cached
            return watcher.execute(text(
                "SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                "AND query LIKE 'CREATE TABLE IF NOT EXISTS%unique_keys%'")).first()

    with engine.connect() as other:
        other.begin()
        for statement in broker_of(conn).unique.keys.ddl:
            other.exec_driver_sql(statement)
        publisher.start()
        wait_for(waiting, "the publish's CREATE to wait for the other's")
        other.commit()
    publisher.join(10)
    assert found == [None]
    assert held_by(conn, "k", "u", unique_scope=60) == "t"


def test_a_queue_deleted_and_declared_again_gets_its_key_column_again(
        connect: Connect, engine: Engine, table_prefix: str) -> None:
    conn = connect()
    assert held_by(conn, "k", "first") is None
    conn.default_channel.queue_delete("jobs")  # its table dropped, the key column with it
    assert held_by(conn, "k", "second") is None
    assert held_by(conn, "k", "third") == "second"


def test_a_bound_publish_on_another_database_is_refused_as_an_unkeyed_one_is(
        connect: Connect, engine: Engine, table_prefix: str, tmp_path: Path) -> None:
    conn = connect()
    assert held_by(conn, "other", "first") is None
    elsewhere = create_engine(f"sqlite:///{tmp_path / 'app.db'}")
    try:
        with elsewhere.connect() as caller:
            caller.begin()
            with bind(caller):
                with pytest.raises(ConfigurationError, match="one database"):
                    conn.Producer().publish({"n": 0}, routing_key="jobs")
                with pytest.raises(ConfigurationError, match="one database"):
                    send(conn, "k", "elsewhere")
            caller.rollback()
    finally:
        elsewhere.dispose()
    assert held_by(conn, "k", "here") is None
    assert count_rows(engine, table_of("jobs", table_prefix)) == 2


@pytest.mark.parametrize("unique", [None, "active"])
def test_a_retried_task_keeps_the_key_it_was_sent_with(
        app: Celery, connect: Connect, unique: str | None) -> None:
    """Celery republishes a retry from the request's execution options, which carry no
    message property: the retry must still hold the key it was sent with."""
    @app.task(base=UniqueTask, bind=True, unique=unique, shared=False)
    def sync(self: UniqueTask, account: int) -> None: ...

    sent = sync.apply_async((1,), unique_key="account-1", unique_scope="waiting")
    conn = connect()
    message = get_within(conn, "jobs")
    sync.push_request(Request(message, app=app, task=sync).request_dict, called_directly=False)
    try:
        sync.retry(countdown=60, throw=False)  # as a worker running it does
    finally:
        sync.pop_request()
    message.ack()
    settled(conn)
    with pytest.raises(DuplicateTask) as raised:
        sync.apply_async((1,), unique_key="account-1", unique_scope="waiting",
                         unique_raise=True)
    assert raised.value.task_id == sent.id, "the waiting retry holds the key"


def test_a_running_message_of_no_task_keeps_its_key_from_another_of_no_task(
        connect: Connect, engine: Engine, table_prefix: str) -> None:
    """Plain kombu messages name no task: two of them are no task and its retry."""
    conn = connect()
    conn.default_channel.queue_declare("jobs")
    conn.Producer().publish({"n": 1}, routing_key="jobs", unique_key="plain")
    running = get_within(conn, "jobs")
    with pytest.raises(DuplicateTask):
        conn.Producer().publish({"n": 2}, routing_key="jobs", unique_key="plain")
    running.ack()
    settled(conn)
    assert count_rows(engine, table_of("jobs", table_prefix)) == 0


@pytest.mark.timeout(120)
@pytest.mark.databases("postgresql", "mysql")  # SQLite adds it in the caller's transaction
def test_a_first_keyed_send_bound_to_a_transaction_holding_the_table_is_refused_in_time(
        connect: Connect, engine: Engine, table_prefix: str) -> None:
    """The column is added in a transaction of the transport's own, which waits for the
    caller's lock on the table while the caller waits for it: bounded, and named."""
    conn = connect()
    conn.default_channel.queue_declare("jobs")
    table = quoted(engine, table_of("jobs", table_prefix))
    with engine.connect() as caller:
        caller.begin()
        caller.execute(text(f"SELECT COUNT(*) FROM {table}")).scalar_one()
        with bind(caller), pytest.raises(SchemaMismatch, match=r"(?s)within 10 s.*ADD"):
            send(conn, "k", "first")
        caller.rollback()
    assert held_by(conn, "k", "second") is None
    assert held_by(conn, "k", "third") == "second"


def test_a_row_mode_table_refuses_a_key_even_with_a_headers_column(
        connect: Connect, table_prefix: str) -> None:
    """Row mode's rows are written by any code: a key on the few sent through the
    transport would hold nothing against the rest (and ``sqlinbox ddl`` gives no DDL)."""
    spec = (TableBuilder(f"{table_prefix}events").id().payload().headers().attempt()
            .locked_until().available_at().task("ev.handle").build())
    conn = connect(queues={"events": {"table": spec}})
    conn.default_channel.queue_declare("events")
    with pytest.raises(ConfigurationError, match="unique keys need a queue table"):
        send(conn, "k", "a", queue="events")
