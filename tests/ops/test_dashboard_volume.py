"""The dashboard at volume, on the real databases: a queue whose table holds more unfinished
rows than the dashboard counts shows the planner's estimate, marked "about" (SQLite, which
gives none, is counted); the bounded count that tells the two apart reads no further than
its bound on a big queue, and the estimate is near the truth; a queue's page reads its own
queue and its dead-letter queue only; the dead-letter page looks at a bounded number of
letters a page and goes on from where it stopped; an outbox above the bound shows its
records estimated and its unprocessed ones counted, never fewer records than the bound
even where the planner's statistics are older than them; a queue table dropped while the
page loads shows as missing."""

from __future__ import annotations

import re
from typing import Any

import pytest
from celery import Celery
from sqlalchemy import create_engine, event, text

import celery_ext
from celery_ext.dashboard import Dashboard, pages
from kombu_sqlinbox.browsing import estimated_figures
from kombu_sqlinbox.operations import Operations
from tests.integration.test_explain import READY_ROWS, bulk_insert_sql, rows_read
from tests.ops.conftest import Seeded
from tests.ops.dashboard_support import TOKEN, figures, ids, signed_in


def estimates(ops: Operations) -> bool:
    """Whether the database gives the planner's estimate of a table's rows."""
    return ops.dialect.row_estimate(ops.broker.spec_for("jobs")) is not None


def test_a_queue_above_the_bound_shows_an_estimate_marked_about(
        ops: Operations, seeded: Seeded) -> None:
    # jobs holds 8 unfinished rows, fifo 4, jobs.dead 4: jobs only is above 5
    page = signed_in(Dashboard(ops, token=TOKEN, exact_upto=5)).get("/")
    assert page.status_code == 200
    for queue in ("fifo", "jobs.dead"):
        shown = figures(page.text, queue)
        for name in ("ready", "delayed", "in_work", "blocked"):
            assert shown[name] == seeded.expected[queue][name], (queue, name, shown)
    row = re.search(r'<tr data-queue="jobs">(.*?)</tr>', page.text, re.S)
    assert row
    about = re.search(r'<td class="about" colspan="8">about ([\d,]+) waiting', row.group(1))
    if not estimates(ops):  # SQLite: counted whatever its size
        assert about is None
        assert figures(page.text, "jobs")["ready"] == seeded.expected["jobs"]["ready"]
        return
    assert about, row.group(1)
    assert int(about.group(1).replace(",", "")) >= 6  # never fewer than it counted
    assert 'class="ready"' not in row.group(1)
    assert "more than 5, not counted" in row.group(1)
    assert "up to 5 unfinished rows" in page.text  # the note says what is an estimate
    # the same figures, counted, above the bound
    exact = signed_in(Dashboard(ops, token=TOKEN, exact_upto=8)).get("/")
    assert figures(exact.text, "jobs")["ready"] == seeded.expected["jobs"]["ready"]


def test_a_dead_letter_queue_above_the_bound_shows_about_beside_its_queues(
        ops: Operations, seeded: Seeded) -> None:
    page = signed_in(Dashboard(ops, token=TOKEN, exact_upto=3)).get("/")
    row = re.search(r'<tr data-queue="fifo">(.*?)</tr>', page.text, re.S)
    assert row
    dead = re.search(r'<td class="dead_letters"><a [^>]*>(about )?([\d,]+)</a>', row.group(1))
    assert dead, row.group(1)
    assert (dead.group(1) is not None) == estimates(ops)
    if not estimates(ops):
        assert int(dead.group(2)) == 4


