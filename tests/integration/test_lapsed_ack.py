"""An ack that could not be written before its row's lease lapsed (the database refused
every write for longer than the lease): the process that acked the row must not take it
again and run it a second time."""

from __future__ import annotations

import time

from sqlalchemy.engine import Engine

from .conftest import Connect
from .support import count_rows, get, get_within, publish, rows_locked, settled, table_of

#: the lease of this test (seconds)
LEASE = 1


def test_a_row_acked_here_is_not_delivered_here_again_after_its_lease_lapsed(
    connect: Connect, engine: Engine, table_prefix: str,
) -> None:
    conn = connect(visibility_timeout=LEASE)
    publish(conn, "jobs", {"n": 1})
    message = get_within(conn, "jobs")
    table = table_of("jobs", table_prefix)
    with rows_locked(engine, table):  # neither the ack nor a lease extension can be written
        message.ack()
        time.sleep(3 * LEASE)  # the lease lapses meanwhile: it is the time that matters here
    assert get(conn, "jobs") is None, "the row this process acked was delivered again"
    settled(conn)
    assert count_rows(engine, table) == 0


def test_a_row_in_work_here_is_not_delivered_here_a_second_time_after_its_lease_lapsed(
    connect: Connect, engine: Engine, table_prefix: str,
) -> None:
    conn = connect(visibility_timeout=LEASE)
    publish(conn, "jobs", {"n": 1})
    message = get_within(conn, "jobs")  # in work here (or waiting in a worker's prefetch)
    table = table_of("jobs", table_prefix)
    with rows_locked(engine, table):  # its lease cannot be extended
        time.sleep(3 * LEASE)  # the lease lapses meanwhile: it is the time that matters here
    assert get(conn, "jobs") is None, "the row in work here was delivered here a second time"
    message.ack()
    settled(conn)
    assert count_rows(engine, table) == 0
