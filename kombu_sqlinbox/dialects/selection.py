"""A claim's row selection: which rows are ready, in what order, a FIFO group's head, and
the floor below which a claim looks for none. Every claim statement is built from these
fragments, and a table's claim index follows their order."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from sqlalchemy.engine import Engine

from ..tables import Role, TableSpec
from .core import DialectCore

#: seconds between readings of a table's whole claim floor (:meth:`Dialect.claim_floor`);
#: a row that became ready below the floor waits at most this long
FLOOR_REFRESH = 30.0
#: seconds between the floor's readings from where it stands (between whole readings):
#: a claim passes over the rows deleted in :data:`FLOOR_MARGIN` plus this above it
FLOOR_STEP = 1.0
#: beyond any priority a priority column holds (a SMALLINT's largest)
PRIORITY_BOUND = 32767

#: the roles a claim returns (:meth:`Dialect.returned_columns`), those a table declares
RETURNED_ROLES = (Role.ID, Role.ATTEMPT, Role.PAYLOAD, Role.HEADERS, Role.GROUP,
                  Role.PARTITION_KEY, Role.PRIORITY, Role.AVAILABLE_AT)


class SelectionFamily(DialectCore):
    """The fragments of a claim's selection, and where each table's claim floor stands."""

    #: ``:floor`` (epoch seconds) as a time value where claims read past the rows below
    #: a floor (:meth:`claim_floor`): an MVCC database, whose deleted rows stay in the
    #: claim index while any snapshot older than their deletion is open (None: a claim
    #: reads from the index's start)
    floor_time: ClassVar[str | None] = None

    def __init__(self, engine: Engine | None = None) -> None:
        super().__init__(engine)
        #: per table: its claim floor, the monotonic times it was read last and whole
        self._floors: dict[TableSpec, tuple[float, float, float]] = {}
        #: seconds between whole readings of a claim floor, and between readings from it
        self.floor_refresh = FLOOR_REFRESH
        self.floor_step = FLOOR_STEP

    def exact_key(self, key: str) -> str:
        """SQL: a value read from a message's envelope (a limit key, a task name) as
        compared with the values a claim passes over (keys found full, tasks found
        spent), character for character."""
        return key

    def ready_filter(self, spec: TableSpec, alias: str = "r", heads: bool = True,
                     gone: str = "") -> str:
        """Rows of ``alias`` that may be claimed now: not leased, due, not processed and,
        in a FIFO group, the group's head (no earlier unfinished row in the group; not
        checked without ``heads``, for rows known to be heads; rows whose ids the query
        ``gone`` returns count as finished)."""
        f = self.fields(spec)
        col = f"{alias}." if alias else ""
        conditions = [
            f"({col}{f['locked_until']} IS NULL OR {col}{f['locked_until']} < {self.now})"]
        if spec.has(Role.AVAILABLE_AT):
            conditions.append(f"{col}{f['available_at']} <= {self.now}")
        if spec.has(Role.PROCESSED_AT):
            conditions.append(f"{col}{f['processed_at']} IS NULL")
        if heads and self.fifo(spec):
            conditions.append(self.head_of(spec, Role.GROUP, alias, gone))
        return " AND ".join(conditions)

    @staticmethod
    def fifo(spec: TableSpec) -> bool:
        """Whether the table's group column orders its rows (``fifo=True``)."""
        group = spec.column(Role.GROUP)
        return group is not None and group.fifo

    def unfinished(self, spec: TableSpec, alias: str) -> str:
        """`` AND`` the row of ``alias`` is not processed, where the table keeps processed
        rows (else nothing)."""
        if not spec.has(Role.PROCESSED_AT):
            return ""
        return f" AND {alias}.{self.quote(spec.name_of(Role.PROCESSED_AT))} IS NULL"

    def head_of(self, spec: TableSpec, role: Role, alias: str = "r", gone: str = "") -> str:
        """The row is the first unfinished one of its group (or partition key), or has
        none: a probe of the ``(group, id)`` index per row, never a join that reads the
        table. Rows whose ids the query ``gone`` returns count as finished."""
        f = self.fields(spec)
        col = f"{alias}." if alias else ""
        unfinished = self.unfinished(spec, "ahead")
        if gone:
            unfinished += f" AND ahead.{f['id']} NOT IN ({gone})"
        key = f[role.value]
        return (f"({col}{key} IS NULL OR {col}{f['id']} = (SELECT ahead.{f['id']} "
                f"FROM {f['table']} AS ahead WHERE ahead.{key} = {col}{key}{unfinished} "
                f"ORDER BY ahead.{key}, ahead.{f['id']} LIMIT 1))")

    def selection(self, spec: TableSpec, by_ids: bool, skipping: bool = False,
                  heads: bool = False, gone: str = "") -> str:
        """Which rows a claim takes: the first ``:limit`` ready ones in claim order, or the
        ready ones among ``:ids`` (rows whose keys an advisory claim has locked).
        ``skipping`` passes over rows of the partition keys in ``:skip`` (keys in work in
        the claiming consumer, whose rows it would only hold back).

        On a FIFO table the ordered claim looks only at the first ``:window`` ready rows:
        rows queued behind a head in work would otherwise be read, and passed over, by
        every claim. ``heads`` instead takes the ready rows among the groups' heads,
        found one group at a time (:meth:`fifo_heads`): the fallback when the window had
        too few heads."""
        f = self.fields(spec)
        if by_ids:
            return f"WHERE r.{f['id']} IN :ids AND " + self.ready_filter(spec)
        skip = ""
        if skipping:
            key = f"r.{f['partition_key']}"
            skip = f" AND ({key} IS NULL OR {key} NOT IN :skip)"
        join, among, order = "", "", self.claim_order(spec, "r")
        if heads:
            join, among, order = self.among(
                f"r.{f['id']}", f"SELECT h.id FROM ({self.fifo_heads(spec)}) AS h", order)
        elif self.fifo(spec):
            join, among, order = self.among(f"r.{f['id']}", (
                f"SELECT w.{f['id']} FROM (SELECT w.{f['id']} FROM {f['table']} AS w "
                f"WHERE {self.ready_filter(spec, 'w', False)}{self.above_floor(spec, 'w')} "
                f"ORDER BY {self.claim_order(spec, 'w')} LIMIT :window) AS w"), order)
        return (f"{join}WHERE {among}{self.ready_filter(spec, heads=not heads, gone=gone)}"
                f"{self.above_floor(spec)}{skip} "
                f"ORDER BY {order} LIMIT :limit")

    def above_floor(self, spec: TableSpec, alias: str = "r") -> str:
        """The claim's condition that skips the index entries below the table's floor
        (see :meth:`claim_floor`) without reading their rows; empty where claims take
        no floor."""
        if self.floor_time is None or not spec.has(Role.AVAILABLE_AT):
            return ""
        return (f" AND {alias}.{self.quote(spec.name_of(Role.AVAILABLE_AT))} >= "
                f"{self.floor_time.format('floor')}")

    def ordered_select(self, spec: TableSpec, columns: Sequence[str], selection: str,
                       lock: str = "", index: str = "claim") -> str:
        """``SELECT`` of ``columns`` from the rows of ``spec`` (as ``r``) that ``selection``
        picks, under the lock clause ``lock`` (leading space) if any, read through the
        ``index`` :meth:`index_hint` names (``PRIMARY``: a selection by ids)."""
        return (f"SELECT {', '.join(columns)} FROM {self.table_ref(spec)} AS r"
                f"{self.index_hint(spec, index)} {selection}{lock}")

    def oldest_above(self, spec: TableSpec) -> str:
        """The ready times (as ``available_at``) whose least is the oldest of the rows at
        or above ``:floor`` (ready, leased or due later): the first of the default
        priority (0, nearly every row) in claim order, an index range that starts at the
        floor and stops at that row, and the oldest of each other band of priorities,
        read whole (each an index range of its own: their rows are few)."""
        f = self.fields(spec)
        ready = f"r.{f['available_at']}"
        first = (f"SELECT {ready} FROM {f['table']} AS r{self.index_hint(spec)} WHERE {{}}"
                 f"{ready} >= {(self.floor_time or '').format('floor')} "
                 f"ORDER BY {self.claim_order(spec, 'r')} LIMIT 1")
        if not spec.has(Role.PRIORITY):
            return first.format("")
        priority = f"r.{f['priority']}"
        # a range, not an inequality: a planner without statistics reads a range through
        # the index
        others = [f"SELECT MIN({ready}) FROM {f['table']} AS r{self.index_hint(spec)} "
                  f"WHERE {priority} BETWEEN {low} AND {high}"
                  for low, high in ((1, PRIORITY_BOUND), (-PRIORITY_BOUND, -1))]
        return " UNION ALL ".join(
            f"({query})" for query in [first.format(f"{priority} = 0 AND "), *others])

    def index_hint(self, spec: TableSpec, index: str = "claim") -> str:
        """What makes a statement read ``spec``'s table through its index of that
        :meth:`index_columns` suffix (``PRIMARY``: its primary key), whatever the table's
        statistics say; empty where the planner needs no telling."""
        return ""

    def by_id(self, spec: TableSpec) -> tuple[str, str]:
        """The target of an UPDATE, and the head of a DELETE, of rows ``spec``'s statements
        name by id (``IN :ids``): where the database would otherwise read, and lock,
        rows it was not given, through the index that leads with the id."""
        table = self.table_ref(spec)
        return table, f"DELETE FROM {table}"

    def among(self, row_id: str, ids: str, order: str) -> tuple[str, str, str]:
        """A join and a condition (each empty or ending in a space) keeping the rows whose
        ``row_id`` the query ``ids`` returns, and the claim ``order`` to sort them by:
        those few ids must drive the claim, not a walk of the claim index in ``order``
        checking each row."""
        return "", f"{row_id} IN ({ids}) AND ", order

    #: a condition few rows meet, as this database's planner is told so (a rare NULL
    #: group must be found through the group index, however few groups its statistics saw)
    rare: ClassVar[str] = "{}"

    def fifo_heads(self, spec: TableSpec) -> str:
        """The ids of a FIFO table's heads: the first unfinished row of each group
        (:meth:`group_heads`), then the first ``:limit`` ready rows without a group (each
        a head of its own), by id."""
        f = self.fields(spec)
        ungrouped = self.rare.format(f"r.{f['group']} IS NULL")
        return (f"{self.group_heads(spec)} UNION ALL SELECT * FROM (SELECT r.{f['id']} "
                f"FROM {f['table']} AS r WHERE {ungrouped} AND "
                f"{self.ready_filter(spec, heads=False)} "
                f"ORDER BY r.{f['group']}, r.{f['id']} LIMIT :limit) AS n")

    def group_heads(self, spec: TableSpec) -> str:
        """The first unfinished row of each group, as ``id``: a loose index scan of the
        ``(group, id)`` index (a recursive CTE stepping from each group to the next, then
        to its first row), a probe or two per group, however long the groups are."""
        f = self.fields(spec)
        group, row_id = f["group"], f["id"]
        unfinished = self.unfinished(spec, "x")
        first = f"SELECT x.{{}} FROM {f['table']} AS x WHERE x.{group} {{}}{unfinished} "
        next_group = first.format(group, "> g.g") + f"ORDER BY x.{group} LIMIT 1"
        head = first.format(row_id, "= g.g") + f"ORDER BY x.{group}, x.{row_id} LIMIT 1"
        lowest = f"SELECT MIN(x.{group}) FROM {f['table']} AS x" + (
            f" WHERE {unfinished[len(' AND '):]}" if unfinished else "")
        return (f"WITH RECURSIVE g (g) AS ({lowest} "
                f"UNION ALL SELECT ({next_group}) FROM g WHERE g.g IS NOT NULL) "
                f"SELECT ({head}) AS id FROM g WHERE g.g IS NOT NULL")

    def claim_order(self, spec: TableSpec, alias: str = "") -> str:
        """Priority first (AMQP: higher first), then the time a row became ready, then id."""
        f = self.fields(spec)
        col = f"{alias}." if alias else ""
        order = []
        if spec.has(Role.PRIORITY):
            order.append(f"{col}{f['priority']} DESC")
        if spec.has(Role.AVAILABLE_AT):
            order.append(col + f["available_at"])
        order.append(col + f["id"])
        return ", ".join(order)

    def returned_columns(self, spec: TableSpec, alias: str = "") -> str:
        """What a claim returns: each declared column :meth:`claimed` reads, labelled with
        its role (id, attempt, payload, headers, group, partition key, priority, ready
        time), then row mode's columns labelled ``x0``, ``x1``..."""
        f = self.fields(spec)
        col = f"{alias}." if alias else ""
        roles = [f"{col}{f[role.value]} AS {self.quote(role.value)}"
                 for role in RETURNED_ROLES if spec.has(role)]
        # row mode's columns, labelled by position (a name could clash with a role's)
        extra = [f"{col}{self.quote(name)} AS {self.quote(f'x{at}')}"
                 for at, name in enumerate(spec.row_columns)]
        return ", ".join(roles + extra)

    def forget_floor(self, spec: TableSpec) -> None:
        """Read the floor of ``spec`` again at its next claim (its table was emptied or
        made anew)."""
        self._floors.pop(spec, None)
