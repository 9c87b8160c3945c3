"""The result backend's configuration, checked before anything connects: the URL Celery
hands it, its options, and the URL it shows."""

from __future__ import annotations

import pytest
from celery import Celery

from celery_ext.results import SqlInboxBackend
from kombu_sqlinbox.errors import ConfigurationError


def app_with(backend: str, **conf: object) -> Celery:
    app = Celery("results", broker="memory://", backend=backend, set_as_current=False)
    app.conf.update(conf)
    return app


def test_celery_finds_the_backend_by_its_url_scheme() -> None:
    for url in ("sqlinbox+postgresql://u@h/db", "sqlinbox+postgres://u@h/db",
                "sqlinbox+mysql://root@h/db", "sqlinbox+sqlite:///jobs.db"):
        backend = app_with(url).backend
        assert isinstance(backend, SqlInboxBackend), url
        assert backend.url == url.removeprefix("sqlinbox+")


def test_the_shown_url_masks_the_password() -> None:
    backend = app_with("sqlinbox+postgresql://app:s3cret@db.internal/shop").backend
    assert backend.as_uri() == "sqlinbox+postgresql://app:**@db.internal/shop"
    assert backend.as_uri(include_password=True) == (
        "sqlinbox+postgresql://app:s3cret@db.internal/shop")


def test_the_table_prefix_follows_the_brokers_unless_given() -> None:
    follows = app_with("sqlinbox+sqlite:///jobs.db",
                       broker_transport_options={"table_prefix": "shop_"}).backend
    own = app_with("sqlinbox+sqlite:///jobs.db",
                   broker_transport_options={"table_prefix": "shop_"},
                   result_backend_transport_options={"table_prefix": "res_"}).backend
    default = app_with("sqlinbox+sqlite:///jobs.db").backend
    assert [b.options["table_prefix"] for b in (follows, own, default)] == [
        "shop_", "res_", "sqlinbox_"]


def test_an_unknown_option_is_refused_naming_the_known_ones() -> None:
    app = app_with("sqlinbox+sqlite:///jobs.db",
                   result_backend_transport_options={"table_prefx": "x_"})
    with pytest.raises(ConfigurationError, match=r"unknown key\(s\) table_prefx; .*table_prefix"):
        _ = app.backend


def test_a_backend_without_a_url_says_how_to_write_one() -> None:
    app = app_with("celery_ext.results:SqlInboxBackend")
    with pytest.raises(ConfigurationError, match="result_backend = 'sqlinbox\\+postgresql://"):
        _ = app.backend


def test_the_backend_pickles_with_its_url_and_expiry() -> None:
    """Celery pickles a backend into pool processes and canvas callbacks."""
    import pickle

    from celery._state import _set_current_app

    app = app_with("sqlinbox+mysql://root@h/db", result_expires=120)
    _set_current_app(app)
    try:
        copy = pickle.loads(pickle.dumps(app.backend))
    finally:
        _set_current_app(None)
    assert isinstance(copy, SqlInboxBackend)
    assert (copy.url, copy.expires) == ("mysql://root@h/db", 120.0)
