"""The dashboard's workers, pauses and limits pages on the real databases: a real worker
started with events answers, shows its task in work and its heartbeats; no worker is
"no answer" within the timeout, a broker that fails is said; queues paused and resumed
(refused without the token, without the CSRF token and in read-only mode); each queue's
limits and its keys' rows in work as claims left them."""

from __future__ import annotations

import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from celery import Celery
from werkzeug.test import Client

from celery_ext.dashboard import Dashboard
from kombu_sqlinbox.broker import Broker
from kombu_sqlinbox.operations import Operations
from kombu_sqlinbox.options import parse_options
from tests.ops.apps import make_app, transport_options
from tests.ops.dashboard_support import TOKEN, csrf, signed_in
from tests.processes import Processes, wait_until, worker_argv, worker_ready

#: how long a real worker may take to start, run or send a heartbeat
LIMIT = 60.0
#: how long the pages wait for the workers' answers here
TIMEOUT = 0.5


def row(html: str, attribute: str, value: str) -> str:
    found = re.search(rf'<tr {attribute}="{re.escape(value)}">(.*?)</tr>', html, re.S)
    assert found, html
    return found.group(1)


def cell(html: str, name: str) -> str:
    found = re.search(rf'<td class="{name}">(.*?)</td>', html, re.S)
    assert found, html
    return found.group(1).strip()


@pytest.fixture
def dashboard(ops: Operations, app: Celery) -> Iterator[Dashboard]:
    made = Dashboard(ops, token=TOKEN, app=app, worker_timeout=TIMEOUT, refresh=1.0)
    yield made
    made.close()


def test_a_real_worker_answers_with_its_task_in_work_and_sends_heartbeats(
        dashboard: Dashboard, app: Celery, processes: Processes,
        ops_env: dict[str, str]) -> None:
    runs = Path(ops_env["SQLINBOX_OPS_RUNS"])
    # events on (-E) and their heartbeats (without --without-heartbeat)
    argv = [each for each in worker_argv("tests.ops.apps", "prefork", 2)
            if each != "--without-heartbeat"]
    worker = processes.spawn("w1", [*argv, "-E", "-Q", "jobs", "-n", "w1@%h"], ops_env)
    wait_until(lambda: worker_ready(worker), LIMIT, "the worker", alive=[worker])
    client = signed_in(dashboard)
    app.send_task("ops.hold", (LIMIT,), queue="jobs", task_id="held-1")

    def shown() -> str | None:
        page = client.get("/workers").text
        return page if "held-1" in page and "s ago" in page else None

    page = wait_until(shown, LIMIT, "the held task and a heartbeat on the page",
                      alive=[worker])
    name = re.search(r'<tr data-worker="(w1@[^"]+)">', page)
    assert name, page
    mine = row(page, "data-worker", name.group(1))
    assert cell(mine, "state") == "online" and cell(mine, "answered") == "yes"
    assert cell(mine, "in_work") == "1" and cell(mine, "heartbeat").endswith(" s ago")
    # its stats, which hold the transport options and so fifo's declared table
    assert cell(mine, "pid") == str(worker.popen.pid)
    assert "ops.hold" in page and f"{LIMIT}" in page  # the task and its arguments
    (runs / "release").touch()

    def mine_now() -> str:
        return row(client.get("/workers").text, "data-worker", name.group(1))

    wait_until(lambda: cell(mine_now(), "in_work") == "0", LIMIT, "the task to end",
               alive=[worker])
    worker.popen.terminate()  # a warm shutdown: the worker says it goes offline

    def offline() -> str | None:
        shown = mine_now()
        return shown if cell(shown, "state") == "offline" else None

    gone = wait_until(offline, LIMIT, "the worker offline")
    assert cell(gone, "answered") == "no answer" and "(went offline)" in gone


def test_no_worker_is_no_answer_within_the_timeout(dashboard: Dashboard) -> None:
    client = signed_in(dashboard)
    started = time.monotonic()
    page = client.get("/workers")
    waited = time.monotonic() - started
    assert page.status_code == 200
    assert f"No worker answered within {TIMEOUT} s" in page.text
    assert TIMEOUT <= waited < TIMEOUT + 10.0  # the broadcast's wait, and no more


def test_the_workers_page_needs_the_app(ops: Operations) -> None:
    page = signed_in(Dashboard(ops, token=TOKEN)).get("/workers")
    assert page.status_code == 200 and "needs the app" in page.text


def test_a_broker_that_fails_is_said_on_the_workers_page(ops: Operations,
                                                         table_prefix: str) -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    down = make_app(f"sqlinbox+postgresql+psycopg://app:s3cret@127.0.0.1:{port}/db",
                    table_prefix)
    dashboard = Dashboard(ops, token=TOKEN, app=down, worker_timeout=TIMEOUT)
    try:
        client = signed_in(dashboard)
        page = client.get("/workers").text
        assert "No answer: the broker failed" in page and "s3cret" not in page
        # the heartbeats' receiver failed too, and says so while it tries again
        events = wait_until(lambda: re.search(r"No heartbeats: the workers' events failed: "
                                              r"[^<]*", client.get("/workers").text),
                            LIMIT, "the receiver's failure")
        assert "s3cret" not in events.group(0)
    finally:
        dashboard.close()