@pytest.mark.databases("postgresql", "mysql")  # SQLite gives no estimate: always counted
def test_the_bounded_count_reads_no_further_than_its_bound_on_a_big_queue(
        ops: Operations, database: str) -> None:
    spec = ops.broker.table("jobs").spec
    table = ops.dialect.quote(spec.table)
    with ops.broker.engine.begin() as conn:
        conn.execute(text(bulk_insert_sql(database, table)))
    with ops.broker.engine.connect() as conn:
        analyze = "ANALYZE" if database == "postgresql" else "ANALYZE TABLE"
        conn.execution_options(isolation_level="AUTOCOMMIT").exec_driver_sql(
            f"{analyze} {table}")
    bound = 1000
    with ops.broker.engine.connect() as conn:
        counted = conn.execute(ops.dialect.bounded_count(spec), {"limit": bound + 1})
        assert counted.scalar_one() == bound + 1
        read = rows_read(conn, database, ops.dialect.bounded_count(spec),
                         {"limit": bound + 1})
        assert bound + 1 <= read <= bound + 2, read
        estimate = ops.dialect.estimated_rows(conn, ops.dialect.row_estimate(spec))
    assert 0.8 * READY_ROWS <= estimate <= 1.2 * READY_ROWS, estimate
    found = {each.queue: each for each in estimated_figures(ops, ("jobs",), bound)}
    assert found["jobs"].about == estimate and found["jobs"].total == estimate
    assert found["jobs.dead"].about is None  # its dead-letter queue, counted: none there


