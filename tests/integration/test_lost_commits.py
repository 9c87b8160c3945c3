"""A commit that lands while its reply is lost (the connection breaks right after the
COMMIT reached the server): work that must not happen twice is not run again.

A TCP proxy between the transport and the server cuts the connection just after
forwarding a COMMIT. A publish then raises a connection error (kombu's and Celery's
retry policies decide what follows), leaving one copy; work that is harmless to
repeat, such as the fenced move of a held row to its dead-letter queue, runs again
and finds nothing left to do.
"""

from __future__ import annotations

import pytest
from sqlalchemy.engine import Engine

from tests.tcp_proxy import Proxy

from .conftest import Connect
from .support import DEAD_LETTERS, broker_of, count_rows, get_within, publish, settled, table_of

pytestmark = pytest.mark.databases("postgresql", "mysql")  # a file has no connection


@pytest.fixture
def broker_url(db_url: str, proxy: Proxy) -> str:
    """Every kombu connection of these tests goes through the proxy."""
    return "sqlinbox+" + proxy.url(db_url)


#: what commits a publish: its INSERT alone, run in autocommit (on PostgreSQL its NOTIFY
#: after it, in a commit of its own)
PUBLISH_COMMIT = b"INSERT INTO"


def test_publish_whose_commit_reply_is_lost_is_not_repeated(
    connect: Connect, engine: Engine, table_prefix: str, proxy: Proxy,
) -> None:
    conn = connect()
    publish(conn, "jobs", {"n": 0})
    proxy.cut_after_commit(marker=PUBLISH_COMMIT)
    with pytest.raises(conn.connection_errors):
        conn.Producer().publish({"n": 1}, routing_key="jobs", retry=False)
    assert proxy.commits_cut == 1
    assert count_rows(engine, table_of("jobs", table_prefix)) == 2
    publish(conn, "jobs", {"n": 2})  # the next publish takes a fresh connection
    assert count_rows(engine, table_of("jobs", table_prefix)) == 3


def test_publish_on_a_connection_the_server_closed_takes_a_fresh_one_and_lands_once(
    connect: Connect, engine: Engine, table_prefix: str, proxy: Proxy,
) -> None:
    """The pool's connection died while idle (a server restart): the publish, one
    statement in autocommit, sees it closed before it sends anything and goes on, once,
    on a fresh connection."""
    conn = connect()
    publish(conn, "jobs", {"n": 0})
    proxy.cut()
    conn.Producer().publish({"n": 1}, routing_key="jobs", retry=False)
    assert count_rows(engine, table_of("jobs", table_prefix)) == 2


def test_dead_letter_move_whose_commit_reply_is_lost_is_run_again_harmlessly(
    connect: Connect, engine: Engine, table_prefix: str, proxy: Proxy,
) -> None:
    conn = connect(**DEAD_LETTERS)
    publish(conn, "jobs", {"n": 1})
    conn.default_channel.queue_declare("jobs.dead")
    message = get_within(conn, "jobs")
    settled(conn)
    proxy.cut_after_commit()
    message.reject(requeue=False)
    assert proxy.commits_cut == 1
    assert count_rows(engine, table_of("jobs", table_prefix)) == 0
    assert count_rows(engine, table_of("jobs.dead", table_prefix)) == 1
    assert broker_of(conn).keeper.held_count() == 0


def test_claim_whose_commit_reply_is_lost_loses_nothing(
    connect: Connect, engine: Engine, table_prefix: str, proxy: Proxy,
) -> None:
    """The claim runs again and takes the next row; the row the lost claim leased is
    nobody's, and comes back once its lease lapses, that claim counted (as after a crash)."""
    conn = connect(visibility_timeout=1)
    publish(conn, "jobs", {"n": 0})
    publish(conn, "jobs", {"n": 1})
    settled(conn)
    broker_of(conn).pauses.paused("jobs")  # the paused queues read: the next commit is the claim's
    proxy.cut_after_commit()
    second = get_within(conn, "jobs")
    assert proxy.commits_cut == 1
    assert second.decode() == {"n": 1}
    first = get_within(conn, "jobs")
    assert first.decode() == {"n": 0}
    assert first.delivery_info["redelivered"] is True
    for message in (first, second):
        message.ack()
    settled(conn)
    assert count_rows(engine, table_of("jobs", table_prefix)) == 0
