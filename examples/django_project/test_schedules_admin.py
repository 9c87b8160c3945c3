"""The database scheduler's schedules in the admin: listed, added, changed, paused,
resumed and removed, each change made through the scheduler's own rules."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from io import StringIO

import pytest
from celery.schedules import crontab
from django.contrib.admin.utils import quote
from django.contrib.auth.models import User
from django.core.management import call_command
from django.db import connection, connections
from django.test import Client
from django.test.utils import override_settings
from django.utils.html import escape
from sqlalchemy import text

from celery_ext.django import admin
from celery_ext.django.admin import schedules

PAGES = "/admin/sqlinbox/schedule/"


@pytest.fixture
def client() -> Iterator[Client]:
    user = User.objects.create_superuser(f"ops-{uuid.uuid4().hex[:8]}", "ops@example.com", "x")
    browser = Client()
    browser.force_login(user)
    yield browser
    user.delete()
    store = schedules()
    for name in store.database.run(lambda conn: conn.execute(text(
            f"SELECT name FROM {store.dialect.quote(store.sql.names[0])}")).scalars().all()):
        store.remove(name.decode() if isinstance(name, bytes) else name)


def test_the_list_shows_each_schedule_its_timing_and_next_run(client: Client) -> None:
    schedules().add("nightly-report", "orders.tasks.send_receipt", crontab(minute=0, hour=3))
    page = client.get(PAGES).content.decode()
    assert "nightly-report" in page and "crontab:0 3 * * *" in page
    assert "orders.tasks.send_receipt" in page


def test_a_schedule_added_in_the_admin_runs_by_the_databases_clock(client: Client) -> None:
    before = schedules().now()
    answer = client.post(f"{PAGES}add/", {
        "name": "tidy", "task": "orders.tasks.reserve_stock", "when": "every:30",
        "arguments": "[7]", "keyword_arguments": "{}", "queue": "", "misfire": "skip",
        "grace": "1", "enabled": "1"})
    assert answer.status_code == 302, answer.content.decode()
    stored = schedules().get("tidy")
    assert stored is not None and stored.enabled and stored.args == [7]
    assert before + 30 <= stored.next_run_at <= schedules().now() + 30


def test_a_mistake_is_shown_on_the_form_and_nothing_is_stored(client: Client) -> None:
    answer = client.post(f"{PAGES}add/", {
        "name": "broken\x00", "task": "orders.tasks.reserve_stock", "when": "every:soon",
        "arguments": "{}", "keyword_arguments": "{oops", "misfire": "later", "grace": "-1",
        "enabled": "1"})
    page = answer.content.decode()
    assert answer.status_code == 200
    assert "a JSON list is needed" in page and "not JSON" in page
    assert "Select a valid choice" in page and "greater than or equal to 0" in page
    assert "every:soon" in page and "errorlist" in page
    assert "Null characters are not allowed" in page  # the scheduler's rule for names
    assert schedules().all() == []


def test_a_change_keeps_the_options_the_admin_does_not_show(client: Client) -> None:
    schedules().add("sync", "orders.tasks.reserve_stock", timedelta(seconds=60),
                    options={"expires": 50, "priority": 3})
    answer = client.post(f"{PAGES}sync/change/", {
        "task": "orders.tasks.reserve_stock", "when": "every:120", "arguments": "[]",
        "keyword_arguments": "{}", "queue": "stock", "misfire": "catch_up", "grace": "1",
        "enabled": "0"})
    assert answer.status_code == 302, answer.content.decode()
    stored = schedules().get("sync")
    assert stored is not None
    assert stored.options == {"expires": 50, "priority": 3, "queue": "stock"}
    assert (stored.spec, stored.misfire, stored.enabled) == ('{"every": 120.0}', "catch_up",
                                                             False)


def test_pause_resume_and_delete_from_the_list(client: Client) -> None:
    for name in ("a", "b"):
        schedules().add(name, "orders.tasks.reserve_stock", timedelta(seconds=60))
    client.post(PAGES, {"action": "pause", "_selected_action": ["a", "b"]})
    assert [each.enabled for each in schedules().all()] == [False, False]
    client.post(PAGES, {"action": "resume", "_selected_action": ["b"]})
    assert [each.enabled for each in schedules().all()] == [False, True]
    client.post(f"{PAGES}a/delete/", {"post": "yes"})
    assert [each.name for each in schedules().all()] == ["b"]


def test_the_model_matches_its_migrations() -> None:
    out = StringIO()
    call_command("makemigrations", "sqlinbox", "--check", "--dry-run", stdout=out)
    assert "No changes detected" in out.getvalue()


def set_column(name: str, column: str, value: str) -> None:
    """A schedule's row changed by hand (an operator's SQL, a newer version's kind)."""
    store = schedules()
    table = store.dialect.quote(store.sql.names[0])
    store.database.run(lambda conn: conn.execute(
        text(f"UPDATE {table} SET {column} = :value WHERE name = :name"),
        {"value": value, "name": name}))


