"""MariaDB/MySQL: the statements that name a queue table's rows by id read them through
the index that leads with the id, and so lock those rows alone.

InnoDB locks each row a locking statement reads, and READ COMMITTED lets go of one
that does not match only once it has read it. The optimizer runs ``... WHERE id IN
(...)`` on a small table as a scan (by its costs, cheaper than a probe per id), so a
settlement or a lease extension of a few rows locked every row of the table in turn,
and a claim running meanwhile passed over the rows locked at that moment (``SKIP
LOCKED``): a partition key's later row could go out before its earlier one.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, event, text
from sqlalchemy.engine import Engine, ExceptionContext

from ..tables import Role, TableSpec
from .queue import QueueFamily

#: MySQL's "Key ... doesn't exist": an index hint names an index the table lacks
NO_SUCH_INDEX = 1176
#: the indexes of a table that lead with a column, as the server names them (not
#: quoted, unlike SQLAlchemy's reflection of a name holding a backtick)
LEADING_INDEXES = text(
    "SELECT * FROM information_schema.STATISTICS WHERE TABLE_SCHEMA = COALESCE(:schema, "
    "DATABASE()) AND TABLE_NAME = :table AND SEQ_IN_INDEX = 1 AND COLUMN_NAME = :column "
    "ORDER BY INDEX_NAME <> 'PRIMARY', NON_UNIQUE, INDEX_NAME")


class MySQLIdIndexes(QueueFamily):
    """Index hints of :class:`~.mysql.MySQLDialect`: the claim index, and the id's."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        #: per declared table: the index that leads with its id (None: it has none)
        self._id_indexes: dict[TableSpec, str | None] = {}

    def index_hint(self, spec: TableSpec, index: str = "claim") -> str:
        """``FORCE INDEX``: on the transport's own tables, its claim index (a table whose
        statistics count only its few live rows is otherwise read whole, every
        delete-marked row a snapshot keeps from purge with it, at every claim); ``PRIMARY``
        is the index that leads with the id, on any table that has one. Never an index
        the table was not seen to have: a hint naming one is an error (see
        :meth:`_index_gone` for one a migration took away since)."""
        if index == "PRIMARY":
            name = "PRIMARY" if spec.own else self._id_indexes.get(spec)
            if name is None:
                return ""
            if name != "PRIMARY":  # a name the table's owner gave: a backtick doubled
                name = self.quote(name.replace("`", "``"))
            return f" FORCE INDEX ({name})"
        if not spec.own:
            return ""
        return f" FORCE INDEX ({self.index_name(spec, index)})"

    def by_id(self, spec: TableSpec) -> tuple[str, str]:
        hint = self.index_hint(spec, "PRIMARY")
        table = self.table_ref(spec)
        if not hint:
            return super().by_id(spec)
        # a single-table DELETE takes no index hint; the multiple-table form does
        return f"{table}{hint}", f"DELETE {table} FROM {table}{hint}"

    def ensure_table(self, conn: Connection, spec: TableSpec, create: bool) -> bool:
        """Also find the index a declared table's id leads (its statements by id walk it);
        the table's statements are made again when it changed."""
        text_payload = super().ensure_table(conn, spec, create)
        if not spec.own:
            found = _id_index(conn, spec)
            if spec not in self._id_indexes or self._id_indexes[spec] != found:
                self._id_indexes[spec] = found
                self._statements.pop(spec, None)
        return text_payload

    def prepare_engine(self, engine: Engine, sqlite_begin: str = "IMMEDIATE") -> None:
        super().prepare_engine(engine, sqlite_begin)
        event.listen(engine, "handle_error", self._index_gone)

    def _index_gone(self, context: ExceptionContext) -> None:
        """A hint named an index a declared table no longer has (a migration renamed or
        dropped it while this process ran): the statement fails, as any error does, and
        the declared tables' statements are made again without hints, until each table
        is checked again (a new declaration of its queue)."""
        failed = context.sqlalchemy_exception
        if failed is None or self.driver_error_code(failed) != NO_SUCH_INDEX:
            return
        for spec in list(self._id_indexes):
            if self._id_indexes.pop(spec, None) is not None:
                self._statements.pop(spec, None)


def _id_index(conn: Connection, spec: TableSpec) -> str | None:
    """The name of an index of ``spec``'s table whose first column is the id: its primary
    key (``PRIMARY``) where that leads with the id, else a unique one, else any; None
    without one. An index the server ignores (MariaDB's ``IGNORED``, MySQL's invisible
    ones) takes no hint."""
    rows: list[Any] = list(conn.execute(LEADING_INDEXES, {
        "schema": spec.schema, "table": spec.table,
        "column": spec.name_of(Role.ID)}).mappings())
    usable = [row for row in rows if str(row.get("IGNORED", "NO")).upper() != "YES"
              and str(row.get("IS_VISIBLE", "YES")).upper() != "NO"]
    return str(usable[0]["INDEX_NAME"]) if usable else None
