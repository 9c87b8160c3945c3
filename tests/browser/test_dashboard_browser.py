"""The dashboard as a person uses it: headless Chromium (Debian's, driven by Playwright)
opens every page of ``celery sqlinbox dashboard`` run as a command, on PostgreSQL, with a
real worker: it is refused without the token, sees the queue's figures change live as
the worker runs the tasks, opens the dead letter a poisoned task left, requeues it and
sees it run, pauses a schedule, sees the worker with its tasks in work and its
heartbeats, a limited queue's keys in work, and pauses a queue; an action without the
CSRF token is refused. Each page's
screenshot is written to ``docs/images/`` for the guide, so they cannot go stale."""

from __future__ import annotations

import json
import os
import re
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from celery_ext.beat import Schedules
from tests.databases import IN_CI
from tests.ops.apps import (
    BROKER_ENV,
    PREFIX_ENV,
    QUEUES_ENV,
    RESULTS_ENV,
    RUNS_ENV,
    make_app,
)
from tests.processes import ROOT, Processes, wait_until, worker_argv, worker_ready

CHROMIUM = Path(os.environ.get("SQLINBOX_TEST_CHROMIUM", "/usr/bin/chromium"))
IMAGES = ROOT / "docs" / "images"
TOKEN = "browser-test-token"
#: how long a page, a worker or the live refresh may take
LIMIT = 60.0
#: a queue whose keys' rows in work the limits page shows
LIMITED = json.dumps({"limited": {"concurrency_limits": {"tenant-": 1}, "max_in_work": 4,
                                  "rate_limit": "20/s"}})

try:
    from playwright.sync_api import Browser, Page, sync_playwright
except ImportError:  # the test extra installs it
    sync_playwright = None


@pytest.fixture
def browser() -> Iterator[Browser]:
    """Headless Chromium; without it (or Playwright) the test skips, and fails in CI."""
    missing = ("playwright is not installed" if sync_playwright is None
               else None if CHROMIUM.exists() else f"no browser at {CHROMIUM}")
    if missing is not None:
        message = f"{missing}: apt-get install chromium; pip install playwright"
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True,
                                              args=["--no-sandbox"])
        yield launched
        launched.close()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def shot(page: Page, name: str) -> None:
    page.screenshot(path=str(IMAGES / f"{name}.png"), full_page=True)


def cell(page: Page, queue: str, figure: str) -> str:
    return page.locator(f'tr[data-queue="{queue}"] td.{figure}').inner_text().strip()


