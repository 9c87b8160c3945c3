"""The sqlinbox dashboard mounted in the site: only staff see it (others are sent to the
admin's login), its figures are the site's queue, its links and forms stay under the
mount, and its actions take its own CSRF token."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator

import pytest
from django.contrib.auth.models import User
from django.test import Client, override_settings
from orders.tasks import reserve_stock

from celery_ext.django.admin import schedules

MOUNT = "/ops/dashboard"


def browser(staff: bool) -> Iterator[Client]:
    user = User.objects.create_user(f"u-{uuid.uuid4().hex[:8]}", "u@example.com", "x",
                                    is_staff=staff)
    made = Client()
    made.force_login(user)
    yield made
    user.delete()


@pytest.fixture
def staff() -> Iterator[Client]:
    yield from browser(staff=True)


@pytest.fixture
def customer() -> Iterator[Client]:
    yield from browser(staff=False)


def test_only_staff_see_the_dashboard(customer: Client) -> None:
    for client in (Client(), customer):
        answer = client.get(f"{MOUNT}/")
        assert answer.status_code == 302
        assert answer["Location"].startswith("/admin/login/")


def test_staff_see_the_sites_queue_under_the_mount(staff: Client) -> None:
    reserve_stock.delay(7)
    page = staff.get(f"{MOUNT}/")
    assert page.status_code == 200
    html = page.content.decode()
    row = re.search(r'<tr data-queue="celery">(.*?)</tr>', html, re.S)
    assert row and '<td class="ready">1</td>' in row.group(1)
    assert f'href="{MOUNT}/dead"' in html and f'src="{MOUNT}/static/dashboard.js"' in html
    assert page["Content-Security-Policy"].startswith("default-src 'none'")
    assert staff.get(f"{MOUNT}/static/dashboard.css").status_code == 200


def test_a_schedule_is_paused_with_the_dashboards_csrf_token(staff: Client) -> None:
    store = schedules()
    store.add("nightly", "orders.tasks.reserve_stock", 3600.0)
    try:
        page = staff.get(f"{MOUNT}/schedules").content.decode()
        token = re.search(r'name="csrf" value="([^"]+)"', page)
        assert token
        refused = staff.post(f"{MOUNT}/schedules/pause", {"name": "nightly"})
        assert refused.status_code == 403
        done = staff.post(f"{MOUNT}/schedules/pause", {"name": "nightly",
                                                       "csrf": token.group(1)})
        assert done.status_code == 303 and done["Location"].startswith(f"{MOUNT}/schedules")
        found = store.get("nightly")
        assert found is not None and not found.enabled
    finally:
        store.remove("nightly")


@override_settings(SECURE_PROXY_SSL_HEADER=("HTTP_X_FORWARDED_PROTO", "https"))
def test_an_action_behind_a_tls_proxy_is_of_the_sites_own_origin(staff: Client) -> None:
    """Behind a proxy ending TLS, the site's address is https (Django's setting says so):
    the dashboard compares a form's origin with that one."""
    store = schedules()
    store.add("hourly", "orders.tasks.reserve_stock", 3600.0)
    try:
        proxied = {"HTTP_HOST": "testserver", "HTTP_X_FORWARDED_PROTO": "https",
                   "HTTP_ORIGIN": "https://testserver"}
        page = staff.get(f"{MOUNT}/schedules", **proxied).content.decode()
        token = re.search(r'name="csrf" value="([^"]+)"', page)
        assert token
        done = staff.post(f"{MOUNT}/schedules/pause", {"name": "hourly",
                                                       "csrf": token.group(1)}, **proxied)
        assert done.status_code == 303, done.content.decode()
        refused = staff.post(f"{MOUNT}/schedules/resume", {
            "name": "hourly", "csrf": token.group(1)},
            **{**proxied, "HTTP_ORIGIN": "http://testserver"})  # not the site's scheme
        assert refused.status_code == 403
        found = store.get("hourly")
        assert found is not None and not found.enabled
    finally:
        store.remove("hourly")
