"""Paused queues: claims stop at the consumer's next wake-up (or within
``pause_check_interval`` without one), publishes go on and wait, resume wakes the
consumers; names compare exactly; bad names are refused before anything is written."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from kombu import Connection, Consumer, Message, Queue
from sqlalchemy import event, text
from sqlalchemy.engine import Engine

from kombu_sqlinbox import TableBuilder
from kombu_sqlinbox.errors import ConfigurationError, SchemaMismatch
from kombu_sqlinbox.operations import Operations
from kombu_sqlinbox.options import parse_options

from .conftest import Connect
from .support import broker_of, get, get_within, publish, wait_for
from .test_advisory import backend_id


@pytest.fixture
def ops(broker_url: str, table_prefix: str) -> Iterator[Operations]:
    made = Operations(broker_url, parse_options({"table_prefix": table_prefix}),
                      ["jobs", "Jobs"])
    yield made
    made.close()


def consuming(conn: Connection, queue: str, got: list[Any]) -> Consumer:
    """A consumer of ``queue`` that acks and keeps each body, having waited once (its
    wake-ups are set up then: the LISTEN connection, the same-host socket)."""
    def keep(body: Any, message: Message) -> None:
        got.append(body)
        message.ack()

    consumer = Consumer(conn, [Queue(queue, routing_key=queue)], callbacks=[keep])
    consumer.consume()
    broker_of(conn).wakeup.sources()
    return consumer


def drain(conn: Connection, seconds: float) -> None:
    """Drain events for ``seconds`` (what arrives meanwhile is delivered)."""
    until = time.monotonic() + seconds
    while (left := until - time.monotonic()) > 0:
        try:
            conn.drain_events(timeout=left)
        except TimeoutError:
            return


def test_a_pause_reaches_a_consumer_by_its_wake_up_and_resume_drains_the_backlog(
        connect: Connect, ops: Operations) -> None:
    """With ``pause_check_interval`` at a minute, only the wake-up (NOTIFY, the same-host
    signal) can tell the consumer in time."""
    conn = connect(pause_check_interval=60.0)
    got: list[Any] = []
    with consuming(conn, "jobs", got):
        publish(conn, "jobs", {"n": 1})
        wait_for(lambda: conn.drain_events(timeout=0.2) or got, "the first message")
        kept, made = ops.pause("jobs", reason="incident 42", by="alice")
        assert made and (kept.queue, kept.reason, kept.by) == ("jobs", "incident 42", "alice")
        pauses = broker_of(conn).pauses
        wait_for(lambda: pauses.paused_after_claim("jobs"), "the consumer told of the pause", 5.0)
        for n in (2, 3):
            publish(conn, "jobs", {"n": n})  # publishes go on
        drain(conn, 1.5)
        assert got == [{"n": 1}]
        assert ops.figures()[0].ready == 2
        assert ops.resume("jobs")
        wait_for(lambda: conn.drain_events(timeout=0.2) or len(got) == 3, "the backlog",
                 10.0)
    assert sorted(body["n"] for body in got) == [1, 2, 3]


def test_without_a_wake_up_a_pause_counts_within_the_check_interval(
        connect: Connect, ops: Operations) -> None:
    """No NOTIFY, no same-host signal (``notify`` off): the consumer reads the paused
    queues again each ``pause_check_interval``."""
    conn = connect(notify=False, pause_check_interval=0.5)
    publish(conn, "jobs", {"n": 1})
    get_within(conn, "jobs").ack()
    ops.pause("jobs")
    paused_at = time.monotonic()
    publish(conn, "jobs", {"n": 2})
    while get(conn, "jobs") is not None:  # claimed before it was read again: bounded
        assert time.monotonic() - paused_at < 0.5 + 0.5, "claims went on past the bound"
    assert time.monotonic() - paused_at < 0.5 + 0.5
    time.sleep(0.6)  # a whole interval more: still nothing
    assert get(conn, "jobs") is None


def test_queue_names_compare_exactly(connect: Connect, ops: Operations) -> None:
    """Pausing ``Jobs`` leaves ``jobs`` alone (MariaDB's collations would not)."""
    conn = connect(pause_check_interval=0.1)
    for name in ("jobs", "Jobs"):
        publish(conn, name, {"queue": name})
    ops.pause("Jobs")
    assert [found.queue for found in ops.paused()] == ["Jobs"]
    assert get_within(conn, "jobs").payload == {"queue": "jobs"}
    assert get(conn, "Jobs") is None
    assert not ops.resume("jobs")
    assert ops.resume("Jobs")
    assert get_within(conn, "Jobs").payload == {"queue": "Jobs"}


def test_a_second_pause_keeps_the_first_record(ops: Operations) -> None:
    first, made = ops.pause("jobs", reason="first", by="alice")
    again, made_again = ops.pause("jobs", reason="second", by="bob")
    assert made and not made_again
    assert again == first
    assert [f.paused for f in ops.figures() if f.queue == "jobs"] == [first]


def test_bad_names_are_refused_before_anything_is_written(
        connect: Connect, ops: Operations) -> None:
    with pytest.raises(ConfigurationError, match="did you mean 'jobs'"):
        ops.pause("jbos")
    with pytest.raises(ConfigurationError, match="NUL"):
        ops.pause("jobs\x00; DROP TABLE x")
    with pytest.raises(ConfigurationError, match="at most 500"):
        ops.pause("jobs", reason="x" * 501)
    connect().default_channel.queue_declare("replies", durable=False, auto_delete=True)
    with pytest.raises(ConfigurationError, match="transient"):
        ops.pause("replies", force=True)
    assert ops.paused() == []
    kept, _ = ops.pause("later", force=True)  # a queue not declared yet
    assert [found.queue for found in ops.paused()] == [kept.queue] == ["later"]


def test_without_the_table_and_create_tables_off_nothing_is_paused(
        connect: Connect, broker_url: str, table_prefix: str) -> None:
    """An installation that predates pausing and creates no tables: consumers claim as
    before; a pause says which DDL to run."""
    conn = connect(create_tables=True)
    publish(conn, "jobs", {"n": 1})
    strict = connect(create_tables=False, pause_check_interval=0.1)
    assert get_within(strict, "jobs").payload == {"n": 1}
    ops = Operations(broker_url, parse_options({"table_prefix": table_prefix,
                                                "create_tables": False}), ["jobs"])
    try:
        with pytest.raises(SchemaMismatch, match="CREATE TABLE IF NOT EXISTS"):
            ops.pause("jobs")
        assert ops.paused() == []
    finally:
        ops.close()


def test_rows_claimed_before_the_pause_and_not_handed_out_go_back(
        connect: Connect, table_prefix: str, ops: Operations) -> None:
    """Two rows of one partition key: the second waits in the consumer's buffer behind the
    first. Paused meanwhile, it goes back to the table rather than out after the first."""
    keyed = (TableBuilder(f"{table_prefix}keyed").id().payload().headers()
             .partition_key("pkey").available_at().locked_until().attempt().build())
    conn = connect(pause_check_interval=0.1, queues={"keyed": {"table": keyed}})
    for n in (1, 2):
        publish(conn, "keyed", {"n": n}, headers={"partition_key": "k"})
    got: list[Message] = []
    consumer = Consumer(conn, [Queue("keyed", routing_key="keyed")],
                        callbacks=[lambda body, message: got.append(message)],
                        prefetch_count=2)
    with consumer:
        wait_for(lambda: conn.drain_events(timeout=0.2) or got, "the first row")
        assert got[0].payload == {"n": 1}
        ops.pause("keyed", force=True)
        pauses = broker_of(conn).pauses
        wait_for(lambda: pauses.paused_after_claim("keyed"), "the consumer told of the pause")
        got[0].ack()
        drain(conn, 1.0)
        assert len(got) == 1
        assert broker_of(conn).size(broker_of(conn).table("keyed")) == 1  # back, not held
        ops.resume("keyed")
        wait_for(lambda: conn.drain_events(timeout=0.2) or len(got) == 2, "the second row")
        got[1].ack()
    assert got[1].payload == {"n": 2}


@pytest.mark.parametrize("database", ["postgresql", "mysql"], indirect=True)
def test_a_pause_while_the_consumers_session_is_killed_still_stops_it(
        connect: Connect, ops: Operations, engine: Engine, database: str) -> None:
    """The consumer's own session is ended from the server (PostgreSQL: its LISTEN
    session, whose NOTIFY of the pause is then lost; MariaDB: its pooled session) just
    before the pause: it reads the paused queues again as it connects anew, long before
    its minute-long ``pause_check_interval``."""
    conn = connect(pause_check_interval=60.0)
    got: list[Any] = []
    broker = broker_of(conn)
    with consuming(conn, "jobs", got):
        publish(conn, "jobs", {"n": 1})
        wait_for(lambda: conn.drain_events(timeout=0.2) or got, "the first message")
        if database == "postgresql":
            with broker.wakeup._lock:
                listener = broker.wakeup._listener
                own = (listener.info.backend_pid if hasattr(listener, "info")
                       else listener.get_backend_pid())
        else:
            own = broker.run(lambda session: backend_id(session))
        with engine.connect() as session:
            session.execute(text("SELECT pg_terminate_backend(:id)" if database == "postgresql"
                                 else "KILL :id"), {"id": own})
        ops.pause("jobs")
        publish(conn, "jobs", {"n": 2})
        drain(conn, 2.0)
        assert got == [{"n": 1}]
        ops.resume("jobs")
        wait_for(lambda: conn.drain_events(timeout=0.2) or len(got) == 2, "the second", 10.0)


@pytest.mark.parametrize("database", ["postgresql"], indirect=True)
def test_a_table_created_by_another_process_at_the_same_moment_is_used(
        broker_url: str, table_prefix: str, engine: Engine) -> None:
    """Another session creates the paused queues' table and commits while this process's
    CREATE waits on it: the CREATE fails (a duplicate type on PostgreSQL), and the second
    look finds the table."""
    made = Operations(broker_url, parse_options({"table_prefix": table_prefix}), ["jobs"])
    pauses = made.broker.pauses
    try:
        with engine.connect() as other:
            other.begin()
            for statement in pauses.sql.ddl:
                other.exec_driver_sql(statement)
            ensured = threading.Thread(target=pauses.ensure)
            ensured.start()

            def waiting() -> int:
                with engine.connect() as look:  # a snapshot of the activity per look
                    return int(look.execute(text(
                        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = "
                        "'Lock' AND query LIKE :ddl"),
                        {"ddl": f"CREATE TABLE%{pauses.channel}%"}).scalar_one())

            wait_for(lambda: waiting() or None, "the CREATE to wait on the other's")
            other.commit()
        ensured.join(10)
        assert made.pause("jobs")[1]
    finally:
        made.close()


def test_rows_given_back_for_a_pause_resumed_before_the_next_claim_all_go_out(
        connect: Connect, table_prefix: str, ops: Operations) -> None:
    """Rows 2 and 3 wait behind row 1's partition key when the consumer reads the pause;
    it is resumed before the next round. That round gives them back for the pause, reads
    the resume, and claims them again: each must go out, none stay held in a buffer the
    channel no longer looks at (their lease extended as long as the worker lives). The
    consumer takes a second queue, so each round goes through a claim."""
    keyed = (TableBuilder(f"{table_prefix}keyed").id().payload().headers()
             .partition_key("pkey").available_at().locked_until().attempt().build())
    conn = connect(pause_check_interval=0.2, queues={"keyed": {"table": keyed}})
    for n in (1, 2, 3):
        publish(conn, "keyed", {"n": n}, headers={"partition_key": "k"})
    got: list[Message] = []
    consumer = Consumer(conn, [Queue(name, routing_key=name) for name in ("keyed", "jobs")],
                        callbacks=[lambda body, message: got.append(message)],
                        prefetch_count=3)
    with consumer:
        wait_for(lambda: drain(conn, 0.2) or got, "the first row")
        pauses = broker_of(conn).pauses
        ops.pause("keyed", force=True)
        wait_for(lambda: pauses.paused_after_claim("keyed"), "the consumer told of the pause")
        ops.resume("keyed")
        wait_for(pauses._old, "the paused queues' read to age")
        for n in (2, 3):
            got[-1].ack()
            wait_for(lambda n=n: drain(conn, 0.2) or len(got) == n, f"row {n}", 5.0)
        got[-1].ack()
    assert [message.payload["n"] for message in got] == [1, 2, 3]


@pytest.mark.databases("postgresql", "mysql")  # SQLite has neither row nor advisory locks
@pytest.mark.parametrize("form", ["lease", "row_lock", "advisory"])
def test_a_fifo_head_claimed_as_its_queue_was_paused_goes_back_uncounted_and_first(
        connect: Connect, table_prefix: str, ops: Operations, form: str) -> None:
    """Without a wake-up, the consumer learns of the pause after a claim took the group's
    head: the head goes back (its attempt returned, its key lock let go), the group waits,
    and on resume the head comes first, not as a redelivery, then the next."""
    spec = (TableBuilder(f"{table_prefix}fifo").id().payload().headers()
            .group("grp", fifo=True).partition_key("pkey").available_at().locked_until()
            .attempt().build())
    conn = connect(notify=False, pause_check_interval=0.05,
                   queues={"fifo": {"table": spec, "claim": form}})
    for n in (1, 2):
        publish(conn, "fifo", {"n": n}, headers={"group_key": "g", "partition_key": "g"})
    publish(conn, "jobs", {"n": 0})
    get_within(conn, "jobs").ack()  # the paused queues read: none
    ops.pause("fifo", force=True)
    pauses = broker_of(conn).pauses
    wait_for(pauses._old, "the paused queues' read to age")
    assert get(conn, "fifo") is None  # claimed, then found paused: given back
    assert get(conn, "fifo") is None
    broker_of(conn).keeper.flush(10.0)
    ops.resume("fifo")
    first = get_within(conn, "fifo")
    assert (first.payload, first.delivery_info.get("redelivered")) == ({"n": 1}, False)
    first.ack()
    second = get_within(conn, "fifo")
    assert second.payload == {"n": 2}
    second.ack()


def test_a_queue_known_by_its_tables_name_alone_is_not_paused_under_that_name(
        connect: Connect, ops: Operations) -> None:
    """A worker's queue ``orders.eu``, unknown to the app: ``queues`` lists it by its
    table's name, which is no queue's name. Pausing that name would stop no worker, so it
    is refused (naming the table); the queue paused by its own name shows as paused."""
    conn = connect(pause_check_interval=0.1)
    publish(conn, "orders.eu", {"n": 1})
    (listed,) = [f.queue for f in ops.figures() if f.queue not in ("jobs", "Jobs")]
    assert listed != "orders.eu"
    with pytest.raises(ConfigurationError, match="its queue's own name"):
        ops.pause(listed)
    with pytest.raises(ConfigurationError, match="its queue's own name"):
        ops.pause(listed, force=True)
    assert ops.paused() == []
    ops.pause("orders.eu", force=True)
    assert [f.paused is not None for f in ops.figures() if f.queue == listed] == [True]
    assert get(conn, "orders.eu") is None


def test_an_idle_consumer_reads_the_paused_queues_only_while_it_holds_its_queue_paused(
        connect: Connect, ops: Operations) -> None:
    """Counted on the consumer's engine over two idle seconds: its empty claims of a free
    queue add no statement on the paused queues' table; a paused queue costs one read per
    ``pause_check_interval`` (a resume nobody was told of). The free queue's one row is
    delivered before the count starts: the claim that takes rows looks, once the last
    read is that old."""
    conn = connect(pause_check_interval=0.5)
    publish(conn, "jobs", {"n": 1})
    ops.pause("Jobs")
    reads: list[str] = []
    event.listen(broker_of(conn).database.engine, "before_cursor_execute",
                 lambda *args: reads.append(args[2]) if "paused_queues" in args[2] else None)
    for name, most in (("jobs", 0), ("Jobs", 2.0 / 0.5 + 1)):
        got: list[Any] = []
        with consuming(conn, name, got):
            drain(conn, 0.5)
            until = time.monotonic() + 10.0
            while name == "jobs" and not got and time.monotonic() < until:
                drain(conn, 0.1)
            assert got == ([{"n": 1}] if name == "jobs" else []), got
            reads.clear()
            drain(conn, 2.0)
            assert len(reads) <= most, (name, reads)
    assert got == []
