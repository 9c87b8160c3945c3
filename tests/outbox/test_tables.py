"""The outbox table: declarations, a service's own table, pruning and status on every database."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from sqlalchemy import text

from celery_ext import (
    OutboxColumn,
    OutboxTable,
    OutboxTableBuilder,
    RecordFailed,
    default_outbox_table,
)
from celery_ext.declaration import as_outbox_spec
from celery_ext.outbox import PRUNE_TASK, REPUBLISH_TASK
from kombu_sqlinbox.dialects import dialect_for
from kombu_sqlinbox.errors import ConfigurationError
from tests.outbox.conftest import OutboxEnv, age


class OrdersOutbox(OutboxTable, table="orders_outbox"):
    ref = OutboxColumn("id")  # the outbox supplies a UUID
    task = OutboxColumn("task_name")
    target = OutboxColumn("exchange")
    route = OutboxColumn("routing_key")
    envelope = OutboxColumn("headers")
    props = OutboxColumn("properties")
    payload = OutboxColumn("body")
    at = OutboxColumn("created_at")
    done_at = OutboxColumn("processed_at")
    resent_at = OutboxColumn("republished_at")


def test_declarative_and_builder_forms_are_equal() -> None:
    built = (OutboxTableBuilder("orders_outbox").id("ref", generated=False).task_name("task")
             .exchange("target").routing_key("route").headers("envelope").properties("props")
             .body("payload").created_at("at").processed_at("done_at")
             .republished_at("resent_at").build())
    assert as_outbox_spec(OrdersOutbox) == built
    assert as_outbox_spec("celery_outbox") == default_outbox_table()
    assert not built.generated_id and default_outbox_table().generated_id


@pytest.mark.parametrize("build, message", [
    (lambda: OutboxTableBuilder("x").id().body().build(), "declare a column for each"),
    (lambda: OutboxTableBuilder('x"; DROP TABLE y; --'), "not a valid identifier"),
    (lambda: OutboxTableBuilder("x").body("a").headers("a"), "two roles"),
    (lambda: OutboxTableBuilder("x").id().id("other").body(), "declared twice"),
])
def test_bad_declarations_are_refused(build: Any, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        spec = build()
        if isinstance(spec, OutboxTableBuilder):
            spec.build()


def test_a_service_table_is_mapped_by_roles(any_db: OutboxEnv) -> None:
    """The service's own table, other column names, UUID ids: record, mark, republish."""
    env = any_db
    spec = dataclasses.replace(OrdersOutbox.__spec__, table=f"{env.table}_own")
    dialect = dialect_for(env.engine)
    ddl = dialect.outbox_create_ddl(spec.table, None, spec.column_names(), False)
    with env.engine.begin() as conn:
        for statement in ddl:
            conn.exec_driver_sql(statement)
    try:
        app, outbox = env.sender(declaration=spec, create_table=False)
        result = app.tasks["ob.check"].delay("own")
        with env.engine.connect() as conn:
            (ref, task) = conn.execute(text(f"SELECT ref, task FROM {spec.table}")).one()
        assert len(ref) == 32 and task == "ob.check"
        env.purge(app)
        assert outbox.republish(older_than=0).sent == 1
        with env.engine.begin() as conn:
            assert outbox.mark_processed(conn, ref)
            assert not outbox.mark_processed(conn, ref)
        assert outbox.status().processed == 1 and result.id
    finally:
        with env.engine.begin() as conn:
            conn.exec_driver_sql(f"DROP TABLE {spec.table}")


def test_a_missing_table_or_column_is_reported_with_its_ddl(rabbit_pg: OutboxEnv) -> None:
    env = rabbit_pg
    name = f"{env.table}_bad"
    app, _ = env.sender(declaration=name, create_table=False, create=False)
    with pytest.raises(RecordFailed, match=f"(?s){name}.*does not exist.*CREATE TABLE"):
        app.tasks["ob.check"].delay("never")
    with env.engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (id BIGINT PRIMARY KEY, body BYTEA)"))
    try:
        app, _ = env.sender(declaration=name, create_table=False, create=False)
        with pytest.raises(RecordFailed, match=r"(?s)column 'headers' \(role headers\) is "
                           r"missing.*ALTER TABLE"):
            app.tasks["ob.check"].delay("never")
        assert env.queue_depth(app) == 0  # a record that cannot be written stops the send
    finally:
        with env.engine.begin() as conn:
            conn.execute(text(f"DROP TABLE {name}"))


def test_prune_removes_only_processed_records_older_than_retention(any_db: OutboxEnv) -> None:
    env = any_db
    app, outbox = env.sender(retention=3600.0, batch=2)
    for key in ("old", "recent", "pending-old", "pending-new", "old2", "old3"):
        app.tasks["ob.check"].delay(key)
    ids = [r["id"] for r in env.records()]
    old, recent, pending_old, pending_new, *older = ids
    age(env, "processed_at", [old, *older], 7200)
    age(env, "processed_at", [recent], 60)
    age(env, "created_at", [pending_old], 7200)

    assert outbox.prune() == 3  # in batches of two
    assert [r["id"] for r in env.records()] == [recent, pending_old, pending_new]
    status = outbox.status()
    assert (status.unprocessed, status.processed) == (2, 1)
    assert status.oldest_unprocessed_age is not None
    assert 7000 < status.oldest_unprocessed_age < 7400
    assert outbox.prune(older_than=30) == 1  # on demand, with another age
    # the ready periodic tasks, as beat would run them
    assert app.tasks[PRUNE_TASK].apply().get() == 0
    # pending_old is past the grace
    assert app.tasks[REPUBLISH_TASK].apply().get() == {"sent": 1, "failed": [], "held": 0}
    assert {e["task"] for e in outbox.beat_schedule(republish_every=60).values()} == {
        PRUNE_TASK, REPUBLISH_TASK}


def test_default_table_is_created_once_and_checked(any_db: OutboxEnv) -> None:
    env = any_db
    env.sender()
    _, again = env.sender()  # a second start finds the table and checks it
    assert again.status().unprocessed == 0
    with env.engine.connect() as conn:
        assert conn.execute(text(f"SELECT COUNT(*) FROM {env.quote(env.table)}")).scalar() == 0
