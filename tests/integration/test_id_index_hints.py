"""The index hints of the statements that name rows by id (MariaDB/MySQL): a declared table
whose id index has an unusual name, is ignored, lives in another schema or is renamed
while the process runs still has its messages delivered once and settled; and the
limited claim of given ids reads, and locks, only those rows."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from sqlalchemy import Connection, bindparam, text
from sqlalchemy.engine import Engine

from kombu_sqlinbox import TableBuilder
from kombu_sqlinbox.broker import Broker
from kombu_sqlinbox.brokers import close_all
from kombu_sqlinbox.tables import TableSpec

from .conftest import Connect
from .support import broker_of, count_rows, get_within, quoted, settled
from .test_locks_by_id import ROWS, rounds_of

pytestmark = pytest.mark.databases("mysql")

QUEUE = "attacked"


def declared(table: str) -> TableSpec:
    return (TableBuilder(table).id().payload().headers().partition_key("account").attempt()
            .locked_until().available_at().build())


def ddl(table: str, keys: str) -> str:
    """A MariaDB queue table with the given key clauses (``keys``)."""
    return (f"CREATE TABLE {table} (id BIGINT NOT NULL AUTO_INCREMENT, payload LONGBLOB NOT "
            "NULL, headers LONGTEXT, account VARCHAR(64), attempt INT NOT NULL DEFAULT 0, "
            "locked_until DATETIME(6) NULL, available_at DATETIME(6) NOT NULL DEFAULT "
            f"(UTC_TIMESTAMP(6)), {keys}) ENGINE=InnoDB")


def round_trip(connect: Connect, table: str, count: int = 3) -> None:
    """Publish ``count`` messages to the declared table, get and ack each one; the table
    ends empty."""
    conn = connect(queues={QUEUE: {"table": declared(table)}})
    conn.default_channel.queue_declare(QUEUE)
    for n in range(count):
        conn.Producer().publish({"n": n}, routing_key=QUEUE, headers={"partition_key": "a"})
    for n in range(count):
        message = get_within(conn, QUEUE)
        assert message.payload == {"n": n}
        message.ack()
        settled(conn)
    engine = broker_of(conn).engine
    assert count_rows(engine, table) == 0


@pytest.mark.parametrize("index", ["with space", "back`tick", "ünïcödé", "per%cent",
                                   "id:x", "Id_Upper"])
def test_a_declared_table_whose_id_index_has_an_odd_name_settles_its_messages(
        connect: Connect, table_prefix: str, engine: Engine, index: str) -> None:
    table = f"{table_prefix}odd"
    with engine.begin() as db:
        db.execute(text(ddl(quoted(engine, table),
                            f"KEY `{index.replace('`', '``')}` (id)")))
    round_trip(connect, table)


def test_acks_survive_the_id_index_renamed_after_start_up(
        connect: Connect, table_prefix: str, engine: Engine) -> None:
    """A migration renames the id's index while workers run (a DBA's rename, an ORM's
    naming convention): acknowledgements must still delete the rows."""
    table = f"{table_prefix}renamed"
    name = quoted(engine, table)
    with engine.begin() as db:
        db.execute(text(ddl(name, "KEY `ix_before` (id)")))
    conn = connect(queues={QUEUE: {"table": declared(table)}})
    conn.default_channel.queue_declare(QUEUE)
    conn.Producer().publish({"n": 0}, routing_key=QUEUE, headers={"partition_key": "a"})
    message = get_within(conn, QUEUE)
    with engine.begin() as db:
        db.execute(text(f"ALTER TABLE {name} RENAME INDEX `ix_before` TO `ix_after`"))
    message.ack()
    settled(conn)
    assert count_rows(engine, table) == 0, "the acknowledged row is still in the table"


def limited_own_table(connect: Connect, table_prefix: str) -> tuple[Broker, TableSpec]:
    """An own-layout queue with concurrency limits, :data:`ROWS` rows of three keys, its
    slots' table made."""
    conn = connect(queues={QUEUE: {"concurrency_limits": {"a": 2}}})
    conn.default_channel.queue_declare(QUEUE)
    producer = conn.Producer()
    for n in range(ROWS):
        producer.publish({"n": n}, routing_key=QUEUE, headers={"limit_key": f"a{n % 3}",
                                                               "partition_key": f"a{n % 3}"})
    broker = broker_of(conn)
    broker.limits.ensure()
    return broker, broker.table(QUEUE).spec


def among_params(spec: TableSpec, ids: list[int]) -> dict[str, Any]:
    return {"limit": 10, "floor": 0, "full": ["none"], "queue_table": spec.table,
            "most": 2, "ids": ids}


