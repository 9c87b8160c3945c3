"""What the dashboard's tests share: a browser signed in with the token, and what they
read off its pages."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

from werkzeug.test import Client, TestResponse

from celery_ext.dashboard import IDENTITY, Dashboard

TOKEN = "a-test-token"


def signed_in(dashboard: Dashboard) -> Client:
    """A browser that opened the address with the token once."""
    client = Client(dashboard)
    response = client.get(f"/dead?token={TOKEN}&queue=jobs")
    assert response.status_code == 303
    assert response.headers["Location"].endswith("/dead?queue=jobs")  # the token dropped
    return client


def signed_in_as(mounted: Dashboard, who: str) -> Client:
    """A browser of a host site that signed ``who`` in (as :data:`IDENTITY` names them)."""
    def host(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        environ[IDENTITY] = who
        return mounted(environ, start_response)
    return Client(host)


def csrf(response: TestResponse) -> str:
    found = re.search(r'name="csrf" value="([^"]+)"', response.text)
    assert found, response.text
    return found.group(1)


def figures(html: str, queue: str) -> dict[str, int]:
    """The figures a page shows in the row of ``queue``."""
    row = re.search(rf'<tr data-queue="{re.escape(queue)}">(.*?)</tr>', html, re.S)
    assert row, html
    return {name: int(value) for name, value in
            re.findall(r'<td class="(\w+)">(?:<a [^>]*>)?(\d+)', row.group(1))}


def ids(html: str, table: str) -> list[int]:
    body = re.search(rf'<table class="{table}">.*?<tbody>(.*?)</tbody>', html, re.S)
    assert body, html
    return [int(found) for found in re.findall(r"<tr[^>]*><td>(?:<a [^>]*>)?(\d+)", body.group(1))]
