"""The reference pages stay true: every transport option, the DDL and SQL as the code has them."""

from __future__ import annotations

import re
from dataclasses import MISSING, fields

import pytest
from sqlalchemy import create_engine

from kombu_sqlinbox.dialects import dialect_for
from kombu_sqlinbox.errors import DatabaseUnreachable
from kombu_sqlinbox.options import CLAIM_FORMS, KOMBU_KEYS, QueueOptions, TransportOptions
from kombu_sqlinbox.tables import default_table, table_name_for_queue
from tests.unit.test_layers import LAYERS

from .support import DOCS

#: TransportOptions fields that are not option keys (the global queue settings live here)
NOT_KEYS = {"defaults"}
CONFVAL = re.compile(r"^\.\. confval:: (\S+)\n((?:   .*\n|\n)*)", re.MULTILINE)


def documented() -> dict[str, str]:
    """``confval`` name -> its ``:default:`` text, from docs/configuration.rst."""
    text = (DOCS / "configuration.rst").read_text()
    found = {}
    for name, body in CONFVAL.findall(text):
        default = re.search(r"^   :default: (.*)$", body, re.MULTILINE)
        found[name] = default.group(1).strip() if default else ""
    return found


def code_options() -> dict[str, object]:
    """Every option key options.py accepts, with its default."""
    options: dict[str, object] = {}
    for cls in (TransportOptions, QueueOptions):
        for field in fields(cls):
            if field.name in NOT_KEYS:
                continue
            if field.default_factory is not MISSING:
                options[field.name] = field.default_factory()
            else:
                options[field.name] = field.default
    return options


def test_every_option_is_documented_with_its_default() -> None:
    docs = documented()
    for name, default in code_options().items():
        assert name in docs, f"transport option {name!r} is missing from docs/configuration.rst"
        shown = docs[name].strip("`")
        assert shown == repr(default), (
            f"docs/configuration.rst gives {name} the default {docs[name]}; the code has "
            f"{default!r}"
        )


def test_no_documented_option_is_unknown_to_the_code() -> None:
    known = set(code_options()) | set(KOMBU_KEYS)
    assert set(documented()) <= known, set(documented()) - known


@pytest.mark.parametrize("value", sorted(KOMBU_KEYS) + [repr(form) for form in CLAIM_FORMS])
def test_kombu_keys_and_claim_forms_are_described(value: str) -> None:
    assert f"``{value}``" in (DOCS / "configuration.rst").read_text(), value


@pytest.mark.parametrize("database, url", [
    ("postgresql", "postgresql+psycopg2://"),
    ("mysql", "mysql+pymysql://"),
    ("sqlite", "sqlite://"),
])
def test_default_layout_ddl_is_what_the_transport_runs(database: str, url: str) -> None:
    dialect = dialect_for(create_engine(url))
    ddl = ";\n".join(dialect.create_ddl(default_table(table_name_for_queue("celery")))) + ";\n"
    shown = (DOCS / "sql" / f"default-{database}.sql").read_text()
    assert shown == ddl, f"docs/sql/default-{database}.sql is stale; it should read:\n{ddl}"


def test_lease_statements_shown_are_what_the_transport_runs() -> None:
    """docs/sql/lease-postgresql.sql is formatted by hand; compared with whitespace folded."""
    def fold(sql: str) -> str:
        return re.sub(r"\s+", " ", sql).strip()

    statements = dialect_for(create_engine("postgresql+psycopg2://")).statements(
        default_table("sqlinbox_celery"))
    code = [*statements.claim, statements.extend, statements.complete, statements.release]
    shown = "\n".join(line for line in (DOCS / "sql" / "lease-postgresql.sql").read_text()
                      .splitlines() if not line.startswith("--"))
    assert [fold(s) for s in shown.split(";") if s.strip()] == [fold(s.text) for s in code]


def test_design_page_lists_the_layers_in_the_order_the_imports_keep() -> None:
    text = (DOCS / "design.rst").read_text()
    listed = text.split(".. layers-start")[1].split(".. layers-end")[0]
    shown = re.findall(r"^\d+\. ``kombu_sqlinbox\.(\w+)``", listed, re.MULTILINE)
    assert shown == [layer[0] for layer in LAYERS]


def test_the_advice_an_unreachable_database_gets_is_as_documented() -> None:
    text = " ".join((DOCS / "configuration.rst").read_text().split())
    for server in (True, False):
        advice = DatabaseUnreachable("url", "reason", server).advice()
        assert advice in text, advice
    assert "(-l debug shows the traceback)" in text