@pytest.mark.parametrize("database", ["postgresql"])
def test_every_page_in_a_browser_with_a_real_worker(
        browser: Browser, processes: Processes, broker_url: str, table_prefix: str,
        tmp_path: Path, database: str, monkeypatch: pytest.MonkeyPatch) -> None:
    runs = tmp_path / "runs"
    runs.mkdir()
    results = json.dumps({"extended": True})
    env = {BROKER_ENV: broker_url, PREFIX_ENV: table_prefix, RUNS_ENV: str(runs),
           RESULTS_ENV: results, QUEUES_ENV: LIMITED}
    monkeypatch.setenv(QUEUES_ENV, LIMITED)
    app = make_app(broker_url, table_prefix, results)
    for n in range(5):
        app.send_task("ops.add", (n, n), queue="jobs")
    app.send_task("ops.add", ("one", 1), queue="jobs", ignore_result=False)  # a TypeError
    app.send_task("ops.record", (7, "cured"), queue="jobs")  # dies until cured
    store = Schedules.for_app(app)
    store.ensure()
    store.add("nightly-report", "ops.add", 86400.0, args=(1, 2))
    store.close()

    port = free_port()
    address = f"http://127.0.0.1:{port}"
    server = processes.spawn("dashboard", [
        sys.executable, "-m", "celery", "-A", "tests.ops.apps", "sqlinbox", "dashboard",
        "--port", str(port), "--token", TOKEN, "--refresh", "1"], env)
    wait_until(lambda: "Running on" in server.output(), LIMIT, "the dashboard to listen",
               alive=[server])

    stranger = browser.new_page()
    refused = stranger.goto(f"{address}/")
    assert refused is not None and refused.status == 401
    assert "needs its token" in stranger.content()
    posted = stranger.request.post(f"{address}/dead/purge", form={"dlq": "jobs.dead"})
    assert posted.status == 401

    page = browser.new_page(viewport={"width": 1280, "height": 720})
    page.goto(f"{address}/?token={TOKEN}")
    assert page.url == f"{address}/"  # the token traded for the cookie, out of the address
    assert cell(page, "jobs", "ready") == "7"
    page.click('a[href="/queues/jobs"]')
    page.wait_for_selector("table.rows")
    assert page.locator("table.rows tbody tr").count() == 7
    shot(page, "queue")

    page.goto(f"{address}/")
    # events on (-E), with their heartbeats, for the workers page
    argv = [each for each in worker_argv("tests.ops.apps", "prefork", 2)
            if each != "--without-heartbeat"]
    worker = processes.spawn("w1", [*argv, "-E", "-Q", "jobs,limited", "-n", "w1@%h"], env)
    wait_until(lambda: worker_ready(worker), LIMIT, "the worker", alive=[worker])
    # the same page, never reloaded: the live refresh brings the worker's progress
    wait_until(lambda: cell(page, "jobs", "ready") == "0"
               and cell(page, "jobs", "dead_letters").startswith("1"), LIMIT,
               "the figures to change as the worker runs the tasks", alive=[worker])

    page.click('tr[data-queue="jobs"] td.dead_letters a')
    page.wait_for_selector("table.dead")
    assert "ops.record" in page.locator("table.dead tbody").inner_text()
    shot(page, "dead")
    page.click("table.dead tbody tr td a")
    page.wait_for_selector("dd.arguments")
    assert page.locator("dd.arguments").inner_text() == 'args=[7, "cured"] kwargs={}'
    shot(page, "dead_one")

    forged = page.request.post(f"{address}/dead/requeue",
                               form={"dlq": "jobs.dead", "confirm": "yes"})
    assert forged.status == 403 and "CSRF token" in forged.text()
    (runs / "cured").touch()
    page.click('form[action="/dead/requeue"] button')
    page.wait_for_selector("p.confirm")
    assert "Requeue 1 dead letter?" in page.locator("h1").inner_text()
    shot(page, "confirm")
    page.click("button.danger")
    page.wait_for_selector("p.done")
    assert page.locator("p.done").inner_text() == "requeued 1"
    wait_until(lambda: list(runs.glob("7.*")), LIMIT, "the requeued task to run",
               alive=[worker])

    page.click('a[href="/failures"]')
    page.wait_for_selector("table.failures")
    wait_until(lambda: "TypeError" in page.locator("table.failures").inner_text(), LIMIT,
               "the failure on the live page", alive=[worker])
    shot(page, "failures")

    page.click('a[href="/schedules"]')
    row = page.locator('tr[data-schedule="nightly-report"]')
    assert row.locator("td.state").inner_text() == "enabled"
    row.locator("button").click()
    page.wait_for_selector("p.done")
    assert page.locator('tr[data-schedule="nightly-report"] td.state').inner_text() == (
        "paused")
    shot(page, "schedules")

    page.click('a[href="/outbox"]')
    assert "No outbox" in page.locator("main").inner_text()  # this app installs none
    assert re.search(r"postgresql\+psycopg://[^ ]*", page.locator("header").inner_text())

    # two tasks of tenant-1 (one at a time) and one of tenant-2 stay in work
    for key in ("tenant-1", "tenant-1", "tenant-2"):
        app.send_task("ops.hold", (LIMIT,), queue="limited", limit_key=key)
    page.click('a[href="/limits"]')
    wait_until(lambda: page.locator('table.keys[data-queue="limited"] td.in_work')
               .all_inner_texts() == ["1", "1"], LIMIT, "the keys in work, live",
               alive=[worker])
    assert "tenant-: 1" in page.locator('table.limits[data-queue="limited"]').inner_text()
    shot(page, "limits")

    page.click('a[href="/workers"]')
    wait_until(lambda: page.locator("tr[data-worker] td.heartbeat").count() == 1
               and page.locator("tr[data-worker] td.heartbeat").inner_text().endswith(
                   "s ago"), LIMIT, "the worker's heartbeat, live", alive=[worker])
    assert page.locator("tr[data-worker] td.state").inner_text() == "online"
    assert page.locator("tr[data-worker] td.in_work").inner_text() == "2"
    assert page.locator("tr[data-worker] td.pid").inner_text() == str(worker.popen.pid)
    assert page.locator("table.active tbody tr").count() == 2
    shot(page, "workers")

    page.click('a[href="/pauses"]')
    jobs = page.locator('tr[data-queue="jobs"]')
    jobs.locator('input[name="reason"]').fill("moving the ledger")
    jobs.locator("button").click()
    page.wait_for_selector("p.done")
    assert page.locator("p.done").inner_text() == "paused jobs"
    assert page.locator('tr[data-queue="jobs"] td.state').inner_text() == "paused"
    shot(page, "pauses")
    (runs / "release").touch()  # the held tasks end

    # the chart: the seven tasks of jobs settled (five sums, the TypeError, the requeued
    # one), as the worker writes its counts (every 15 s)
    page.click('a[href="/"]')
    wait_until(lambda: page.locator('tr[data-chart="jobs"] td.total').inner_text() == "7",
               LIMIT, "the throughput chart to count the settled tasks", alive=[worker])
    assert page.locator('tr[data-chart="jobs"] svg rect').count() >= 1
    shot(page, "queues")
