"""Where the round trips of reads alone, of the relaxed BEGIN and of transient work on the
LISTEN connection meet the worst: a BaseException or a dead backend at each step (the
pool's connection comes back as it went), a connection cut after its COMMIT's reply (no
message written twice), an interrupt mid-statement, a wake-up closed under a channel,
threads racing on one LISTEN connection, a bound caller's transaction, prepared
statements whose table is made again, a registry row lock, and MariaDB's and SQLite's
paths as they were."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from kombu import Connection as KombuConnection
from kombu import Exchange, Queue
from sqlalchemy import Connection, create_engine, text
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import DBAPIError

from kombu_sqlinbox.database import Database, closed_by_server
from kombu_sqlinbox.wakeups import Wakeup

from .conftest import Connect, connections
from .support import BACKEND, DRIVERS, broker_of, wait_for
from .test_listen_loss import backend_pid
from .test_round_trips import REPLIES


@pytest.fixture
def admin(driver_url: str) -> Iterator[Engine]:
    made = create_engine(driver_url, isolation_level="AUTOCOMMIT")
    yield made
    made.dispose()


@pytest.fixture
def connect_driver(driver_url: str, table_prefix: str) -> Iterator[Connect]:
    """kombu connections through the chosen PostgreSQL driver."""
    yield from connections("sqlinbox+" + driver_url, table_prefix)


def terminate(admin: Engine, pid: int) -> None:
    with admin.connect() as conn:
        conn.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
        wait_for(lambda: conn.execute(text(
            "SELECT count(*) = 0 FROM pg_stat_activity WHERE pid = :pid"),
            {"pid": pid}).scalar_one(), "the backend gone")


def pool_state(database: Database) -> tuple[bool, int, str, str]:
    """The pooled connection as the next checkout gets it: driver autocommit, the server's
    transaction status, and the session's synchronous_commit and enable_seqscan."""
    with database.engine.connect() as conn:
        driver: Any = conn.connection.dbapi_connection
        autocommit, status = bool(driver.autocommit), int(driver.info.transaction_status)
        sync = str(conn.exec_driver_sql("SHOW synchronous_commit").scalar_one())
        seqscan = str(conn.exec_driver_sql("SHOW enable_seqscan").scalar_one())
        conn.rollback()
    return autocommit, status, sync, seqscan


CLEAN = (False, 0, "on", "on")


# -- pool hygiene --------------------------------------------------------------------------
@pytest.mark.databases("postgresql")
@DRIVERS
@pytest.mark.parametrize("how", ["look", "relaxed"])
def test_a_base_exception_in_work_leaves_the_pooled_connection_clean(
        pooled: Database, how: str) -> None:
    """KeyboardInterrupt (a BaseException) raised by the work itself."""
    def work(conn: Connection) -> None:
        conn.exec_driver_sql("SELECT 1")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        if how == "look":
            pooled.look(work)
        else:
            pooled.run(work, durable=False)
    assert pool_state(pooled) == CLEAN


@pytest.mark.databases("postgresql")
@DRIVERS
@pytest.mark.parametrize("how", ["look", "relaxed"])
def test_a_backend_terminated_between_checkouts_is_replaced_and_the_pool_stays_clean(
        pooled: Database, admin: Engine, how: str) -> None:
    """As a server restart between two checkouts: the pooled connection is dead when the
    next look/relaxed run takes it; the work runs once on a new one."""
    pid = pooled.run(lambda conn: int(conn.exec_driver_sql(BACKEND).scalar_one()))
    terminate(admin, pid)
    runs: list[int] = []

    def work(conn: Connection) -> int:
        runs.append(int(conn.exec_driver_sql(BACKEND).scalar_one()))
        return runs[-1]

    got = pooled.look(work) if how == "look" else pooled.run(work, durable=False)
    assert got != pid and runs == [got]
    assert pool_state(pooled) == CLEAN


@pytest.mark.databases("postgresql")
@DRIVERS
def test_a_look_whose_connection_dies_mid_work_runs_again_and_leaves_the_pool_clean(
        pooled: Database) -> None:
    runs: list[int] = []

    def work(conn: Connection) -> int:
        runs.append(int(conn.exec_driver_sql(BACKEND).scalar_one()))
        if len(runs) == 1:
            conn.exec_driver_sql("SELECT pg_terminate_backend(pg_backend_pid())")
        return runs[-1]

    assert pooled.look(work) == runs[-1] and len(runs) == 2 and runs[0] != runs[1]
    assert pool_state(pooled) == CLEAN


