"""A dialect for a CockroachDB-shaped database: PostgreSQL's protocol and SQL, but no
LISTEN/NOTIFY, and advisory-lock functions that are accepted yet lock nothing.

The first draft reuses PostgreSQL's dialect and keeps its declared capabilities; only
the statements the new database runs differently are its own. The conformance suite
rejects it: it declares key locks and wake-ups it cannot keep. The second class
declares what the database has, and passes.
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import Connection, TextClause, text

from kombu_sqlinbox.dialects import Capabilities, PostgreSQLDialect, register
from kombu_sqlinbox.tables import TableSpec


class CockroachDraft(PostgreSQLDialect):
    """The draft: PostgreSQL's capabilities, the new database's statements."""

    names = ("cockroachdb",)

    def insert_statement(self, spec: TableSpec) -> TextClause:
        """No NOTIFY to send with a publish."""
        return text(self.insert_sql(spec))

    def wake(self, conn: Connection, spec: TableSpec) -> None:
        """No NOTIFY to send."""

    def try_key_locks(self, conn: Connection, space: int, keys: Sequence[str]) -> list[bool]:
        """What such advisory-lock functions answer: taken, every time."""
        return [True for _ in keys]

    def release_key_locks(self, conn: Connection, space: int, keys: Sequence[str]) -> None:
        """Nothing was locked."""


@register
class CockroachDialect(CockroachDraft):
    """The dialect: row locks with SKIP LOCKED and RETURNING, nothing more. The transport
    then polls for new rows, and refuses the advisory claim form."""

    capabilities = Capabilities(row_locks=True, skip_locked=True, returning=True)
