"""The shop site's tests run on its database, migrated once per run."""

from __future__ import annotations

import os
from collections.abc import Iterator

import django
import pytest

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "shopsite.settings")
django.setup()


@pytest.fixture(scope="session", autouse=True)
def test_environment() -> None:
    """Django's test environment (its test server among the allowed hosts), once."""
    from django.test.utils import setup_test_environment

    setup_test_environment()


@pytest.fixture(scope="session", autouse=True)
def migrated() -> None:
    from django.core.management import call_command

    call_command("migrate", verbosity=0)


@pytest.fixture(autouse=True)
def empty_queue() -> Iterator[None]:
    from shopsite.celery import app, mail

    for each in (app, mail):
        with each.connection_for_write() as conn:
            conn.default_channel.queue_purge("celery")
    yield