@pytest.mark.databases("postgresql")
@DRIVERS
def test_relaxed_settings_never_leak_into_the_session(pooled: Database) -> None:
    """set_config(..., true) is local to the relaxed transaction, also when its COMMIT
    fails, and when its work was a failed statement."""
    pooled.run(lambda conn: conn.exec_driver_sql("SELECT 1"), durable=False)
    assert pool_state(pooled) == CLEAN
    with pytest.raises(DBAPIError, match="division by zero"):
        pooled.run(lambda conn: conn.exec_driver_sql("SELECT 1/0"), durable=False)
    assert pool_state(pooled) == CLEAN


@pytest.mark.databases("postgresql")
@DRIVERS
def test_many_relaxed_runs_survive_a_driver_that_prepares(pooled: Database) -> None:
    """psycopg 3 prepares a query from its fifth run: the BEGIN and its settings (two
    statements in one message) must never be prepared."""
    for _ in range(12):
        assert pooled.run(lambda conn: conn.exec_driver_sql(
            "SHOW synchronous_commit").scalar_one(), durable=False) == "off"
        assert pooled.look(lambda conn: conn.exec_driver_sql("SELECT 1").scalar_one()) == 1
    assert pool_state(pooled) == CLEAN


# -- the wake-up closed --------------------------------------------------------------------
@pytest.mark.databases("postgresql")
@DRIVERS
def test_a_closed_wakeup_opens_no_listen_connection_for_a_publish(
        pooled: Database, admin: Engine, driver: str) -> None:
    """A channel may outlive its broker and publish on (see :meth:`Wakeup.poke`): its
    transient publishes must not open a LISTEN connection nobody will ever close."""
    wakeup = Wakeup(pooled)
    wakeup.listen(f"rt_{uuid.uuid4().hex[:8]}")
    wakeup.sources()
    assert wakeup._listener is not None
    wakeup.close()
    runs: list[int] = []
    wakeup.publish(lambda conn: runs.append(int(conn.exec_driver_sql(BACKEND).scalar_one())))
    leaked = wakeup._listener
    try:
        assert leaked is None, "the closed wake-up connected a LISTEN session again"
    finally:
        if leaked is not None:
            leaked.close()


# -- SQLite: a count takes no write lock ---------------------------------------------------
@pytest.mark.parametrize("database", ["sqlite"], indirect=True)
def test_sqlite_counting_a_transient_queue_does_not_wait_for_the_write_lock(
        connect: Connect, db_url: str) -> None:
    """queue_declare of a transient queue (every reply queue) counts its messages: a read,
    which under WAL never waits for another connection's write transaction."""
    conn = connect()
    queue = Queue("counted", REPLIES, routing_key="counted", durable=False, auto_delete=True)
    queue(conn.default_channel).declare()
    path = make_url(db_url).database
    assert path
    writer = sqlite3.connect(path, isolation_level=None, timeout=30)
    writer.execute("BEGIN IMMEDIATE")  # another process's transaction holds the write lock
    result: list[Any] = []

    def count() -> None:
        try:
            result.append(conn.default_channel.queue_declare(queue.name, passive=True))
        except Exception as exc:
            result.append(exc)

    counter = threading.Thread(target=count, daemon=True)
    counter.start()
    counter.join(3)
    waited = counter.is_alive()
    writer.execute("ROLLBACK")
    writer.close()
    counter.join(40)
    assert not waited, "the count waited for another connection's write lock"
    assert not isinstance(result[0], Exception), result


@pytest.mark.databases("postgresql")
@DRIVERS
def test_a_channel_that_outlives_its_broker_leaks_no_listen_session(
        connect_driver: Connect, admin: Engine, driver: str) -> None:
    """close_all() (a test's end, a worker's shutdown) closes the broker while a kombu
    channel still publishes to a transient queue: no LISTEN session is opened again."""
    from kombu_sqlinbox.brokers import close_all

    conn = connect_driver()
    queue = Queue("outlived", REPLIES, routing_key="outlived", durable=False,
                  auto_delete=True)
    with conn.Consumer([queue], callbacks=[lambda body, message: None]):
        conn.Producer().publish({"n": 1}, exchange=REPLIES, routing_key="outlived")
        conn.drain_events(timeout=10)
        broker = broker_of(conn)
        closed = backend_pid(broker.wakeup, driver)
        close_all()
        with admin.connect() as db:
            wait_for(lambda: db.execute(text(
                "SELECT count(*) = 0 FROM pg_stat_activity WHERE pid = :pid"),
                {"pid": closed}).scalar_one(), "its LISTEN session closed")
        conn.Producer().publish({"n": 2}, exchange=REPLIES, routing_key="outlived")
        leaked = broker.wakeup._listener
        try:
            assert leaked is None, (
                f"a LISTEN session opened after close: {backend_pid(broker.wakeup, driver)}")
        finally:
            if leaked is not None:
                leaked.close()


