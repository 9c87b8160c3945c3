"""Every statement each built-in dialect writes, for sample tables, equals the committed dump
in ``tests/unit/statements/``: a change that moves dialect code around leaves the text the
databases run as it was, and a change meant to alter a statement shows in the dump's diff.

After an intended change, write the dumps anew and review their diff::

    python -m tests.unit.test_statement_text
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import TextClause, create_engine

from celery_ext.declaration import OutboxTableBuilder, default_outbox_table
from kombu_sqlinbox import clock as clocks
from kombu_sqlinbox.dialects import Dialect, dialect_for
from kombu_sqlinbox.dialects.base import DriverSql
from kombu_sqlinbox.tables import ColumnSpec, Role, TableBuilder, TableSpec, default_table

DUMPS = Path(__file__).parent / "statements"
#: per database: a URL (never connected to) and the drivers whose own SQL is dumped
URLS = {
    "postgresql": ("postgresql+psycopg://h/db", ("psycopg", "psycopg2")),
    "mysql": ("mysql+pymysql://h/db", ("pymysql",)),
    "sqlite": ("sqlite:////tmp/sqlinbox-statements.db", ("pysqlite",)),
}
PARAMSTYLES = ("qmark", "format", "pyformat")


def specs() -> dict[str, TableSpec]:
    """Sample tables: the transport's own layout, every role (FIFO), a plain group with
    keys, the fewest roles, row mode with a declared publish statement, a long name."""
    every = (TableBuilder("jobs", schema="app").id().payload().headers().group("grp", fifo=True)
             .partition_key("pkey").attempt().locked_until().available_at().priority()
             .processed_at())
    return {
        "own": default_table("sqlinbox_celery"),
        "every_role": every.build(),
        "keys": (TableBuilder("keyed").id().payload().headers().group("grp")
                 .partition_key("pkey").attempt().locked_until().available_at().build()),
        "fewest": TableBuilder("bare").id(generated=False).payload().attempt()
        .locked_until().build(),
        "rows": (TableBuilder("orders").id().payload().attempt().locked_until()
                 .available_at().task(column="task", arguments=("customer", "total"))
                 .publish_statement("INSERT INTO orders (payload, task, customer) "
                                    "VALUES (:payload, :task_name, :customer)").build()),
        "row_columns": (TableBuilder("signups").id().payload().attempt().locked_until()
                        .available_at().task("app.signup", arguments=("email",)).build()),
        "long_name": default_table("sqlinbox_" + "x" * 54),
    }


def clause(statement: TextClause | None) -> str:
    """A statement's text and its bound parameters (type, expanding, fixed value)."""
    if statement is None:
        return "None"
    binds = []
    for name, bind in sorted(statement._bindparams.items()):
        value = "callable" if bind.callable is not None else repr(bind.value)
        binds.append(f"  :{name} {type(bind.type).__name__} expanding={bind.expanding} "
                     f"value={value}")
    return "\n".join([statement.text, *binds])


def value(found: Any) -> str:
    if isinstance(found, TextClause) or found is None:
        return clause(found)
    if isinstance(found, str):
        return found
    if isinstance(found, (tuple, list)):
        return "\n--\n".join(value(item) for item in found) or "()"
    if isinstance(found, dict):
        return "\n--\n".join(f"{key}: {value(item)}" for key, item in found.items())
    return repr(found)


