"""The database scheduler's schedules in the admin: listed, added, changed, paused,
resumed and removed, each change made through the scheduler's own rules."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import timedelta
from io import StringIO

import pytest
from celery.schedules import crontab
from django.contrib.auth.models import User
from django.core.management import call_command
from django.test import Client
from django.test.utils import setup_test_environment

from celery_ext.django.admin import schedules

PAGES = "/admin/sqlinbox/schedule/"


@pytest.fixture(scope="module", autouse=True)
def test_environment() -> None:
    setup_test_environment()


@pytest.fixture
def client() -> Iterator[Client]:
    user = User.objects.create_superuser(f"ops-{uuid.uuid4().hex[:8]}", "ops@example.com", "x")
    browser = Client()
    browser.force_login(user)
    yield browser
    user.delete()
    for each in schedules().all():
        schedules().remove(each.name)


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