def test_a_queue_page_reads_its_queue_and_its_dead_letter_queue_only(
        ops: Operations, seeded: Seeded) -> None:
    client = signed_in(Dashboard(ops, token=TOKEN))
    ran: list[str] = []

    def before(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        ran.append(statement)

    event.listen(ops.broker.engine, "before_cursor_execute", before)
    try:
        page = client.get("/queues/jobs")
    finally:
        event.remove(ops.broker.engine, "before_cursor_execute", before)
    assert page.status_code == 200
    assert figures(page.text, "jobs")["dead_letters"] == 4
    fifo = ops.broker.spec_for("fifo").table
    assert ran and not [sql for sql in ran if fifo in sql]
    assert client.get("/queues/none.such").status_code == 404


def test_a_filter_looks_at_a_bounded_number_of_dead_letters_a_page(
        ops: Operations, seeded: Seeded, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pages, "LOOKED_AT", 3)
    client = signed_in(Dashboard(ops, token=TOKEN, page=2))
    every = [dead.id for dead in ops.dead_letters(only=("jobs.dead",))]
    assert len(every) == 4
    # unfiltered, a page fills before the bound
    assert ids(client.get("/dead?dlq=jobs.dead").text, "dead") == every[:2]
    first = client.get("/dead?dlq=jobs.dead&task=none.such")
    assert "none among the 3 looked at" in first.text
    assert f"Looked at 3 dead letters (ids up to {every[2]})" in first.text
    more = re.search(r'class="next" href="\?([^"]+)"', first.text)
    assert more and f"after={every[2]}" in more.group(1) and "task=none.such" in more.group(1)
    second = client.get("/dead?" + more.group(1).replace("&amp;", "&"))
    assert "none" in second.text and "Looked at" not in second.text  # the table's end
    assert 'class="next"' not in second.text
    # a filter that takes the last one finds it on the page after the one that stopped
    taken = client.get(f"/dead?dlq=jobs.dead&task=ops.add&after={every[2]}")
    assert ids(taken.text, "dead") == [every[3]]


def test_an_outbox_above_the_bound_shows_estimates_and_its_oldest_unprocessed(
        ops: Operations, app: Celery, db_url: str, table_prefix: str, database: str) -> None:
    outbox = celery_ext.install(app, db_url, table=f"{table_prefix}outbox",
                                republish_on_start=False)
    engine = outbox.store.engine
    prepared = outbox.store.prepared(engine)
    table, now = prepared.dialect.quote(outbox.spec.table), prepared.dialect.now
    with engine.begin() as conn:
        for n in range(8):  # the first two unprocessed, the oldest first
            conn.execute(text(
                f"INSERT INTO {table} (task_id, task_name, exchange, routing_key, headers, "
                f"properties, body, created_at, processed_at) VALUES (:id, 'ops.add', '', "
                f"'jobs', '{{}}', '{{}}', :body, {now}, {'NULL' if n < 2 else now})"),
                {"id": f"t-{n}", "body": b""})
    client = signed_in(Dashboard(ops, token=TOKEN, app=app, exact_upto=5))
    page = client.get("/outbox").text
    unprocessed = re.search(r'<td class="unprocessed">([^<]*)</td>', page)
    processed = re.search(r'<td class="processed">([^<]*)</td>', page)
    assert unprocessed and processed, page
    assert unprocessed.group(1) == "2"  # counted on its index, below the bound
    if estimates(ops):
        assert processed.group(1).startswith("about "), page
        assert "the database planner's estimate" in page
        status = outbox.status(5)
        assert status.about and status.unprocessed == 2
        assert status.oldest_unprocessed_age is not None
    else:
        assert processed.group(1) == "6"
    exact = signed_in(Dashboard(ops, token=TOKEN, app=app, exact_upto=8)).get("/outbox").text
    assert '<td class="processed">6</td>' in exact and "planner" not in exact
    engine.dispose()


def test_an_outbox_estimate_older_than_its_rows_still_says_more_than_the_bound(
        ops: Operations, app: Celery, db_url: str, table_prefix: str) -> None:
    # the planner last looked at the table when it held 2 records; 20 more (processed)
    # came since, in the same page: its estimate stays 2, below the 6 the bound counted
    outbox = celery_ext.install(app, db_url, table=f"{table_prefix}outbox",
                                republish_on_start=False)
    engine = outbox.store.engine
    prepared = outbox.store.prepared(engine)
    table, now = prepared.dialect.quote(outbox.spec.table), prepared.dialect.now
    insert = text(
        f"INSERT INTO {table} (task_id, task_name, exchange, routing_key, headers, "
        f"properties, body, created_at, processed_at) VALUES (:id, 'ops.add', '', "
        f"'jobs', '{{}}', '{{}}', :body, {now}, {now})")
    with engine.begin() as conn:
        conn.execute(insert, [{"id": f"t-{n}", "body": b""} for n in range(2)])
    with engine.begin() as conn:
        conn.execute(text(f"ANALYZE {'TABLE ' if engine.dialect.name == 'mysql' else ''}"
                          f"{table}"))
    with engine.begin() as conn:
        conn.execute(insert, [{"id": f"t-{n}", "body": b""} for n in range(2, 22)])
    status = outbox.status(5)
    if estimates(ops):
        assert status.about
        # "about" says the table holds more than the bound: its counts say so too
        assert status.processed + status.unprocessed > 5, status
    else:
        assert (status.processed, status.unprocessed) == (22, 0)
    engine.dispose()


@pytest.mark.databases("postgresql", "mysql")
def test_a_queue_whose_table_is_dropped_while_the_page_loads_shows_it_missing(
        ops: Operations, seeded: Seeded, db_url: str) -> None:
    # the page listed the tables, then jobs's table went before its figures were read
    jobs = ops.dialect.quote(ops.broker.spec_for("jobs").table)
    other = create_engine(db_url)
    dropped: list[bool] = []

    def drop_first(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if not dropped and f"FROM {jobs} AS r" in statement:
            dropped.append(True)
            with other.begin() as dropping:
                dropping.execute(text(f"DROP TABLE {jobs}"))

    engine = ops.broker.database.engine
    event.listen(engine, "before_cursor_execute", drop_first)
    try:
        page = signed_in(Dashboard(ops, token=TOKEN)).get("/")
    finally:
        event.remove(engine, "before_cursor_execute", drop_first)
        other.dispose()
    assert dropped
    assert page.status_code == 200, page.text
    shown = figures(page.text, "fifo")
    for name in ("ready", "delayed", "in_work", "blocked"):
        assert shown[name] == seeded.expected["fifo"][name], (name, shown)
