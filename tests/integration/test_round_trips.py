"""Work that needs no transaction of its own costs no round trips for one on PostgreSQL:
a read runs alone (no BEGIN, no COMMIT), a fenced transaction begins with its settings in
one message, and a transient queue's publish and count run on the wake-up's LISTEN
connection, prepared there. Each through both drivers, with its failure
paths: a statement that fails, a connection the server closed before it, a connection
lost during it. Nothing is written twice, and every pooled connection goes back to the
pool as it came."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Iterator

import pytest
from kombu import Connection as KombuConnection
from kombu import Exchange, Queue
from sqlalchemy import Connection, create_engine, text
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError

from kombu_sqlinbox.database import Database, closed_by_server
from kombu_sqlinbox.wakeups import Wakeup

from .conftest import Connect
from .support import BACKEND, DRIVERS, broker_of, wait_for
from .test_listen_loss import backend_pid

pytestmark = pytest.mark.databases("postgresql")

FIRST_COMMAND = "SELECT statement_timestamp() = transaction_timestamp()"
REPLIES = Exchange("replies", type="direct", durable=False)


@pytest.fixture
def scratch(driver_url: str) -> Iterator[str]:
    name = f"rt_{uuid.uuid4().hex[:8]}"
    admin = create_engine(driver_url)
    with admin.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (id INTEGER PRIMARY KEY, "
                          f"later INTEGER UNIQUE DEFERRABLE INITIALLY DEFERRED)"))
    yield name
    with admin.begin() as conn:
        conn.execute(text(f"DROP TABLE {name}"))
    admin.dispose()


def ids(database: Database, table: str) -> list[int]:
    return database.run(lambda conn: [int(row[0]) for row in conn.execute(
        text(f"SELECT id FROM {table} ORDER BY id"))])


def kept_as_it_came(database: Database, table: str) -> None:
    """The pooled connection is out of autocommit and of any transaction: a run whose
    work fails after a write leaves nothing, and a durable run waits for the disk."""
    def failing(conn: Connection) -> None:
        conn.execute(text(f"INSERT INTO {table} (id) VALUES (999)"))
        raise ValueError("the work's own failure")

    with pytest.raises(ValueError):
        database.run(failing)
    assert 999 not in ids(database, table)
    assert database.run(lambda conn: conn.execute(
        text("SHOW synchronous_commit")).scalar_one()) == "on"


@DRIVERS
def test_a_read_runs_alone_and_its_connection_goes_back_as_it_came(
        pooled: Database, scratch: str) -> None:
    """A look is the first command of its transaction (no BEGIN before it), a read of
    :meth:`run` is not; a look that fails is raised, and either way the connection is
    back in the pool out of autocommit."""
    assert pooled.look(lambda conn: conn.execute(text(FIRST_COMMAND)).scalar_one())
    assert not pooled.run(lambda conn: conn.execute(text(FIRST_COMMAND)).scalar_one(),
                            read_only=True)
    kept_as_it_came(pooled, scratch)
    with pytest.raises(DBAPIError, match="does_not_exist"):
        pooled.look(lambda conn: conn.execute(text("SELECT * FROM does_not_exist")))
    kept_as_it_came(pooled, scratch)


@DRIVERS
def test_a_fenced_transaction_has_its_settings_and_commits_or_rolls_back_whole(
        pooled: Database, scratch: str) -> None:
    """Begun with its settings in one round trip: they hold in it; its writes land
    together; a statement that fails, or a COMMIT that does (a deferred constraint), takes
    every write of it back, and the connection comes back as it went."""
    def settings(conn: Connection) -> tuple[str, str]:
        conn.execute(text(f"INSERT INTO {scratch} (id) VALUES (1), (2)"))
        return (conn.execute(text("SHOW synchronous_commit")).scalar_one(),
                conn.execute(text("SHOW enable_seqscan")).scalar_one())

    assert pooled.run(settings, durable=False) == ("off", "off")
    assert ids(pooled, scratch) == [1, 2]

    def failing(conn: Connection) -> None:
        conn.execute(text(f"INSERT INTO {scratch} (id) VALUES (3)"))
        conn.execute(text("SELECT 1 / 0"))

    with pytest.raises(DBAPIError, match="division by zero"):
        pooled.run(failing, durable=False)
    kept_as_it_came(pooled, scratch)

    def failing_at_commit(conn: Connection) -> None:
        conn.execute(text(f"INSERT INTO {scratch} (id, later) VALUES (4, 7), (5, 7)"))

    with pytest.raises(DBAPIError, match="duplicate key"):
        pooled.run(failing_at_commit, durable=False)
    assert ids(pooled, scratch) == [1, 2]
    kept_as_it_came(pooled, scratch)


@DRIVERS
def test_a_fenced_transaction_whose_connection_dies_runs_again_on_a_new_one(
        pooled: Database, scratch: str) -> None:
    """The server ends the session in the middle of the work: nothing of it committed, so
    it runs again on a fresh connection, once, and only that run's write is there."""
    runs: list[int] = []

    def dying(conn: Connection) -> None:
        runs.append(int(conn.execute(text(BACKEND)).scalar_one()))
        conn.execute(text(f"INSERT INTO {scratch} (id) VALUES (:id)"), {"id": len(runs)})
        if len(runs) == 1:
            conn.execute(text("SELECT pg_terminate_backend(pg_backend_pid())"))

    pooled.run(dying, durable=False, repeatable=True)
    assert len(runs) == 2 and runs[0] != runs[1]
    assert ids(pooled, scratch) == [2]
    kept_as_it_came(pooled, scratch)


