"""The broker URL recipe: one URL from a ``DATABASES`` entry, for the broker, the outbox
and the engine over Django's connection alike (the transport checks they match); and
what ``bind()`` takes."""

from __future__ import annotations

import pytest

import celery_ext
from celery_ext.django import broker_url, database_url


def test_a_postgresql_entry_gives_its_url_port_and_all() -> None:
    entry = {"ENGINE": "django.db.backends.postgresql", "NAME": "shop", "USER": "app",
             "PASSWORD": "s3cret", "HOST": "db", "PORT": "5433"}
    assert broker_url(entry) == "sqlinbox+postgresql://app:s3cret@db:5433/shop"
    assert database_url(entry, "psycopg").drivername == "postgresql+psycopg"


def test_an_sqlite_entry_gives_its_file() -> None:
    entry = {"ENGINE": "django.db.backends.sqlite3", "NAME": "/srv/shop.sqlite3"}
    assert broker_url(entry) == "sqlinbox+sqlite:////srv/shop.sqlite3"


def test_a_database_the_transport_cannot_serve_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"django\.db\.backends\.oracle"):
        broker_url({"ENGINE": "django.db.backends.oracle", "NAME": "shop"})


def test_bind_refuses_what_is_neither_sqlalchemy_nor_django() -> None:
    with pytest.raises(TypeError, match="Session or Connection or Django's connection"), \
            celery_ext.bind(object()):
        pass
