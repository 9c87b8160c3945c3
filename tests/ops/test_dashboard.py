"""The dashboard (``celery_ext.dashboard``) through Werkzeug's test client on the real
databases: the queues' figures as the ``queues`` command reads them, a queue's ready rows
a keyset page at a time and its blocked FIFO groups, the dead letters filtered, shown,
requeued and purged behind a confirmation; refused without the token, without the CSRF
token, from another origin and in read-only mode; a real worker runs a requeued dead
letter; ``celery sqlinbox dashboard`` serves it."""

from __future__ import annotations

import logging
import re
import socket
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from celery import Celery
from sqlalchemy import create_engine, text
from werkzeug.test import Client

from celery_ext.dashboard import Dashboard
from celery_ext.dashboard.security import COOKIE, HEADERS
from kombu_sqlinbox.operations import Operations
from kombu_sqlinbox.options import parse_options
from tests.ops.conftest import Seeded
from tests.ops.dashboard_support import TOKEN, csrf, figures, ids, signed_in, signed_in_as
from tests.processes import Processes, wait_until

#: how long a real worker may take to run a requeued task
RUN_LIMIT = 60.0


def test_every_page_and_action_is_refused_without_the_token(ops: Operations) -> None:
    client = Client(Dashboard(ops, token=TOKEN))
    for path in ("/", "/queues/jobs", "/dead", "/dead/jobs.dead/1"):
        response = client.get(path)
        assert response.status_code == 401, path
        assert "needs its token" in response.text
        assert "jobs" not in response.text.replace("/queues/jobs", "")
    assert client.post("/dead/purge", data={"dlq": "jobs.dead"}).status_code == 401
    assert client.get("/?token=wrong").status_code == 401
    assert client.get("/", headers={"Authorization": f"Bearer {TOKEN}x"}).status_code == 401
    # the header, or the cookie the token is traded for (a digest, never the token)
    assert client.get("/", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200
    traded = client.get(f"/?token={TOKEN}")
    cookie = traded.headers["Set-Cookie"]
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and TOKEN not in cookie
    assert client.get_cookie(COOKIE) is not None
    page = client.get("/")
    assert page.status_code == 200
    for name, value in HEADERS.items():
        assert page.headers[name] == value


def test_the_queues_page_shows_the_queues_figures(ops: Operations, seeded: Seeded) -> None:
    page = signed_in(Dashboard(ops, token=TOKEN, refresh=2.0)).get("/")
    assert page.status_code == 200
    assert 'data-refresh="2.0"' in page.text  # the live refresh's period
    for queue, expected in seeded.expected.items():
        shown = figures(page.text, queue)
        for name in ("ready", "delayed", "in_work", "blocked"):
            assert shown[name] == expected[name], (queue, name, shown)
    assert figures(page.text, "jobs")["dead_letters"] == 4
    assert figures(page.text, "fifo")["dead_letters"] == 4


def test_a_queue_pages_its_ready_rows_by_id_and_shows_its_blocked_groups(
        ops: Operations, seeded: Seeded) -> None:
    client = signed_in(Dashboard(ops, token=TOKEN, page=3))
    first = client.get("/queues/jobs")
    shown = ids(first.text, "rows")
    assert len(shown) == 3 and shown == sorted(shown)
    more = re.search(r'class="next" href="\?after=(\d+)"', first.text)
    assert more and int(more.group(1)) == shown[-1]
    second = client.get(f"/queues/jobs?after={shown[-1]}")
    rest = ids(second.text, "rows")
    assert len(rest) == 1 and rest[0] > shown[-1]  # four ready, the lapsed lease among them
    assert 'class="next"' not in second.text
    assert "ops.add" in first.text
    assert "Blocked FIFO groups" not in first.text  # jobs is not FIFO

    fifo = client.get("/queues/fifo").text
    assert len(ids(fifo, "rows")) == 1  # B's only row; A's wait behind its head
    groups = re.search(r'<table class="groups">.*?<tbody>(.*?)</tbody>', fifo, re.S)
    assert groups
    cells = re.findall(r"<td>([^<]*)</td>", groups.group(1))
    assert cells[0] == "A" and cells[-1] == "2"  # two rows behind A's head in work
    assert client.get("/queues/nothing").status_code == 404
    assert client.get("/queues/jobs?after=x").status_code == 400


def test_dead_letters_are_filtered_and_shown_decoded(ops: Operations, seeded: Seeded) -> None:
    client = signed_in(Dashboard(ops, token=TOKEN, page=2))
    every = client.get("/dead?dlq=jobs.dead")
    first = ids(every.text, "dead")
    assert len(first) == 2
    more = re.search(r'class="next" href="\?([^"]+)"', every.text)
    assert more
    rest = ids(client.get("/dead?" + more.group(1).replace("&amp;", "&")).text, "dead")
    assert len(rest) == 2 and rest[0] > first[-1]
    failed = client.get("/dead?task=ops.fail")
    [fail_id] = ids(failed.text, "dead")
    one = client.get(f"/dead/jobs.dead/{fail_id}")
    assert "ops.fail" in one.text and "rejected without requeue" in one.text
    added = ids(client.get("/dead?task=ops.add&queue=jobs").text, "dead")
    shown = client.get(f"/dead/jobs.dead/{added[0]}").text
    assert "args=[1, 2] kwargs={}" in shown
    assert ids(client.get("/dead?reason=no-such-reason").text, "dead") == []
    assert ids(client.get("/dead?older_than=3600").text, "dead") == []
    assert len(ids(client.get("/dead?newer_than=3600").text, "dead")) == 2  # a page
    assert client.get("/dead?older_than=soon").status_code == 400
    assert client.get("/dead/jobs/1").status_code == 400  # not a dead-letter queue
    assert client.get(f"/dead/jobs.dead/{rest[-1] + 100}").status_code == 404


def test_a_filtered_batch_is_purged_after_a_confirmation(
        ops: Operations, seeded: Seeded) -> None:
    client = signed_in(Dashboard(ops, token=TOKEN))
    listed = client.get("/dead?task=ops.add")
    form = {"csrf": csrf(listed), "dlq": "jobs.dead", "task": "ops.add"}
    asked = client.post("/dead/purge", data=form)
    assert asked.status_code == 200
    assert "Purge 3 dead letters?" in asked.text  # nothing gone yet
    assert len(ids(client.get("/dead").text, "dead")) == 4
    done = client.post("/dead/purge", data={**form, "confirm": "yes"})
    assert done.status_code == 303
    after = client.get(done.headers["Location"])
    assert "purged 3" in after.text
    assert len(ids(client.get("/dead").text, "dead")) == 1
    assert figures(client.get("/").text, "jobs")["dead_letters"] == 1


def test_actions_are_refused_without_csrf_from_elsewhere_and_read_only(
        ops: Operations, seeded: Seeded) -> None:
    client = signed_in(Dashboard(ops, token=TOKEN))
    token = csrf(client.get("/dead"))
    form = {"dlq": "jobs.dead", "confirm": "yes"}
    for data, headers, why in [
            (form, {}, "CSRF token"),
            ({**form, "csrf": "forged"}, {}, "CSRF token"),
            ({**form, "csrf": token}, {"Origin": "http://evil.example"}, "another origin"),
            ({**form, "csrf": token}, {"Referer": "http://evil.example/x"}, "another origin"),
            ({**form, "csrf": token}, {"Origin": "null"}, "another origin"),
            ({**form, "csrf": token}, {"Sec-Fetch-Site": "cross-site"}, "another site")]:
        refused = client.post("/dead/purge", data=data, headers=headers)
        assert refused.status_code == 403 and why in refused.text, refused.text
    assert client.get("/dead/purge").status_code == 405  # never by GET
    read_only = Dashboard(ops, token=TOKEN, read_only=True)
    reader = signed_in(read_only)
    page = reader.get("/dead")
    assert "read-only" in page.text and 'name="csrf"' not in page.text  # no forms
    valid = read_only.guard.csrf(read_only.guard.session_value())
    refused = reader.post("/dead/purge", data={**form, "csrf": valid})
    assert refused.status_code == 403 and "read-only" in refused.text
    assert len(ids(client.get("/dead").text, "dead")) == 4  # nothing was moved


def test_a_database_that_fails_is_a_page_saying_so_without_its_password() -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    ops = Operations(f"postgresql+psycopg://app:s3cret@127.0.0.1:{port}/db",
                     parse_options({"queues": {"jobs": {}}}), ["jobs"])
    try:
        page = Client(Dashboard(ops, token=TOKEN)).get("/", headers={
            "Authorization": f"Bearer {TOKEN}"})
    finally:
        ops.close()
    assert page.status_code == 503
    assert "failed" in page.text and "s3cret" not in page.text and "***" in page.text


def test_a_real_worker_runs_a_requeued_dead_letter(
        ops: Operations, app: Celery, processes: Processes, ops_env: dict[str, str]) -> None:
    runs = Path(ops_env["SQLINBOX_OPS_RUNS"])
    worker = processes.worker("tests.ops.apps", env=ops_env, args=["-Q", "jobs"])
    app.send_task("ops.record", (7, "cured"), queue="jobs")
    client = signed_in(Dashboard(ops, token=TOKEN))
    dead = wait_until(lambda: ids(client.get("/dead").text, "dead"), RUN_LIMIT,
                      "the poisoned task to die", alive=[worker])
    assert not list(runs.glob("7.*"))
    (runs / "cured").touch()
    form = {"csrf": csrf(client.get("/dead")), "dlq": "jobs.dead", "row_id": str(dead[0])}
    assert "Requeue 1 dead letter?" in client.post("/dead/requeue", data=form).text
    done = client.post("/dead/requeue", data={**form, "confirm": "yes"})
    assert "requeued 1" in client.get(done.headers["Location"]).text
    wait_until(lambda: list(runs.glob("7.*")), RUN_LIMIT, "the requeued task to run",
               alive=[worker])
    assert ids(client.get("/dead").text, "dead") == []
    wait_until(lambda: figures(client.get("/").text, "jobs")["in_work"] == 0, RUN_LIMIT,
               "its settlement", alive=[worker])


@pytest.mark.parametrize("database", ["sqlite"])  # serving is the same on every database
def test_the_command_serves_the_dashboard_behind_a_token(
        processes: Processes, ops_env: dict[str, str], database: str) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = processes.spawn("dashboard", [
        sys.executable, "-m", "celery", "-A", "tests.ops.apps", "sqlinbox", "dashboard",
        "--port", str(port), "--read-only"], ops_env)
    printed = wait_until(lambda: re.search(r"http://127\.0\.0\.1:(\d+)/\?token=(\S+)",
                                           server.output()), RUN_LIMIT,
                         "the dashboard's address", alive=[server])
    assert int(printed.group(1)) == port
    address = f"http://127.0.0.1:{port}/"
    wait_until(lambda: "Running on" in server.output(), RUN_LIMIT, "the server",
               alive=[server])
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(address, timeout=10)
    assert refused.value.code == 401
    request = urllib.request.Request(address, headers={
        "Authorization": f"Bearer {printed.group(2)}"})
    with urllib.request.urlopen(request, timeout=10) as page:
        html = page.read().decode()
    assert "read-only" in html and 'data-queue="jobs"' in html


@pytest.mark.databases("postgresql")  # elsewhere the error is an OperationalError: a 503
@pytest.mark.parametrize("mounted", [False, True], ids=["standalone", "mounted"])
def test_a_page_that_fails_unexpectedly_is_a_plain_500_and_a_logged_traceback(
        ops: Operations, seeded: Seeded, db_url: str, caplog: pytest.LogCaptureFixture,
        mounted: bool) -> None:
    """Another session drops a column of the paused queues' table (a bad migration): the
    server's error as the pauses page reads it is a page that names the page that failed
    and the kind of error, and neither the statement, its values nor a traceback; status
    500; the traceback logged."""
    dashboard = Dashboard(ops, token=None if mounted else TOKEN)
    client = signed_in_as(dashboard, "alice") if mounted else signed_in(dashboard)
    ops.pause("jobs", "s3cret reason", "ops")
    paused = ops.dialect.quote(f"{ops.options.table_prefix}paused_queues")
    other = create_engine(db_url)
    try:
        with other.begin() as altering:
            altering.execute(text(f"ALTER TABLE {paused} DROP COLUMN paused_by"))
    finally:
        other.dispose()
    with caplog.at_level(logging.ERROR, logger="celery_ext.dashboard"):
        page = client.get("/pauses")
    assert page.status_code == 500, page.text
    assert "/pauses" in page.text and "ProgrammingError" in page.text, page.text
    for hidden in ("paused_by", "Traceback", "SELECT", "sqlalche.me", "s3cret"):
        assert hidden not in page.text, (hidden, page.text)
    assert page.headers["Content-Security-Policy"] == HEADERS["Content-Security-Policy"]
    [logged] = [r for r in caplog.records if r.name.startswith("celery_ext.dashboard")]
    assert logged.exc_info and "/pauses" in logged.getMessage()