@pytest.fixture
def listening(pooled: Database) -> Iterator[Wakeup]:
    wakeup = Wakeup(pooled)
    wakeup.listen("round_trips")
    wakeup.sources()  # connects the LISTEN session
    yield wakeup
    wakeup.close()


def inserting(table: str, row: int, runs: list[int],
              then: Callable[[Connection], object] = lambda conn: None
              ) -> Callable[[Connection], None]:
    def publish(conn: Connection) -> None:
        runs.append(int(conn.execute(text(BACKEND)).scalar_one()))
        conn.execute(text(f"INSERT INTO {table} (id) VALUES (:id)"), {"id": row})
        then(conn)
    return publish


@DRIVERS
def test_a_publish_runs_on_the_listen_connection(
        pooled: Database, listening: Wakeup, scratch: str, driver: str) -> None:
    runs: list[int] = []
    listening.publish(inserting(scratch, 1, runs))
    assert runs == [backend_pid(listening, driver)]
    assert ids(pooled, scratch) == [1]


@DRIVERS
@pytest.mark.parametrize("failure", ["statement", "connection", "closed before"])
def test_a_publish_that_fails_before_its_commit_runs_again_on_the_pool(
        pooled: Database, listening: Wakeup, scratch: str, driver: str, driver_url: str,
        failure: str, caplog: pytest.LogCaptureFixture) -> None:
    """Its statement fails, its connection is lost during it, or the server had closed the
    connection before it (a restart, a terminated backend): nothing committed there, so it
    runs on the pool, once more; the LISTEN connection is dropped, and the next claim
    connects a new one."""
    listen_pid = backend_pid(listening, driver)
    if failure == "closed before":
        admin = create_engine(driver_url)
        with admin.connect() as conn:
            conn.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": listen_pid})
        admin.dispose()
        wait_for(lambda: closed_by_server(listening._listener), "the server's goodbye")
    fail = {"statement": "SELECT 1 / (pg_backend_pid() - :listen)",
            "connection": "SELECT CASE WHEN pg_backend_pid() = :listen THEN "
                          "pg_terminate_backend(:listen) END",
            "closed before": "SELECT :listen"}[failure]
    runs: list[int] = []
    with caplog.at_level(logging.WARNING, logger="kombu_sqlinbox.claims"):
        listening.publish(inserting(scratch, 1, runs, lambda conn: conn.execute(
            text(fail), {"listen": listen_pid})))
    assert "running it on the pool" in caplog.text
    assert runs[-1] != listen_pid and runs[:-1] == ([] if failure == "closed before"
                                                    else [listen_pid])
    assert ids(pooled, scratch) == [1]
    assert listening._listener is None
    listening.sources()
    assert backend_pid(listening, driver) != listen_pid


@DRIVERS
def test_a_publish_whose_commit_fails_on_the_listen_connection_is_raised_not_run_again(
        pooled: Database, listening: Wakeup, scratch: str, driver: str) -> None:
    """Its COMMIT failed (a deferred constraint here; a connection lost there alike): it
    may have landed, so it is raised, as a lost commit on the pool is, and not run
    again; the LISTEN connection is dropped and the next publish runs on a new one."""
    listen_pid = backend_pid(listening, driver)
    runs: list[int] = []

    def failing_at_commit(conn: Connection) -> None:
        runs.append(int(conn.execute(text(BACKEND)).scalar_one()))
        conn.execute(text(f"INSERT INTO {scratch} (id, later) VALUES (1, 7), (2, 7)"))

    with pytest.raises(DBAPIError, match="duplicate key"):
        listening.publish(failing_at_commit)
    assert runs == [listen_pid] and ids(pooled, scratch) == []
    assert listening._listener is None
    listening.sources()
    listening.publish(inserting(scratch, 3, runs))
    assert runs[1] not in (listen_pid,) and ids(pooled, scratch) == [3]


def test_a_transient_message_published_as_the_listen_connection_died_comes_once(
        connect: Connect, engine: Engine) -> None:
    """A consumer's LISTEN connection ends between two publishes to its reply queue: each
    message is delivered once, the one after the loss through the pool."""
    conn: KombuConnection = connect()
    queue = Queue("replies-once", REPLIES, routing_key="replies-once", durable=False,
                  auto_delete=True)
    received: list[int] = []
    with conn.Consumer([queue], callbacks=[lambda body, message: received.append(body["n"])]):
        conn.Producer().publish({"n": 1}, exchange=REPLIES, routing_key="replies-once")
        conn.drain_events(timeout=10)
        wakeup = broker_of(conn).wakeup
        listener = wakeup._listener
        with engine.connect() as admin:
            admin.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": backend_pid(
                wakeup, broker_of(conn).database.engine.driver)})
        wait_for(lambda: closed_by_server(listener), "the server's goodbye")
        conn.Producer().publish({"n": 2}, exchange=REPLIES, routing_key="replies-once")
        conn.drain_events(timeout=10)
        assert conn.default_channel.queue_declare(queue.name, passive=True).message_count == 0
    assert received == [1, 2]
