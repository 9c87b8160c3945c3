"""The pytest entry point of kombu-sqlinbox: options only, fixtures when the project asks.

Installed with the distribution, this module adds its command-line and ini options and
nothing else. The fixtures (:mod:`celery_ext.testing`) load when a project opts in:
``-p celery_ext.testing``, ``pytest_plugins = ["celery_ext.testing"]`` in a conftest,
``--sqlinbox`` or ``sqlinbox = true`` in its pytest ini.
"""

from __future__ import annotations

from typing import Any

FIXTURES = "celery_ext.testing"


def pytest_addoption(parser: Any) -> None:
    group = parser.getgroup("sqlinbox", "kombu-sqlinbox fixtures (celery_ext.testing)")
    group.addoption("--sqlinbox", action="store_true", default=False,
                    help="load the sqlinbox_* fixtures")
    group.addoption("--sqlinbox-url", default=None,
                    help="inbox database of the tests (an SQLAlchemy URL, with or without "
                         "sqlinbox+); default: $SQLINBOX_URL, else a new SQLite file per test")
    parser.addini("sqlinbox", type="bool", default=False, help="load the sqlinbox_* fixtures")
    parser.addini("sqlinbox_app", default="",
                  help="the service's Celery app the fixtures bind, as module:attribute")
    parser.addini("sqlinbox_worker_start", default="60",
                  help="seconds a worker process (sqlinbox_worker_process) has to start")


def pytest_configure(config: Any) -> None:
    wanted = config.getoption("sqlinbox") or config.getini("sqlinbox")
    if wanted and not config.pluginmanager.has_plugin(FIXTURES):
        config.pluginmanager.import_plugin(FIXTURES)