def table_statements(dialect: Dialect, drivers: tuple[str, ...], spec: TableSpec
                     ) -> Iterator[tuple[str, Any]]:
    statements = dialect.statements(spec)
    for field in dataclasses.fields(statements):
        yield f"statements.{field.name}", getattr(statements, field.name)
    for paramstyle in PARAMSTYLES:
        for driver in drivers:
            rows = dialect.rows_insert(spec, paramstyle, driver)
            yield f"rows_insert[{paramstyle}, {driver}]", None if rows is None else (
                rows.sql(1), rows.sql(3), rows.names, rows.fixed, rows.max_rows, rows.arrays,
                rows.apart and (rows.apart[0].sql(1), rows.apart[0].arrays, *rows.apart[1:]))
    for name in ("claim", "complete", "extend"):
        statement = getattr(statements, name)
        first = statement[0] if isinstance(statement, tuple) else statement
        lengths = {"ids": 2} if ":ids" in first.text else {}
        yield f"driver_sql[{name}]", repr(DriverSql.of(first, "format", lengths))
        yield f"prepared[{name}]", repr(DriverSql.prepared(first, "format"))
    if spec.has(Role.HEADERS) and spec.publish is None and spec.rows is None:
        limited = dialect.limited_claim(spec, "sqlinbox_")
        for field in dataclasses.fields(limited):
            yield f"limited_claim.{field.name}", getattr(limited, field.name)
        yield "claim_taking(2)", dialect.claim_taking(spec, "sqlinbox_", 2)
    rated = dialect.rated_reads(spec)
    for field in dataclasses.fields(rated):
        yield f"rated_reads.{field.name}", getattr(rated, field.name)
    yield "create_ddl", dialect.create_ddl(spec)
    yield "index_ddl", dialect.index_ddl(spec)
    yield "index_columns", dialect.index_columns(spec)
    yield "drop_ddl", dialect.drop_ddl(spec)
    for column in spec.columns:
        yield f"add_column_ddl[{column.role.value}]", dialect.add_column_ddl(spec, column)
        yield f"alter_type_ddl[{column.role.value}]", dialect.alter_type_ddl(spec, column)
    for name in spec.row_columns:
        yield f"add_row_column_ddl[{name}]", dialect.add_row_column_ddl(spec, name)
    yield "explain", dialect.explain(spec)
    yield "explained(claim)", dialect.explained(statements.claim[0])
    yield "queue_stats", dialect.queue_stats(spec)
    yield "bounded_count", dialect.bounded_count(spec)
    yield "row_estimate", dialect.row_estimate(spec)
    yield "stored_page", dialect.stored_page(spec)
    yield "stored_locked", dialect.stored_locked(spec)
    yield "stored_one", dialect.stored_one(spec)
    yield "last_id", dialect.last_id(spec)
    yield "ready_page", dialect.ready_page(spec)
    yield "blocked_groups", dialect.blocked_groups(spec)
    if spec.has(Role.HEADERS):
        yield "keys_in_work", dialect.keys_in_work(spec)
    yield "remove", dialect.remove(spec)
    yield "restore", dialect.restore(spec)
    yield "restore_row", dialect.restore_row(spec, ["payload", "headers"])
    yield "publish_params", dialect.publish_params(spec, b"p", "{}", 3, 1.5, "g", "k",
                                                   ("t", "i"), ["c"])
    if dialect.capabilities.wakeups:
        yield "channel", dialect.channel(spec)
    if spec.publish is None and spec.rows is None:
        yield "unique_refusal", dialect.unique_refusal(spec)
        yield "unique_ddl", dialect.unique_ddl(spec)
        unique = dialect.unique_statements(spec)
        for field in dataclasses.fields(unique):
            yield f"unique_statements.{field.name}", getattr(unique, field.name)


def outbox_statements(dialect: Dialect) -> Iterator[tuple[str, Any]]:
    supplied = (OutboxTableBuilder("supplied_outbox", schema="app").id(generated=False)
                .task_id().task_name().exchange().routing_key().headers().properties().body()
                .created_at().processed_at().republished_at().build())
    for outbox in (default_outbox_table("outbox"), supplied):
        layout = (outbox.table, outbox.schema, outbox.column_names(), outbox.generated_id)
        yield f"outbox_statements[{outbox.table}]", dialect.outbox_statements(*layout)
        yield f"outbox_create_ddl[{outbox.table}]", dialect.outbox_create_ddl(*layout)
        yield f"outbox_add_column_ddl[{outbox.table}]", dialect.outbox_add_column_ddl(
            outbox.table, outbox.schema, "republished_at", "republished_at",
            outbox.generated_id)
        yield f"outbox_prune_sql[{outbox.table}]", dialect.outbox_prune_sql(
            dialect.outbox_fields(*layout[:3]))


def routing_statements(dialect: Dialect) -> Iterator[tuple[str, Any]]:
    routing = dialect.routing_statements("sqlinbox_")
    for field in dataclasses.fields(routing):
        yield f"routing.{field.name}", getattr(routing, field.name)
    yield "routing.name_columns", routing.name_columns
    yield "transient_channel", dialect.transient_channel("sqlinbox_", "celery.pidbox")


def result_statements(dialect: Dialect) -> Iterator[tuple[str, Any]]:
    results = dialect.result_statements("sqlinbox_")
    for field in dataclasses.fields(results):
        yield f"results.{field.name}", getattr(results, field.name)
    yield "result_channel", dialect.result_channel("sqlinbox_", "a-task-id")
    yield "result_limit", dialect.result_limit()


