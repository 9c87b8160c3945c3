"""Checks of the schema family: a table's DDL and the checks of an existing one."""

from __future__ import annotations

from sqlalchemy import inspect

from ...tables import Role, TableBuilder
from .suite import Suite, expect, refusal


def check_ddl(suite: Suite) -> None:
    """create_ddl, ensure_table's checks, add_column_ddl, transactional_ddl."""
    dialect = suite.dialect
    spec = TableBuilder(suite.name("ddl")).id().payload().headers().priority().available_at(
        ).locked_until().attempt().group("grp").partition_key("pkey").processed_at().build()
    refused = refusal(suite, spec, "ensure_table(create=False) accepted a missing table")
    expect("does not exist" in refused, f"a missing table was reported as: {refused}")
    with suite.engine.begin() as conn:
        text_payload = dialect.ensure_table(conn, spec, create=True)
    expect(not text_payload, "ensure_table: the default payload column reads as text, not binary")
    with suite.engine.begin() as conn:
        dialect.ensure_table(conn, spec, create=False)  # the DDL's own types pass the check
    missing = TableBuilder(suite.name("ddl_missing")).id().payload().build()
    with suite.engine.begin() as conn:
        dialect.ensure_table(conn, missing, create=True)
    more = TableBuilder(missing.table).id().payload().priority().build()
    refused = refusal(suite, more, "ensure_table accepted a table lacking a declared column")
    expect("'priority'" in refused and "is missing" in refused,
           f"a missing column was reported as: {refused}")
    with suite.engine.begin() as conn:
        conn.exec_driver_sql(dialect.add_column_ddl(more, more.columns[2]))
    with suite.engine.begin() as conn:
        dialect.ensure_table(conn, more, create=False)  # the column it suggested fits
    wrong = TableBuilder(suite.name("ddl_wrong")).id().payload().attempt().build()
    columns = [dialect.column_ddl(column) for column in wrong.columns[:2]]
    columns.append(f"{dialect.quote('attempt')} {dialect.column_types[Role.LOCKED_UNTIL]}")
    with suite.engine.begin() as conn:
        conn.exec_driver_sql(f"CREATE TABLE {dialect.table_ref(wrong)} ({', '.join(columns)})")
    refused = refusal(suite, wrong, "type_problem: a time column was accepted for the attempt "
                      "role")
    expect("'attempt'" in refused, f"a wrong column type was reported as: {refused}")
    if dialect.transactional_ddl:
        rolled_back = TableBuilder(suite.name("ddl_rollback")).id().payload().build()
        with suite.engine.connect() as conn:
            conn.begin()
            for statement in dialect.create_ddl(rolled_back):
                conn.exec_driver_sql(statement)
            conn.rollback()
        with suite.engine.begin() as conn:
            expect(not inspect(conn).has_table(rolled_back.table),
                   "transactional_ddl is declared, but a CREATE TABLE rolled back stayed")