def test_a_limited_claim_by_ids_reads_the_id_index_of_a_small_table(
        connect: Connect, table_prefix: str) -> None:
    """The limited claim of given rows (a queue with both task rate limits and
    concurrency limits claims the rows its rate budget chose by id) is a locking read
    naming rows by id: it must read them through the primary key, not the claim index."""
    broker, spec = limited_own_table(connect, table_prefix)
    among = broker.dialect.limited_claim(spec, table_prefix).among
    with broker.engine.begin() as db:
        table = quoted(broker.engine, spec.table)
        db.execute(text(f"ANALYZE TABLE {table}"))
        ids = list(db.execute(text(f"SELECT id FROM {table} ORDER BY id")).scalars())
        explain = text(f"EXPLAIN {among.text}").bindparams(
            bindparam("ids", expanding=True), bindparam("full", expanding=True))
        plan = db.execute(explain, among_params(spec, ids[20::3])).mappings().all()
    outer = plan[0]
    assert (outer["type"], outer["key"]) == ("range", "PRIMARY"), plan


def test_a_claim_never_passes_over_rows_a_limited_claim_by_ids_does_not_name(
        connect: Connect, table_prefix: str) -> None:
    """As in ``test_locks_by_id.py``: the limited claim of rows far from the head (by ids),
    rolled back each time, while limited claims of the first two rows run (their locking
    read, as another worker's limited claim runs it)."""
    broker, spec = limited_own_table(connect, table_prefix)
    dialect, engine = broker.dialect, broker.engine
    reads = dialect.limited_claim(spec, table_prefix)
    among = reads.among
    with engine.connect() as db:
        ids = list(db.execute(text(
            f"SELECT id FROM {quoted(engine, spec.table)} ORDER BY id")).scalars())
    stop = threading.Event()
    failures: list[BaseException] = []

    def by_id() -> None:
        try:
            while not stop.is_set():
                with engine.connect() as db, db.begin() as transaction:
                    db.execute(among, among_params(spec, ids[20::3]))
                    transaction.rollback()
        except BaseException as exc:  # reported by the test's thread
            failures.append(exc)

    def first_two(db: Connection) -> list[int]:
        params = {**among_params(spec, []), "limit": 2}
        del params["ids"]
        return [row[0] for row in db.execute(reads.candidates, params)]

    claimed = rounds_of(engine, first_two, by_id, stop)
    assert not failures, failures
    wrong = [taken for taken in claimed if taken != ids[:2]]
    assert not wrong, (f"{len(wrong)} of {len(claimed)} claims passed over a row no "
                       f"statement named: {wrong[:5]}")


def test_a_declared_table_whose_id_index_is_ignored_settles_its_messages(
        connect: Connect, table_prefix: str, engine: Engine) -> None:
    """MariaDB's IGNORED index (10.6+) is in the table's definition, and a hint naming it
    is an error: the id index found must be one the optimizer may use."""
    table = f"{table_prefix}ignored"
    name = quoted(engine, table)
    with engine.begin() as db:
        db.execute(text(ddl(name, "PRIMARY KEY (account, id), KEY `ix_id` (id) IGNORED")))
    round_trip(connect, table)


def test_a_schema_qualified_declared_table_gets_its_id_index(
        connect: Connect, table_prefix: str, engine: Engine) -> None:
    schema = f"{table_prefix}schema"
    with engine.begin() as db:
        db.execute(text(f"CREATE DATABASE `{schema}`"))
    try:
        with engine.begin() as db:
            db.execute(text(ddl(f"`{schema}`.`jobs`", "KEY `ix_id` (id)")))
        spec = (TableBuilder("jobs", schema=schema).id().payload().headers()
                .partition_key("account").attempt().locked_until().available_at().build())
        conn = connect(queues={QUEUE: {"table": spec}})
        conn.default_channel.queue_declare(QUEUE)
        conn.Producer().publish({"n": 0}, routing_key=QUEUE, headers={"partition_key": "a"})
        message = get_within(conn, QUEUE)
        message.ack()
        settled(conn)
        broker = broker_of(conn)
        assert "FORCE INDEX (`ix_id`)" in broker.dialect.statements(
            broker.table(QUEUE).spec).complete.text
        with engine.connect() as db:
            assert db.execute(text(f"SELECT COUNT(*) FROM `{schema}`.`jobs`")).scalar_one() == 0
    finally:
        close_all()
        with engine.begin() as db:
            db.execute(text(f"DROP DATABASE `{schema}`"))
