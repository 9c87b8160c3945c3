"""A psycopg2 consumer's LISTEN session runs its claims and settlements as prepared
statements: PostgreSQL plans each once instead of at every claim (psycopg 3 prepares
statements itself)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
from kombu import Connection, Consumer, Queue
from sqlalchemy.engine import make_url

from .support import broker_of, publish, settled

pytestmark = pytest.mark.databases("postgresql")


@pytest.fixture
def psycopg2_conn(db_url: str, table_prefix: str) -> Iterator[Connection]:
    url = "sqlinbox+" + make_url(db_url).set(drivername="postgresql+psycopg2").render_as_string(
        hide_password=False)
    with Connection(url, transport_options={"table_prefix": table_prefix,
                                            "polling_interval": 0.05}) as conn:
        yield conn


def consume(conn: Connection, queue: str, count: int) -> list[int]:
    """``count`` messages of ``queue`` at prefetch 10, each acked; their bodies' numbers."""
    got: list[int] = []

    def on_message(body: dict[str, int], message: object) -> None:
        got.append(body["n"])
        message.ack()  # type: ignore[attr-defined]

    with Consumer(conn, [Queue(queue)], callbacks=[on_message], accept=["json"]) as consumer:
        consumer.qos(prefetch_count=10)
        for _ in range(count * 2):
            if len(got) >= count:
                break
            with contextlib.suppress(TimeoutError):
                conn.drain_events(timeout=1)
    settled(conn)
    return got


def prepared_runs(conn: Connection) -> dict[str, int]:
    """The statements the broker's LISTEN session prepared: how often each ran, by its
    first words."""
    session = broker_of(conn).wakeup._session
    assert session is not None, "no LISTEN session"
    result = session.exec_driver_sql(
        "SELECT split_part(statement, ' AS ', 2), generic_plans + custom_plans "
        "FROM pg_prepared_statements")
    return {" ".join(str(sql).split()[:2]): int(runs) for sql, runs in result}


def test_claims_and_acks_run_prepared_and_deliver_each_message_once(
        psycopg2_conn: Connection) -> None:
    for n in range(60):
        publish(psycopg2_conn, "jobs", {"n": n})
    assert sorted(consume(psycopg2_conn, "jobs", 60)) == list(range(60))
    runs = prepared_runs(psycopg2_conn)
    claims = runs.get("UPDATE \"" + broker_of(psycopg2_conn).table("jobs").spec.table + "\"", 0)
    carrying = runs.get("WITH completed", 0)  # a claim with the last claim's acks
    assert claims >= 1 and carrying >= 1 and claims + carrying >= 6, runs  # ten messages each


def test_a_queue_made_anew_is_consumed_through_the_statements_prepared_for_the_old_one(
        psycopg2_conn: Connection) -> None:
    """PostgreSQL plans a prepared statement again when a table it reads changed: a queue
    deleted and declared again (its table dropped and created) keeps being consumed,
    nothing lost and nothing twice."""
    for n in range(20):
        publish(psycopg2_conn, "jobs", {"n": n})
    assert sorted(consume(psycopg2_conn, "jobs", 20)) == list(range(20))
    psycopg2_conn.default_channel.queue_delete("jobs")
    for n in range(20, 40):
        publish(psycopg2_conn, "jobs", {"n": n})
    assert sorted(consume(psycopg2_conn, "jobs", 20)) == list(range(20, 40))
    assert broker_of(psycopg2_conn).size(broker_of(psycopg2_conn).table("jobs")) == 0
