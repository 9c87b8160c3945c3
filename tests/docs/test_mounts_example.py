"""The dashboard guide's mounts (examples/mounts/sites.py), each served by its own web
framework's test client on a real database: refused until the site signed the person in,
its pages and links under the mount, a queue paused through it in the person's name, and
its CSRF token required."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import pytest
from fastapi.testclient import TestClient  # the test extra installs FastAPI

from kombu_sqlinbox.operations import Operations
from kombu_sqlinbox.options import parse_options

from .support import load_example


@pytest.fixture
def sites(monkeypatch: pytest.MonkeyPatch, broker_url: str, table_prefix: str
          ) -> Iterator[ModuleType]:
    monkeypatch.setenv("MOUNTS_BROKER_URL", broker_url)
    monkeypatch.setenv("MOUNTS_PREFIX", table_prefix)
    yield load_example("mounts/sites.py")


def flask_client(sites: ModuleType) -> Any:
    return sites.flask_site().test_client()


def fastapi_client(sites: ModuleType) -> Any:
    return TestClient(sites.fastapi_site())


@pytest.mark.parametrize("database", ["sqlite", "postgresql"], indirect=True)
@pytest.mark.parametrize("client_of", [flask_client, fastapi_client],
                         ids=["flask", "fastapi"])
def test_the_mounted_dashboard_is_the_signed_in_persons(
        sites: ModuleType, client_of: Callable[[ModuleType], Any], database: str) -> None:
    client = client_of(sites)
    mount = sites.MOUNT
    refused = client.get(f"{mount}/pauses")
    assert refused.status_code == 401  # nobody signed in to the site
    assert client.post("/login?user=alice").status_code == 200
    page = client.get(f"{mount}/pauses")
    assert page.status_code == 200
    text = page.get_data(as_text=True) if hasattr(page, "get_data") else page.text
    assert f'href="{mount}/workers"' in text and f'action="{mount}/pauses/pause"' in text
    assert f'href="{mount}/static/dashboard.css"' in text
    assert 'data-queue="orders"' in text
    assert client.get(f"{mount}/limits").status_code == 200
    csrf = re.search(r'name="csrf" value="([^"]+)"', text)
    assert csrf
    form = {"csrf": csrf.group(1), "queue": "orders", "reason": "stock count"}
    assert client.post(f"{mount}/pauses/pause",
                       data={"queue": "orders"}).status_code == 403  # no CSRF token
    done = client.post(f"{mount}/pauses/pause", data=form, follow_redirects=False)
    assert done.status_code == 303
    assert done.headers["Location"].startswith(f"{mount}/pauses?done=")
    celery_app = sites.celery_app()
    ops = Operations(sites.os.environ["MOUNTS_BROKER_URL"],
                     parse_options(celery_app.conf.broker_transport_options), ["orders"])
    try:
        assert [(each.queue, each.by, each.reason) for each in ops.paused()] == [
            ("orders", "alice (dashboard)", "stock count")]
    finally:
        ops.close()


@pytest.mark.parametrize("database", ["postgresql"], indirect=True)
@pytest.mark.parametrize("client_of", [flask_client, fastapi_client],
                         ids=["flask", "fastapi"])
def test_a_mounted_page_that_fails_is_the_dashboards_500_not_the_sites(
        sites: ModuleType, client_of: Callable[[ModuleType], Any], database: str) -> None:
    """A column of the paused queues' table dropped under the site: the mounted pauses
    page is the dashboard's plain 500 page, not an error raised into the site."""
    celery_app = sites.celery_app()
    ops = Operations(sites.os.environ["MOUNTS_BROKER_URL"],
                     parse_options(celery_app.conf.broker_transport_options), ["orders"])
    try:
        ops.pause("orders", None, "ops")
        paused = ops.dialect.quote(f"{ops.options.table_prefix}paused_queues")
        ops.broker.run(lambda conn: conn.exec_driver_sql(
            f"ALTER TABLE {paused} DROP COLUMN paused_by"))
    finally:
        ops.close()
    client = client_of(sites)
    assert client.post("/login?user=alice").status_code == 200
    page = client.get(f"{sites.MOUNT}/pauses")
    text = page.get_data(as_text=True) if hasattr(page, "get_data") else page.text
    assert page.status_code == 500, text
    assert "ProgrammingError" in text and "Traceback" not in text and "paused_by" not in text