def schedule_statements(dialect: Dialect) -> Iterator[tuple[str, Any]]:
    schedules = dialect.schedule_statements("sqlinbox_")
    for field in dataclasses.fields(schedules):
        yield f"schedules.{field.name}", getattr(schedules, field.name)


def settings(dialect: Dialect) -> Iterator[tuple[str, Any]]:
    """The class-level values a dialect's statements and sessions are built from."""
    for name in ("now", "pinned_now", "eta_value", "capabilities", "lock_clause",
                 "relaxed_commit", "relaxed_session", "engine_defaults", "begin_write",
                 "autocommit_write", "autocommit_switch", "autocommit_kept",
                 "max_bind_params", "floor_time", "explain_prefix", "plan_settings",
                 "table_storage", "id_generator_ddl", "row_column_type", "transactional_ddl",
                 "name_type", "seconds_type", "body_type", "pattern_type",
                 "transient_table_kind", "seconds_param", "rare", "outbox_column_types",
                 "outbox_autocommit", "outbox_engine_options", "generated_id_type",
                 "column_types", "notify", "max_statement_bytes"):
        yield name, getattr(dialect, name)
    yield "later", dialect.later(":lease")
    yield "age", dialect.age("m")
    yield "epoch", dialect.epoch("m")
    yield "outbox_ago", dialect.outbox_ago()
    yield "quote", dialect.quote("name")
    yield "index_name", dialect.index_name(specs()["own"], "group")
    yield "outbox_index_name", dialect.outbox_index_name("outbox")
    yield "upsert", dialect.upsert("t", ["a", "b"], ["c"])
    yield "upsert(keys only)", dialect.upsert("t", ["a"], [])
    yield "delete_some", dialect.delete_some("t", "x < 1")
    yield "matches", dialect.matches(":v", "p")
    yield "name_text", dialect.name_text("c")
    column = ColumnSpec("id", Role.ID, generated=True)
    yield "column_ddl(generated id)", dialect.column_ddl(column)


def render(database: str) -> str:
    """The dump of one database's dialect: plain, with wake-ups off (where it has them),
    and with a test's clock installed."""
    url, drivers = URLS[database]
    engine = create_engine(url)
    sections = []
    for variant in ("plain", "notify off", "clock"):
        clock = clocks.install(engine.url) if variant == "clock" else None
        try:
            dialect = dialect_for(engine)
        finally:
            if clock is not None:
                clocks.uninstall(engine.url)
        if variant == "notify off":
            if not dialect.capabilities.wakeups:
                continue
            dialect.notify = False
        found: list[tuple[str, Any]] = [*settings(dialect)]
        for name, spec in specs().items():
            found += [(f"{name}: {what}", item)
                      for what, item in table_statements(dialect, drivers, spec)]
        found += [*outbox_statements(dialect), *routing_statements(dialect),
                  *result_statements(dialect), *schedule_statements(dialect),
                  *((f"{kind}.{field.name}", getattr(made, field.name))
                    for kind, made in [("key_statements", dialect.key_statements("sqlinbox_")),
                                       ("rate_statements", dialect.rate_statements("sqlinbox_")),
                                       ("throughput_statements",
                                        dialect.throughput_statements("sqlinbox_")),
                                       ("limit_statements",
                                        dialect.limit_statements("sqlinbox_"))]
                    for field in dataclasses.fields(made)),
                  ("take_slots(2)", dialect.take_slots("sqlinbox_", 2)),
                  ("steal_slots(2)", dialect.steal_slots("sqlinbox_", 2))]
        sections += [f"## {variant} | {what}\n{value(item)}\n" for what, item in found]
    return "\n".join(sections)


@pytest.mark.parametrize("database", URLS)
def test_every_statement_is_as_dumped(database: str) -> None:
    dumped = (DUMPS / f"{database}.txt").read_text()
    assert render(database) == dumped, (
        f"the statements of {database} differ from tests/unit/statements/{database}.txt; "
        "if the change is meant, run python -m tests.unit.test_statement_text and review "
        "the dump's diff")


if __name__ == "__main__":
    DUMPS.mkdir(exist_ok=True)
    for name in URLS:
        (DUMPS / f"{name}.txt").write_text(render(name))
