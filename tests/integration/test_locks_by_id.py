"""The statements that name a queue's rows by id lock those rows and no other, so a claim
racing them takes the first ready rows, in order, every time.

MariaDB ran them on a small table as a scan, locking each row it read in turn, and a
claim running meanwhile passed over the row locked at that moment (``SKIP LOCKED``): a
partition key's later row then went out before its earlier one on a single worker.
Here one thread runs every such statement on rows far from the queue's head (lease
extensions, settlements, the claim's lease, an operations move's read and delete, none
of them changing a row) while claims of the first two rows run and roll back.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
from sqlalchemy import Connection, TextClause, bindparam, text
from sqlalchemy.engine import Engine

from kombu_sqlinbox import TableBuilder
from kombu_sqlinbox.broker import Broker
from kombu_sqlinbox.tables import TableSpec

from .conftest import Connect
from .support import broker_of, quoted

pytestmark = pytest.mark.databases("postgresql", "mysql")  # SQLite's writers take turns

QUEUE = "by_id"
ROWS = 120
#: claims of the queue's first two rows, each rolled back
ROUNDS = 1_500
#: an attempt no row has: the fenced statements read their rows and change none
NO_ATTEMPT = 1_000_000
#: the id table the "declared, id keyed" layout makes itself: no primary key, an index
KEYED_DDL = {
    "postgresql": "CREATE TABLE {table} (id BIGSERIAL, payload BYTEA NOT NULL, headers TEXT, "
                  "account VARCHAR(64), attempt INT NOT NULL DEFAULT 0, locked_until "
                  "TIMESTAMPTZ, available_at TIMESTAMPTZ NOT NULL DEFAULT now())",
    "mysql": "CREATE TABLE {table} (id BIGINT NOT NULL AUTO_INCREMENT, payload LONGBLOB NOT "
             "NULL, headers LONGTEXT, account VARCHAR(64), attempt INT NOT NULL DEFAULT 0, "
             "locked_until DATETIME(6) NULL, available_at DATETIME(6) NOT NULL DEFAULT "
             "(UTC_TIMESTAMP(6)), KEY {index} (id)) ENGINE=InnoDB",
}


def declared(prefix: str) -> TableSpec:
    return (TableBuilder(f"{prefix}postings").id().payload().headers()
            .partition_key("account").attempt().locked_until().available_at().build())


def statements_by_id(broker: Broker, spec: TableSpec) -> list[tuple[TextClause, dict[str, float]]]:
    """Every statement naming rows by id, with its parameters but the ids."""
    dialect = broker.dialect
    made = dialect.statements(spec)
    fenced = {"attempt": NO_ATTEMPT, "lease": 30.0, "delay": 0.0}
    found: list[tuple[TextClause, dict[str, float]]] = [
        (statement, fenced) for statement in (
            made.extend, made.retry, made.complete, made.delete, made.release,
            made.release_uncounted) if statement is not None]
    if len(made.claim) == 2:  # the claim's lease of the rows it locked
        found.append((made.claim[1], {"lease": 30.0}))
    found += [(dialect.stored_locked(spec), {}), (dialect.remove(spec), {})]
    return found


@pytest.mark.parametrize("layout", ["own", "declared", "declared, id keyed"])
def test_a_claim_never_passes_over_rows_a_statement_by_id_does_not_name(
        connect: Connect, table_prefix: str, database: str, layout: str) -> None:
    options = {}
    if layout != "own":
        options = {"queues": {QUEUE: {"table": declared(table_prefix)}}}
    conn = connect(**options)
    if layout == "declared, id keyed":
        engine = broker_of(conn).engine
        table = quoted(engine, f"{table_prefix}postings")
        with engine.begin() as db:
            db.execute(text(KEYED_DDL[database].format(
                table=table, index=quoted(engine, f"{table_prefix}postings_id"))))
    conn.default_channel.queue_declare(QUEUE)
    producer = conn.Producer()
    for n in range(ROWS):
        producer.publish({"n": n}, routing_key=QUEUE, headers={"partition_key": f"a{n % 3}"})
    broker = broker_of(conn)
    spec = broker.table(QUEUE).spec
    dialect, engine = broker.dialect, broker.engine
    table = quoted(engine, spec.table)
    with engine.connect() as db:
        ids = list(db.execute(text(f"SELECT id FROM {table} ORDER BY id")).scalars())
    assert len(ids) == ROWS
    elsewhere = ids[20::3]  # beyond any claim's candidates
    statements = statements_by_id(broker, spec)
    stop = threading.Event()
    ran = [0]
    failures: list[BaseException] = []

    def by_id() -> None:
        try:
            while not stop.is_set():
                for statement, params in statements:
                    with engine.connect() as db, db.begin() as transaction:
                        db.execute(statement, {**params, "ids": elsewhere})
                        transaction.rollback()
                    ran[0] += 1
        except BaseException as exc:  # reported by the test's thread
            failures.append(exc)

    def first_two(db: Connection) -> list[int]:
        return [row.id for row in dialect.claim(db, spec, 2, 30.0)]

    claimed = rounds_of(engine, first_two, by_id, stop)
    assert not failures, failures
    assert ran[0] >= 50, f"the statements by id ran only {ran[0]} times"
    wrong = [taken for taken in claimed if taken != ids[:2]]
    assert not wrong, (f"{len(wrong)} of {len(claimed)} claims passed over a row no "
                       f"statement named: {wrong[:5]}")


def rounds_of(engine: Engine, claim: Callable[[Connection], list[int]],
              beside: Callable[[], None], stop: threading.Event) -> list[list[int]]:
    """:data:`ROUNDS` claims, each rolled back, while ``beside`` runs on a thread."""
    thread = threading.Thread(target=beside, daemon=True)
    thread.start()
    claimed: list[list[int]] = []
    deadline = time.monotonic() + 60
    try:
        while len(claimed) < ROUNDS and time.monotonic() < deadline:
            with engine.connect() as db, db.begin() as transaction:
                claimed.append(claim(db))
                transaction.rollback()
    finally:
        stop.set()
        thread.join(30)
    return claimed


@pytest.mark.databases("mysql")
@pytest.mark.parametrize("layout", ["own", "declared"])
def test_statements_by_id_read_the_id_index_of_a_small_table(
        connect: Connect, table_prefix: str, layout: str) -> None:
    """Each one's plan reads a range of the primary key: a table of a few rows is where
    MariaDB's costs favour a scan."""
    options = {"queues": {QUEUE: {"table": declared(table_prefix)}}} if layout != "own" else {}
    conn = connect(**options)
    conn.default_channel.queue_declare(QUEUE)
    producer = conn.Producer()
    for n in range(ROWS):
        producer.publish({"n": n}, routing_key=QUEUE)
    broker = broker_of(conn)
    spec = broker.table(QUEUE).spec
    with broker.engine.begin() as db:
        table = quoted(broker.engine, spec.table)
        db.execute(text(f"ANALYZE TABLE {table}"))
        ids = list(db.execute(text(f"SELECT id FROM {table} ORDER BY id")).scalars())
        for statement, params in statements_by_id(broker, spec):
            explain = text(f"EXPLAIN {statement.text}").bindparams(
                bindparam("ids", expanding=True))
            plan = db.execute(explain, {**params, "ids": ids[20::3]}).mappings().all()
            assert [(row["type"], row["key"]) for row in plan] == [("range", "PRIMARY")], (
                statement, plan)
