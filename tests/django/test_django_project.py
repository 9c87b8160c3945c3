"""The sample Django site (examples/django_project) runs its own tests, by pytester in a
pytest of their own, on SQLite and on PostgreSQL: orders and their tasks commit or roll
back with ``transaction.atomic()``, the outbox's send waits for ``on_commit``, and the
migrations create and drop the inbox's and outbox's tables."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from tests.databases import require_server
from tests.docs.support import EXAMPLES

SITE = EXAMPLES / "django_project"


@pytest.fixture
def site_database(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """The site's database: a new SQLite file, or a new database on the PostgreSQL server
    (Django's own tables must not meet another test's)."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'site.sqlite3'}"
        return
    server = make_url(require_server("postgresql"))
    name = f"site_{uuid.uuid4().hex[:10]}"
    admin = create_engine(server, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    yield server.set(drivername="postgresql", database=name).render_as_string(
        hide_password=False)
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE "{name}" WITH (FORCE)'))
    admin.dispose()


@pytest.mark.parametrize("site_database", ["sqlite", "postgresql"], indirect=True)
def test_the_site_tests_pass(site_database: str, pytester: pytest.Pytester,
                             monkeypatch: pytest.MonkeyPatch) -> None:
    shutil.copytree(SITE, pytester.path, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("*.sqlite3", "__pycache__"))
    monkeypatch.setenv("SHOP_DATABASE", site_database)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=6)
