"""Alembic's environment for the guide's migration: the database of proj.py."""

from __future__ import annotations

import os

from alembic import context
from sqlalchemy import create_engine

from kombu_sqlinbox.broker import sqlalchemy_url

URL = os.environ.get("OPS_EXAMPLE_URL", "sqlite:///ops-example.db")
VERSION_TABLE = os.environ.get("OPS_EXAMPLE_PREFIX", "sqlinbox_") + "alembic_version"

if context.is_offline_mode():
    context.configure(url=str(sqlalchemy_url(URL)), version_table=VERSION_TABLE,
                      literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()
else:
    engine = create_engine(sqlalchemy_url(URL))
    with engine.connect() as connection:
        context.configure(connection=connection, version_table=VERSION_TABLE)
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()
