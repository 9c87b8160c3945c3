"""The dashboard's pages of the app's own parts, on the real databases: the recent
failures the sqlinbox result backend stored, the database scheduler's schedules paused
and resumed; each page says so when the app has no such part."""

from __future__ import annotations

import json
import re

from celery import Celery
from sqlalchemy.engine import Engine

from celery_ext.beat import Schedules
from celery_ext.dashboard import Dashboard
from kombu_sqlinbox.operations import Operations
from tests.ops.apps import make_app
from tests.ops.dashboard_support import TOKEN, csrf, signed_in
from tests.ops.test_failures import age, fail


def test_recent_failures_latest_first_and_per_task(
        ops: Operations, broker_url: str, table_prefix: str, engine: Engine) -> None:
    app = make_app(broker_url, table_prefix, json.dumps({"extended": True}))
    fail(app, "f-1", "shop.pay", ValueError("card declined"))
    fail(app, "f-2", "shop.ship", KeyError("parcel 7"), worker="w2@h")
    fail(app, "f-old", "shop.pay", ValueError("yesterday"))
    age(engine, app, "f-1", 20)
    age(engine, app, "f-old", 86400)
    client = signed_in(Dashboard(ops, token=TOKEN, app=app))
    page = client.get("/failures").text
    assert "Recent failures, last 1h" in page
    latest = re.search(r'<table class="failures">.*?<tbody>(.*?)</tbody>', page, re.S)
    assert latest
    rows = re.findall(r"<tr><td>([^<]+)</td><td>([^<]+)</td>", latest.group(1))
    assert rows == [("f-2", "shop.ship"), ("f-1", "shop.pay")]  # f-old is out of the window
    assert "ValueError: card declined" in page and "w2@h" in page
    assert "f-old" in client.get("/failures?since=172800").text
    only = client.get("/failures?task=shop.ship").text
    assert "f-2" in only and "f-1" not in only


def test_failures_of_an_app_whose_results_are_elsewhere_say_so(
        ops: Operations, app: Celery) -> None:
    page = signed_in(Dashboard(ops, token=TOKEN, app=app)).get("/failures")
    assert page.status_code == 200
    assert "result backend is not sqlinbox" in page.text


def test_schedules_are_listed_paused_and_resumed(ops: Operations, app: Celery) -> None:
    client = signed_in(Dashboard(ops, token=TOKEN, app=app))
    assert "No schedule tables" in client.get("/schedules").text
    store = Schedules.for_app(app)
    try:
        store.ensure()
        store.add("tidy", "ops.add", 60.0, args=(1, 2))
        page = client.get("/schedules")
        row = re.search(r'<tr data-schedule="tidy">(.*?)</tr>', page.text, re.S)
        assert row and "every:60" in row.group(1) and ">enabled<" in row.group(1)
        token = csrf(page)
        done = client.post("/schedules/pause", data={"csrf": token, "name": "tidy"})
        assert done.status_code == 303
        assert "paused tidy" in client.get(done.headers["Location"]).text
        found = store.get("tidy")
        assert found is not None and not found.enabled
        assert ">paused<" in client.get("/schedules").text
        client.post("/schedules/resume", data={"csrf": token, "name": "tidy"})
        found = store.get("tidy")
        assert found is not None and found.enabled
        missing = client.post("/schedules/pause", data={"csrf": token, "name": "nothing"})
        assert missing.status_code == 404
        refused = client.post("/schedules/pause", data={"name": "tidy"})
        assert refused.status_code == 403
        found = store.get("tidy")
        assert found is not None and found.enabled
    finally:
        store.close()  # the tables go with the test's prefix


def test_the_outbox_page_says_the_app_has_none(ops: Operations, app: Celery) -> None:
    client = signed_in(Dashboard(ops, token=TOKEN, app=app))
    assert "No outbox" in client.get("/outbox").text
    assert "needs the app" in signed_in(Dashboard(ops, token=TOKEN)).get("/outbox").text