def test_queues_are_paused_and_resumed(dashboard: Dashboard, ops: Operations) -> None:
    client = signed_in(dashboard)
    page = client.get("/pauses")
    assert cell(row(page.text, "data-queue", "jobs"), "state") == "running"
    token = csrf(page)
    done = client.post("/pauses/pause", data={"csrf": token, "queue": "jobs",
                                              "reason": "migrating the ledger"})
    assert done.status_code == 303
    listed = client.get(done.headers["Location"]).text
    assert "paused jobs" in listed
    mine = row(listed, "data-queue", "jobs")
    assert cell(mine, "state") == "paused" and cell(mine, "reason") == "migrating the ledger"
    assert [(each.queue, each.by, each.reason) for each in ops.paused()] == [
        ("jobs", "dashboard", "migrating the ledger")]
    assert cell(row(listed, "data-queue", "fifo"), "state") == "running"
    again = client.post("/pauses/pause", data={"csrf": token, "queue": "jobs"})
    assert "was paused already by dashboard" in client.get(again.headers["Location"]).text
    assert "PAUSED: migrating the ledger" in client.get("/").text  # the queues page too
    resumed = client.post("/pauses/resume", data={"csrf": token, "queue": "jobs"})
    assert "resumed jobs" in client.get(resumed.headers["Location"]).text
    assert ops.paused() == []
    assert client.post("/pauses/resume", data={"csrf": token, "queue": "jobs"}
                       ).status_code == 404  # not paused
    unknown = client.post("/pauses/pause", data={"csrf": token, "queue": "jbos"})
    assert unknown.status_code == 400 and "did you mean" in unknown.text
    assert client.post("/pauses/pause", data={"csrf": token}).status_code == 400
    assert ops.paused() == []


def test_the_pages_and_pausing_are_refused_without_the_tokens_and_read_only(
        ops: Operations) -> None:
    form = {"queue": "jobs"}
    stranger = Dashboard(ops, token=TOKEN)
    for path in ("/workers", "/pauses", "/limits"):
        assert Client(stranger).get(path).status_code == 401, path
    assert Client(stranger).post("/pauses/pause", data=form).status_code == 401
    client = signed_in(stranger)
    refused = client.post("/pauses/pause", data=form)
    assert refused.status_code == 403 and "CSRF token" in refused.text
    read_only = Dashboard(ops, token=TOKEN, read_only=True)
    reader = signed_in(read_only)
    page = reader.get("/pauses").text
    assert 'name="csrf"' not in page and "read-only" in page  # no forms
    valid = read_only.guard.csrf(read_only.guard.session_value())
    refused = reader.post("/pauses/pause", data={**form, "csrf": valid})
    assert refused.status_code == 403 and "read-only" in refused.text
    assert ops.paused() == []


@pytest.fixture
def limited(broker_url: str, table_prefix: str) -> Iterator[tuple[Operations, Broker,
                                                                  Celery]]:
    """An app whose ``limited`` queue lets two rows of a ``tenant-`` key, one of any other
    key and ten in all be in work at once, and whose ``paced`` queue is rate-limited."""
    options = transport_options(table_prefix)
    options["queues"]["limited"] = {"concurrency_limits": {"tenant-": 2, "*": 1},
                                    "max_in_work": 10}
    options["queues"]["paced"] = {"rate_limit": "10/s",
                                  "task_rate_limits": {"ops.add": "2/m"}}
    app = make_app(broker_url, table_prefix)
    app.conf.broker_transport_options = options
    made = Operations(broker_url, parse_options(options), list(app.amqp.queues))
    with app.connection_for_write() as conn:
        yield made, conn.default_channel.broker, app
    made.close()


def test_limits_and_the_rows_in_work_per_key(
        limited: tuple[Operations, Broker, Celery]) -> None:
    ops, broker, app = limited
    client = signed_in(Dashboard(ops, token=TOKEN))
    before = client.get("/limits").text  # the limits, no keys: the table is not made yet
    assert "tenant-: 2, *: 1" in before and 'class="keys"' not in before
    for key in ("tenant-1", "tenant-1", "tenant-1", "tenant-2", "other", "other"):
        app.send_task("ops.add", (1, 1), queue="limited", limit_key=key)
    app.send_task("ops.add", (1, 1), queue="limited")  # no key
    claimed = broker.claim(broker.table("limited"), 10)
    assert len(claimed) == 5  # two of tenant-1, tenant-2, one of other, the keyless one
    page = client.get("/limits").text
    keys = re.search(r'<table class="keys" data-queue="limited">.*?<tbody>(.*?)</tbody>',
                     page, re.S)
    assert keys, page
    rows = re.findall(r'<tr data-key="([^"]*)"><td>.*?</td><td class="in_work">(\d+)</td>'
                      r'<td class="limit">([^<]+)</td>', keys.group(1))
    assert sorted(rows) == [("", "1", "-"), ("other", "1", "1"), ("tenant-1", "2", "2"),
                            ("tenant-2", "1", "2")]
    assert rows[0] == ("tenant-1", "2", "2")  # the busiest first
    assert "tenant-: 2, *: 1" in page and "5 of 10" in page
    paced = re.search(r'<table class="limits" data-queue="paced">(.*?)</table>', page, re.S)
    assert paced and "10/s" in paced.group(1) and "ops.add: 2/m" in paced.group(1)
    assert 'class="keys" data-queue="paced"' not in page  # no concurrency limits
    assert 'data-queue="jobs"' not in page  # no limit at all