# -- threads on one process's LISTEN connection --------------------------------------------
@pytest.mark.databases("postgresql")
@DRIVERS
def test_threads_publishing_declaring_and_counting_beside_a_consumer(
        connect_driver: Connect, caplog: pytest.LogCaptureFixture) -> None:
    """A consumer claims a transient queue on the LISTEN connection while other threads of
    the process (Celery's event dispatcher, inspect calls) publish to it, declare, count and
    delete reply queues of their own: every message comes once, nothing fails."""
    import logging

    threads, each = 4, 40
    consumer = connect_driver()
    queue = Queue("events", REPLIES, routing_key="events", durable=False, auto_delete=True)
    received: list[tuple[int, int]] = []
    errors: list[BaseException] = []

    def publisher(n: int) -> None:
        try:
            conn = connect_driver()
            producer = conn.Producer()
            channel = conn.default_channel
            REPLIES(channel).declare()
            for i in range(each):
                reply = f"reply-{n}-{i}"
                channel.queue_declare(reply, durable=False, auto_delete=True,
                                      arguments={"x-expires": 10000})
                channel.queue_bind(reply, REPLIES.name, routing_key=reply)
                assert channel.queue_declare(reply, passive=True).message_count == 0
                producer.publish({"n": n, "i": i}, exchange=REPLIES, routing_key="events")
                channel.queue_delete(reply)
        except BaseException as exc:
            errors.append(exc)

    with caplog.at_level(logging.WARNING, logger="kombu_sqlinbox"), consumer.Consumer(
            [queue], callbacks=[lambda body, message: received.append((body["n"], body["i"]))]):
        workers = [threading.Thread(target=publisher, args=(n,), daemon=True)
                   for n in range(threads)]
        for worker in workers:
            worker.start()
        deadline = time.monotonic() + 60
        while len(received) < threads * each and time.monotonic() < deadline:
            try:
                consumer.drain_events(timeout=1)
            except TimeoutError:
                if errors:
                    break
        for worker in workers:
            worker.join(30)
    assert not errors, errors
    assert sorted(received) == sorted((n, i) for n in range(threads) for i in range(each))
    failed = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not failed, failed[:5]


# -- a bound caller's transaction ----------------------------------------------------------
def transient_rows(admin: Engine, prefix: str, queue: str) -> int:
    with admin.connect() as conn:
        return int(conn.execute(text(f"SELECT count(*) FROM {prefix}transient WHERE queue = :q"),
                                {"q": queue}).scalar_one())


@pytest.mark.databases("postgresql")
@DRIVERS
@pytest.mark.parametrize("ending", ["commit", "rollback"])
def test_a_bound_caller_sees_its_transient_publish_and_nobody_else_does_before_commit(
        connect_driver: Connect, driver_url: str, admin: Engine, table_prefix: str,
        ending: str) -> None:
    """Published and counted inside celery_ext.bind: the caller's count sees its own row,
    another connection sees none until the commit, and a rollback leaves none. The
    consumer of the queue is in this process (the LISTEN connection is up)."""
    from celery_ext import bind

    consumer = connect_driver()
    queue = Queue("bound", REPLIES, routing_key="bound", durable=False, auto_delete=True)
    with consumer.Consumer([queue], callbacks=[lambda body, message: None]):
        broker = broker_of(consumer)
        broker.wakeup.sources()
        assert broker.wakeup._listener is not None
        publisher = connect_driver()
        REPLIES(publisher.default_channel).declare()
        caller_engine = create_engine(driver_url)
        try:
            with caller_engine.connect() as caller:
                caller.begin()
                with bind(caller):
                    publisher.Producer().publish({"n": 1}, exchange=REPLIES, routing_key="bound")
                    counted = publisher.default_channel.queue_declare(
                        "bound", passive=True).message_count
                    # a reply queue declared in the caller's transaction
                    publisher.default_channel.queue_declare(
                        "bound-reply", durable=False, auto_delete=True)
                assert counted == 1
                assert transient_rows(admin, table_prefix, "bound") == 0
                with admin.connect() as other:
                    assert other.execute(text(
                        f"SELECT count(*) FROM {table_prefix}queues WHERE name = 'bound-reply'"
                    )).scalar_one() == 0
                getattr(caller, ending)()
            assert transient_rows(admin, table_prefix, "bound") == (ending == "commit")
        finally:
            caller_engine.dispose()