@pytest.mark.parametrize(("column", "value"), [
    ("kind", "weekly"), ("spec", "{oops"), ("spec", '{"every": "soon"}'), ("spec", "[1]"),
    ("options", "{oops"), ("args", "nope")])
def test_a_row_the_scheduler_cannot_read_is_listed_and_can_be_fixed(
        client: Client, column: str, value: str) -> None:
    schedules().add("ok", "orders.tasks.reserve_stock", 60.0)
    schedules().add("odd", "orders.tasks.reserve_stock", 60.0)
    set_column("odd", column, value)
    listed = client.get(PAGES)
    assert listed.status_code == 200
    assert "odd" in listed.content.decode() and "every:60" in listed.content.decode()
    shown = client.get(f"{PAGES}odd/change/")
    assert shown.status_code == 200
    answer = client.post(f"{PAGES}odd/change/", {
        "task": "orders.tasks.reserve_stock", "when": "every:30", "arguments": "[]",
        "keyword_arguments": "{}", "queue": "", "misfire": "skip", "grace": "1",
        "enabled": "1"})
    assert answer.status_code == 302, answer.content.decode()
    fixed = schedules().get("odd")
    assert fixed is not None and (fixed.kind, fixed.spec) == ("interval", '{"every": 30.0}')


ODD_NAMES = ["reports/daily", "with space", "Ünïcødé ☃", "quote\"s 'and' <tags>", "50%_2F?x=1#y",
             "trailing "]


def test_names_with_odd_characters_are_shown_changed_and_deleted(client: Client) -> None:
    for name in ODD_NAMES:
        schedules().add(name, "orders.tasks.reserve_stock", 60.0)
    listed = client.get(PAGES).content.decode()
    for name in ODD_NAMES:
        assert escape(name) in listed, name
        url = f"{PAGES}{quote(name)}/change/"  # as the admin links to it
        assert client.get(url).status_code == 200, name
        answer = client.post(url, {
            "task": "orders.tasks.reserve_stock", "when": "every:30", "arguments": "[]",
            "keyword_arguments": "{}", "queue": "", "misfire": "skip", "grace": "1",
            "enabled": "0"})
        assert answer.status_code == 302, (name, answer.content.decode())
        changed = schedules().get(name)
        assert changed is not None and not changed.enabled, name
    assert {each.name for each in schedules().all()} == set(ODD_NAMES)
    for name in ODD_NAMES:
        answer = client.post(f"{PAGES}{quote(name)}/delete/", {"post": "yes"})
        assert answer.status_code == 302, name
    assert schedules().all() == []


def test_a_schedule_another_process_deleted_is_gone_not_an_error(client: Client) -> None:
    for name in ("a", "b"):
        schedules().add(name, "orders.tasks.reserve_stock", 60.0)
    client.get(f"{PAGES}a/delete/")
    schedules().remove("a")  # by the command line, meanwhile
    assert client.post(f"{PAGES}a/delete/", {"post": "yes"}).status_code == 302
    assert client.get(f"{PAGES}a/change/").status_code == 302
    changed = client.post(f"{PAGES}a/change/", {
        "task": "orders.tasks.reserve_stock", "when": "every:30", "arguments": "[]",
        "keyword_arguments": "{}", "queue": "", "misfire": "skip", "grace": "1",
        "enabled": "1"})
    assert changed.status_code == 302 and schedules().get("a") is None
    for action in ("pause", "delete_selected"):
        answer = client.post(PAGES, {"action": action, "_selected_action": ["a", "b"],
                                     "post": "yes"})
        assert answer.status_code in (200, 302), action
    assert schedules().all() == []


