"""Checks of the outbox's statements."""

from __future__ import annotations

from sqlalchemy import text

from .suite import Suite, expect


def check_outbox(suite: Suite) -> None:
    """The outbox's statements: create, insert (generated and given ids), mark, processed,
    due, claim, unclaim, prune, status, drop."""
    dialect = suite.dialect
    columns = {role: role for role in dialect.outbox_column_types}
    record = {"task_id": "t", "task_name": "n", "exchange": "", "routing_key": "q",
              "headers": "{}", "properties": "{}", "body": b"body"}
    for generated in (True, False):
        scan = {"after": 0 if generated else "", "limit": 10}
        table = suite.name("outbox_generated" if generated else "outbox_given")
        with suite.engine.begin() as conn:
            for statement in dialect.outbox_create_ddl(table, None, columns, generated):
                conn.exec_driver_sql(statement)
        run = dialect.outbox_statements(table, None, columns, generated)
        with suite.engine.begin() as conn:
            if generated:
                first = dialect.outbox_insert(conn, run["insert"], record)
                second = dialect.outbox_insert(conn, run["insert"], record)
                expect(first is not None and second is not None and first != second,
                       f"outbox_insert returned ids {first!r}, {second!r}: not two new ids")
            else:
                first, second = "a" * 32, "b" * 32
                for given in (first, second):
                    conn.execute(run["insert"], {**record, "id": given})
        fields = dialect.outbox_fields(table, None, columns)
        with suite.engine.begin() as conn:  # written a minute ago, as far as due and status go
            conn.execute(text(f"UPDATE {fields['table']} SET {fields['created_at']} = "
                              f"{dialect.outbox_ago()}"), {"older_than": 60})
            conn.execute(run["mark"], {"id": first})
            processed = conn.execute(run["processed"], {"id": first}).scalar()
            expect(processed == 1, f"outbox processed: a marked record gave {processed}")
            due = [row[0] for row in conn.execute(run["due"], {"older_than": 30, **scan})]
            expect(due == [second], f"outbox due: got ids {due}, expected {[second]}")
            conn.execute(run["claim"], {"ids": [second]})
        with suite.engine.begin() as conn:
            due = [row[0] for row in conn.execute(run["due"], {"older_than": 30, **scan})]
            expect(due == [], "outbox claim: a claimed record is still due")
            conn.execute(run["unclaim"], {"ids": [second]})
            due = [row[0] for row in conn.execute(run["due"], {"older_than": 30, **scan})]
            expect(due == [second], "outbox unclaim: the record is not due again")
            unprocessed, done, age = conn.execute(run["status"]).one()
            expect((unprocessed, done) == (1, 1) and 30 < float(age) < 600,
                   f"outbox status gave {(unprocessed, done, age)}, expected (1, 1, about 60)")
            pruned = conn.execute(run["prune"], {"older_than": -1, "limit": 10}).rowcount
            expect(pruned == 1, f"outbox prune removed {pruned} records, expected the "
                   "processed one")
            conn.execute(run["drop"])