# -- prepared statements on the LISTEN session ---------------------------------------------
@pytest.fixture
def listening(pooled: Database) -> Iterator[Wakeup]:
    wakeup = Wakeup(pooled)
    wakeup.listen(f"rt_{uuid.uuid4().hex[:8]}")
    wakeup.sources()
    yield wakeup
    wakeup.close()


@pytest.mark.databases("postgresql")
@DRIVERS
@pytest.mark.parametrize("recreated", ["alike", "other types"])
def test_prepared_statements_survive_their_table_dropped_and_made_again(
        pooled: Database, listening: Wakeup, admin: Engine, driver: str, recreated: str) -> None:
    """A transient statement prepared on the LISTEN session (psycopg2: PREPARE; psycopg 3:
    from its fifth run), its table dropped and made again (an upgrade, a reset): the next
    publish and count still work, once each, and the LISTEN session plans anew."""
    table = f"rt_{uuid.uuid4().hex[:8]}"
    ddl = {"alike": f"CREATE TABLE {table} (id BIGSERIAL PRIMARY KEY, queue TEXT, n INTEGER)",
           "other types": f"CREATE TABLE {table} (id INTEGER GENERATED BY DEFAULT AS IDENTITY "
                          f"PRIMARY KEY, queue VARCHAR(40), n BIGINT, extra TEXT)"}
    with admin.connect() as conn:
        conn.execute(text(f"CREATE TABLE {table} (id BIGSERIAL PRIMARY KEY, queue TEXT, "
                          "n INTEGER)"))
    dialect = pooled.dialect
    insert = text(f"INSERT INTO {table} (queue, n) VALUES (:queue, :n)")
    count = text(f"SELECT count(*), max(n) FROM {table} WHERE queue = :queue")
    try:
        for n in range(7):
            listening.publish(
                lambda conn, n=n: dialect.execute(conn, insert, {"queue": "q", "n": n}))
            assert tuple(listening.claim(lambda conn: dialect.execute(
                conn, count, {"queue": "q"}).one())) == (n + 1, n)
        pid = backend_pid(listening, driver)
        with admin.connect() as conn:
            conn.execute(text(f"DROP TABLE {table}"))
            conn.execute(text(ddl[recreated]))
        listening.publish(lambda conn: dialect.execute(conn, insert, {"queue": "q", "n": 40}))
        got = tuple(listening.claim(lambda conn: dialect.execute(
            conn, count, {"queue": "q"}).one()))
        assert got == (1, 40)
        if recreated == "alike":
            assert backend_pid(listening, driver) == pid  # no fallback needed
    finally:
        with admin.connect() as conn:
            conn.execute(text(f"DROP TABLE IF EXISTS {table}"))


@pytest.mark.databases("postgresql")
@DRIVERS
def test_discard_plans_inside_a_listen_transaction(
        pooled: Database, listening: Wakeup, admin: Engine, driver: str) -> None:
    """Every execute refreshes the plans (plan_refresh 0): DISCARD PLANS then runs inside
    the publish's BEGIN ... COMMIT on the LISTEN session."""
    table = f"rt_{uuid.uuid4().hex[:8]}"
    with admin.connect() as conn:
        conn.execute(text(f"CREATE TABLE {table} (id BIGSERIAL PRIMARY KEY, n INTEGER)"))
    dialect = pooled.dialect
    dialect.plan_refresh = 0.0
    insert = text(f"INSERT INTO {table} (n) VALUES (:n)")
    try:
        pid = backend_pid(listening, driver)
        for n in range(8):
            listening.publish(lambda conn, n=n: dialect.execute(conn, insert, {"n": n}))
        assert backend_pid(listening, driver) == pid
        with admin.connect() as conn:
            assert conn.execute(text(f"SELECT count(*) FROM {table}")).scalar_one() == 8
    finally:
        with admin.connect() as conn:
            conn.execute(text(f"DROP TABLE IF EXISTS {table}"))