def test_many_schedules_are_paged_and_searched_by_name_in_any_case(client: Client) -> None:
    for n in range(150):
        schedules().add(f"Report-{n:03}", f"orders.tasks.Report{n % 3}", 60.0 + n)
    first = client.get(PAGES).content.decode()
    assert "150 periodic tasks" in first and "Report-099" in first and "Report-100" not in first
    assert "Report-149" in client.get(f"{PAGES}?p=2").content.decode()
    found = client.get(f"{PAGES}?q=report-12").content.decode()
    assert "10 results" in found and "Report-120" in found  # names are bytes on MariaDB
    assert "50 results" in client.get(f"{PAGES}?q=tasks.report2").content.decode()


@pytest.fixture
def second_database() -> Iterator[str]:
    """Another database of the site, migrated, as ``SQLINBOX_SCHEDULES_DATABASE``; the
    default database keeps its own (empty) schedules table."""
    alias, name = "schedules", f"sched_{uuid.uuid4().hex[:8]}"
    default = connections.settings["default"]
    if connection.vendor == "sqlite":
        connections.settings[alias] = {**default, "NAME": f"{default['NAME']}-{name}"}
    else:
        with connection.cursor() as cursor:
            cursor.execute(f"CREATE DATABASE {name}")
        connections.settings[alias] = {**default, "NAME": name}
    try:
        with override_settings(SQLINBOX_SCHEDULES_DATABASE=alias):
            call_command("migrate", database=alias, verbosity=0)
            yield alias
    finally:
        connections[alias].close()
        del connections[alias], connections.settings[alias]
        admin._stores.pop(alias).close()
        if connection.vendor != "sqlite":
            with connection.cursor() as cursor:
                force = " WITH (FORCE)" if connection.vendor == "postgresql" else ""
                cursor.execute(f"DROP DATABASE {name}{force}")


def test_the_admin_on_another_database_refuses_a_name_it_holds(
        client: Client, second_database: str) -> None:
    schedules().add("sync", "orders.tasks.reserve_stock", 60.0)
    assert "sync" in client.get(PAGES).content.decode()
    answer = client.post(f"{PAGES}add/", {
        "name": "sync", "task": "orders.tasks.send_receipt", "when": "every:5",
        "arguments": "[]", "keyword_arguments": "{}", "queue": "", "misfire": "skip",
        "grace": "1", "enabled": "1"})
    assert answer.status_code == 200 and "already exists" in answer.content.decode()
    stored = schedules().get("sync")
    assert stored is not None and stored.task == "orders.tasks.reserve_stock"
    assert client.post(f"{PAGES}sync/delete/", {"post": "yes"}).status_code == 302
    assert schedules().all() == []


def test_a_schedule_changed_while_a_scheduler_ticks_it(client: Client) -> None:
    schedules().add("busy", "orders.tasks.reserve_stock", 0.05, args=[1])
    stop, failed = threading.Event(), []

    def tick() -> None:  # a scheduler's ticks, on a connection of its own
        while not stop.is_set():
            try:
                schedules().run_due()
            except Exception as exc:  # shown by the test, not lost in the thread
                failed.append(exc)
                return

    scheduler = threading.Thread(target=tick)
    scheduler.start()
    try:
        for n in range(30):
            answer = client.post(f"{PAGES}busy/change/", {
                "task": "orders.tasks.reserve_stock",
                "when": "every:0.06" if n % 10 == 9 else "every:0.05",
                "arguments": f"[{n}]", "keyword_arguments": "{}", "queue": "",
                "misfire": "skip", "grace": "1", "enabled": str(n % 3 and 1)})
            assert answer.status_code == 302, (n, answer.content.decode()[-3000:])
        ticked = time.monotonic() + 10
        while not schedules().ticks("busy") and time.monotonic() < ticked:
            time.sleep(0.05)
    finally:
        stop.set()
        scheduler.join(30)
    assert not failed
    stored = schedules().get("busy")
    assert stored is not None and (stored.args, stored.enabled) == ([29], True)
    assert schedules().ticks("busy")
