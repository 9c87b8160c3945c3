"""The result backend given odd settings and rows: ``result_expires`` values an
operator may mistake for "never", rows written by hand."""

from __future__ import annotations

import math
from datetime import timedelta

import pytest
from celery import Celery

from kombu_sqlinbox.errors import ConfigurationError


def results_app(db_url: str, table_prefix: str, **conf: object) -> Celery:
    app = Celery("edges", broker="memory://", backend="sqlinbox+" + db_url,
                 set_as_current=False)
    app.conf.update(result_backend_transport_options={"table_prefix": table_prefix}, **conf)
    return app


@pytest.mark.parametrize("expires", [-1, timedelta(seconds=-60), math.inf])
def test_a_result_expiry_that_is_no_age_is_refused_not_taken_as_deleting_every_result(
        db_url: str, table_prefix: str, expires: object) -> None:
    """A negative ``result_expires`` (-1, "never" elsewhere) made ``backend_cleanup``
    delete every result, a task's finished a moment ago and running chords' counters
    included; an infinite one failed the cleanup on MariaDB. Both are refused as the
    backend starts, saying what keeps results for ever."""
    app = results_app(db_url, table_prefix, result_expires=expires)
    try:
        with pytest.raises(ConfigurationError, match="None or 0 keeps"):
            app.backend.cleanup()
    finally:
        app.close()


@pytest.mark.parametrize("expires", [None, 0, timedelta(0)])
def test_no_result_expiry_keeps_every_result(db_url: str, table_prefix: str,
                                             expires: object) -> None:
    app = results_app(db_url, table_prefix, result_expires=expires)
    try:
        app.backend.mark_as_done("kept", 1)
        app.backend.cleanup()
        assert app.AsyncResult("kept").get(timeout=5) == 1
    finally:
        app.close()


@pytest.mark.databases("postgresql", "mysql")
def test_a_backend_url_spelling_the_default_port_is_the_brokers_database(
        db_url: str, table_prefix: str) -> None:
    """The broker's URL without a port, the backend's with the server's default one: the
    same database, so chords are counted in SQL (the backend's broker for them) and
    results written with their ack. Told apart, both silently fell back to writing apart
    (and ``chord_unlock``)."""
    from sqlalchemy.engine import make_url

    import kombu_sqlinbox  # noqa: F401  (registers the sqlinbox alias)

    url = make_url(db_url)
    default = 5432 if url.get_backend_name() == "postgresql" else 3306
    if url.port not in (None, default):
        pytest.skip("the server under test is not on its default port")
    bare = url._replace(port=None).render_as_string(hide_password=False)  # set() keeps it
    ported = url.set(port=default).render_as_string(hide_password=False)
    app = Celery("ports", broker="sqlinbox+" + bare, backend="sqlinbox+" + ported,
                 set_as_current=False)
    app.conf.update(broker_transport_options={"table_prefix": table_prefix},
                    result_backend_transport_options={"table_prefix": table_prefix})
    try:
        assert app.backend._chord_broker() is not None
    finally:
        app.close()