# -- real Celery: remote control across terminated LISTEN sessions -------------------------
def local_ports(pids: set[int]) -> set[int]:
    """The local ports of the processes' TCP sockets (Linux's /proc: each socket's inode
    among the processes' open files, matched in the kernel's TCP tables)."""
    inodes = set()
    for pid in pids:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[len("socket:["):-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as lines:
            for line in list(lines)[1:]:
                fields = line.split()
                if fields[9] in inodes:
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def listen_pids_of(admin: Engine, pids: set[int]) -> set[int]:
    """The backends of the 'sqlinbox listen' sessions of the processes ``pids`` (by their
    sockets' local ports: other test runs share the server)."""
    ports = local_ports(pids)
    with admin.connect() as conn:
        return {int(row[0]) for row in conn.execute(text(
            "SELECT pid, client_port FROM pg_stat_activity "
            "WHERE application_name = 'sqlinbox listen'")) if row[1] in ports}


@pytest.mark.parametrize("database", ["postgresql"], indirect=True)
@DRIVERS
def test_ping_inspect_and_events_across_terminated_listen_sessions(
        database: str, driver: str, tmp_path: Any) -> None:
    """A worker answers ping and inspect, once each, and its events arrive, after the
    worker's and the caller's LISTEN sessions were terminated (several times)."""
    broker = "postgresql" if driver == "psycopg" else "postgresql-psycopg2"
    from tests.databases import database_url
    from tests.remote.conftest import Events, cluster_on

    admin = create_engine(database_url("postgresql", tmp_path), isolation_level="AUTOCOMMIT")
    with cluster_on(broker, tmp_path, lambda: False) as cluster:
        cluster.events = Events(cluster.app)
        cluster.workers = cluster.start_workers(["a"])
        name = cluster.names[0]
        worker = cluster.workers[0].popen.pid
        control = cluster.app.control
        assert control.ping(destination=[name], timeout=10) == [{name: {"ok": "pong"}}]
        for round_ in range(4):
            targets = listen_pids_of(admin, {worker, os.getpid()})
            assert targets, "no LISTEN session found"
            with admin.connect() as conn:
                for pid in targets:
                    conn.execute(text("SELECT pg_terminate_backend(:p)"), {"p": pid})
            replies = control.ping(destination=[name], timeout=10)
            assert replies == [{name: {"ok": "pong"}}], (round_, replies)
            stats = control.inspect(destination=[name], timeout=10).stats() or {}
            assert list(stats) == [name], (round_, stats)
            task = cluster.send("add", 1, round_)
            cluster.wait(lambda task=task: {"task-succeeded"} <= cluster.events.types_of(task),
                         f"the task-succeeded event of round {round_}")
            assert len(cluster.events.of(uuid=task, type="task-succeeded")) == 1
    admin.dispose()


# -- a connection lost right after a COMMIT's reply ----------------------------------------
@pytest.mark.databases("postgresql")
@DRIVERS
def test_a_publish_that_committed_is_not_raised_when_the_connection_drops_after_its_reply(
        driver_url: str, admin: Engine, proxy: Any, driver: str) -> None:
    """The network drops the LISTEN connection right after the server's reply to the
    publish's COMMIT (before the notifications are read): the row landed, so the publish
    must not raise a connection error (kombu's retry would write it a second time)."""
    from sqlalchemy import event

    table = f"rt_{uuid.uuid4().hex[:8]}"
    with admin.connect() as conn:
        conn.execute(text(f"CREATE TABLE {table} (id INTEGER PRIMARY KEY)"))
    database = Database.open(proxy.url(driver_url), pool_size=1, max_overflow=0)
    wakeup = Wakeup(database)
    wakeup.listen(f"rt_{uuid.uuid4().hex[:8]}")
    wakeup.sources()
    listener = wakeup._listener
    cut: list[bool] = []

    def after(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if statement == "COMMIT" and not cut and conn.connection.dbapi_connection is listener:
            cut.append(True)
            proxy.cut()  # the network: nothing more of this connection arrives
            wait_for(lambda: closed_by_server(listener), "the cut seen")

    event.listen(database.engine, "after_cursor_execute", after)
    try:
        raised: BaseException | None = None
        try:
            wakeup.publish(lambda conn: conn.execute(text(f"INSERT INTO {table} VALUES (1)")))
        except Exception as exc:
            raised = exc
        assert cut
        with admin.connect() as conn:
            landed = conn.execute(text(f"SELECT count(*) FROM {table}")).scalar_one()
        assert landed == 1
        assert raised is None, f"a landed publish raised {type(raised).__module__}." \
                               f"{type(raised).__name__}: {raised}"
    finally:
        wakeup.close()
        database.dispose()
        with admin.connect() as conn:
            conn.execute(text(f"DROP TABLE IF EXISTS {table}"))


@pytest.mark.databases("postgresql")
@DRIVERS
def test_a_reply_is_not_written_twice_when_the_connection_drops_after_its_commit(
        driver_url: str, table_prefix: str, proxy: Any, admin: Engine, driver: str) -> None:
    """A worker replies to a ping (kombu publishes replies with retry) to the caller's reply
    queue, which lives in another process; the worker's publish ran on its LISTEN
    connection, which dropped just after the server's reply to the COMMIT: the reply
    landed, so one row, not two."""
    from sqlalchemy import event

    url = "sqlinbox+" + proxy.url(driver_url)
    options = {"table_prefix": table_prefix, "polling_interval": 0.05}
    worker = KombuConnection(url, transport_options=options)
    # the caller: another broker (as another process), its reply queue declared there
    caller = KombuConnection(url, transport_options={**options, "polling_interval": 0.06})
    pidbox = Queue("pidbox", REPLIES, routing_key="pidbox", durable=False, auto_delete=True)
    reply = Queue("reply", REPLIES, routing_key="reply", durable=False, auto_delete=True)
    try:
        reply(caller.default_channel).declare()
        with worker.Consumer([pidbox], callbacks=[lambda body, m: m.ack()]):
            caller.Producer().publish({"n": 0}, exchange=REPLIES, routing_key="pidbox")
            worker.drain_events(timeout=10)
            broker = broker_of(worker)
            listener = broker.wakeup._listener
            assert listener is not None
            cut: list[bool] = []

            def after(c: Any, cursor: Any, statement: str, *args: Any) -> None:
                if (statement == "COMMIT" and not cut
                        and c.connection.dbapi_connection is listener):
                    cut.append(True)
                    proxy.cut()
                    wait_for(lambda: closed_by_server(listener), "the cut seen")

            event.listen(broker.database.engine, "after_cursor_execute", after)
            try:
                producer = KombuConnection(url, transport_options=options)  # same broker
                REPLIES(producer.default_channel).declare()
                producer.Producer().publish(
                    {"pong": 1}, exchange=REPLIES, routing_key="reply", retry=True,
                    retry_policy={"max_retries": 3, "interval_start": 0})
                producer.release()
            finally:
                event.remove(broker.database.engine, "after_cursor_execute", after)
            assert cut
            assert transient_rows(admin, table_prefix, "reply") == 1
    finally:
        worker.release()
        caller.release()


# -- a registry write waiting for a lock on the shared LISTEN connection ---------------------
@pytest.mark.databases("postgresql")
@DRIVERS
def test_a_registry_write_waiting_for_a_row_lock_does_not_stall_the_consumer(
        connect_driver: Connect, admin: Engine, table_prefix: str) -> None:
    """Another session holds the registry row of queue 'r' (a transaction that declared
    or renewed it, a sweep deleting it). A thread of this process declares 'r' and waits
    for that lock: the process's consumer of another transient queue must go on
    receiving meanwhile (the pool ran such writes, each thread on its own connection)."""
    consumer = connect_driver()
    other_process = connect_driver(polling_interval=0.06)  # another broker
    events = Queue("ev", REPLIES, routing_key="ev", durable=False, auto_delete=True)
    received: list[int] = []
    REPLIES(other_process.default_channel).declare()
    other_process.default_channel.queue_declare("r", durable=False, auto_delete=True,
                                                arguments={"x-expires": 60000})
    with consumer.Consumer([events], callbacks=[lambda body, m: received.append(body["n"])]):
        other_process.Producer().publish({"n": 0}, exchange=REPLIES, routing_key="ev")
        consumer.drain_events(timeout=10)
        holder = admin.connect()
        holder.execute(text("BEGIN"))
        holder.execute(text(f"SELECT * FROM {table_prefix}queues WHERE name = 'r' FOR UPDATE"))
        holder_pid = holder.execute(text(BACKEND)).scalar_one()
        declaring = threading.Thread(
            target=lambda: connect_driver().default_channel.queue_declare(
                "r", durable=False, auto_delete=True, arguments={"x-expires": 30000}),
            daemon=True)
        try:
            declaring.start()
            with admin.connect() as conn:  # the declaration waits for the lock
                wait_for(lambda: conn.execute(text(
                    "SELECT count(*) FROM pg_stat_activity "
                    "WHERE :holder = ANY(pg_blocking_pids(pid))"), {"holder": holder_pid}
                ).scalar_one(), "the declaration waiting for the row lock")
            other_process.Producer().publish({"n": 1}, exchange=REPLIES, routing_key="ev")
            draining = threading.Thread(
                target=lambda: consumer.drain_events(timeout=3), daemon=True)
            draining.start()
            draining.join(5)
            stalled = draining.is_alive()
        finally:
            holder.execute(text("ROLLBACK"))
            holder.close()
        declaring.join(10)
        if stalled:
            draining.join(10)
        assert not stalled and received == [0, 1], (
            "the consumer stalled behind a registry write's lock wait", received)


@pytest.mark.databases("postgresql")
@DRIVERS
@pytest.mark.parametrize("how", ["look", "relaxed", "listen publish", "listen count"])
def test_an_interrupt_in_the_middle_of_a_statement_leaves_every_connection_clean(
        pooled: Database, listening: Wakeup, admin: Engine, driver: str, how: str) -> None:
    """Ctrl-C (KeyboardInterrupt; gevent's Timeout and SystemExit are BaseExceptions too)
    while the server runs the work's statement: no session of ours is left idle in a
    transaction, and the next claim, count and publish run (on a LISTEN session)."""
    import signal

    listen_pid = backend_pid(listening, driver)

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    def work(conn: Connection) -> None:
        conn.exec_driver_sql("SELECT pg_sleep(0.5)")

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 0.15)
    try:
        with pytest.raises(KeyboardInterrupt):
            if how == "look":
                pooled.look(work)
            elif how == "relaxed":
                pooled.run(work, durable=False)
            elif how == "listen publish":
                listening.publish(work)
            else:
                listening.claim(work)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    with admin.connect() as conn:
        state = conn.execute(text("SELECT state FROM pg_stat_activity WHERE pid = :pid"),
                             {"pid": listen_pid}).scalar()
    assert state is None or not state.startswith("idle in transaction"), (
        f"the LISTEN session was left {state!r}")
    assert pool_state(pooled) == CLEAN
    # what the wake-up runs next runs, on a LISTEN session (not a pooled connection)
    on = listening.claim(lambda conn: int(conn.exec_driver_sql(BACKEND).scalar_one()))
    assert listening.publish(lambda conn: conn.exec_driver_sql("SELECT 8").scalar_one()) == 8
    assert listening._listener is not None and on == backend_pid(listening, driver)


# -- MariaDB: names bound as UTF-8 bytes whatever the connection's character set -------------
@pytest.mark.parametrize("database", ["mysql"], indirect=True)
@pytest.mark.parametrize("durable", [True, False])
def test_mysql_registry_and_binding_names_are_stored_as_utf8_from_a_latin1_connection(
        broker_url: str, table_prefix: str, engine: Engine, durable: bool) -> None:
    """Routes.declare and the binding write run through dialect.execute now, which skips
    the statements' Utf8Name binding: a ?charset=latin1 process stores latin1 bytes that
    no other process's names match."""
    conn = KombuConnection(broker_url + "?charset=latin1", transport_options={
        "table_prefix": table_prefix, "polling_interval": 0.05})
    try:
        exchange = Exchange("échange", type="direct", durable=durable)
        queue = Queue("thé", exchange, routing_key="crème", durable=durable,
                      auto_delete=not durable)
        queue(conn.default_channel).declare()
        with engine.connect() as db:
            names = db.execute(text(f"SELECT HEX(name) FROM {table_prefix}queues")).scalars().all()
            bound = db.execute(text(
                f"SELECT HEX(queue), HEX(routing_key) FROM {table_prefix}bindings")).all()
        utf8 = "thé".encode().hex().upper()
        assert names == ([] if durable else [utf8]), names
        assert [tuple(row) for row in bound] == [(utf8, "crème".encode().hex().upper())], bound
    finally:
        conn.release()
