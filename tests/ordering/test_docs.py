"""docs/sql/fifo-claim-postgresql.sql shows what the transport runs for the CRM example's
table (formatted by hand: compared with whitespace folded): the claim, the publish, the
in-place retry, then the claim's second statement (the groups' heads)."""

from __future__ import annotations

import re

from sqlalchemy import create_engine

from kombu_sqlinbox.dialects import dialect_for
from tests.docs.support import DOCS, load_example


def fold(sql: str) -> str:
    return re.sub(r"\s+", " ", sql).strip()


def test_fifo_statements_shown_are_what_the_transport_runs() -> None:
    crm = load_example("crm/crm_app.py")
    statements = dialect_for(create_engine("postgresql+psycopg2://")).statements(
        crm.outbound_changes)
    assert statements.retry is not None and statements.claim_heads is not None
    code = [*statements.claim, statements.insert, statements.retry, *statements.claim_heads]
    shown = "\n".join(line for line in (DOCS / "sql" / "fifo-claim-postgresql.sql").read_text()
                      .splitlines() if not line.startswith("--"))
    assert [fold(s) for s in shown.split(";") if s.strip()] == [fold(s.text) for s in code]
