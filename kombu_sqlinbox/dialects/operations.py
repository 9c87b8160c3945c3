"""The operations' statements (``celery sqlinbox``): a queue's figures, and the stored
messages a dead-letter move pages through, locks, removes and restores."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import TextClause, text

from ..tables import Role, TableSpec
from .driver import _expanding
from .publish import PublishFamily
from .selection import SelectionFamily


class OperationsFamily(SelectionFamily, PublishFamily):
    """What the operations commands read and move."""

    def queue_stats(self, spec: TableSpec) -> TextClause:
        """One pass over a queue table's unfinished rows, each counted in exactly one
        state: ``in_work`` (a live lease), ``delayed`` (not due yet), ``ready`` (claimable
        now), ``blocked`` (due, behind an unfinished earlier row of its FIFO group). Also
        ``lapsed`` (leases that ran out unsettled: a dead worker's rows, claimable again
        and counted ready or blocked), ``oldest_ready_age`` (seconds), ``lease_left``
        (seconds until the soonest live lease ends) and ``blocked_groups`` (FIFO groups
        whose head is in work with rows behind it)."""
        f = self.fields(spec)
        live, free, due, head, unfinished = self._states(spec)
        group = spec.column(Role.GROUP)
        fifo = group is not None and group.fifo
        ready = f"{free} AND {due} AND {head}"
        soonest_end = f"MIN(CASE WHEN {live} THEN r.{f['locked_until']} END)"
        oldest_ready = (self.age(f"MIN(CASE WHEN {ready} THEN r.{f['available_at']} END)")
                        if spec.has(Role.AVAILABLE_AT) else "NULL")
        blocked_groups = "0"
        if fifo:
            behind = (f" AND b.{f['processed_at']} IS NULL" if spec.has(Role.PROCESSED_AT)
                      else "")
            blocked_groups = (
                f"(SELECT COUNT(DISTINCT r.{f['group']}) FROM {f['table']} AS r "
                f"WHERE {live} AND EXISTS (SELECT 1 FROM {f['table']} AS b "
                f"WHERE b.{f['group']} = r.{f['group']} AND b.{f['id']} > r.{f['id']}"
                f"{behind}))")
        figures = {
            "ready": f"COALESCE(SUM(CASE WHEN {ready} THEN 1 ELSE 0 END), 0)",
            "delayed": f"COALESCE(SUM(CASE WHEN {free} AND NOT ({due}) THEN 1 ELSE 0 END), 0)",
            "in_work": f"COALESCE(SUM(CASE WHEN {live} THEN 1 ELSE 0 END), 0)",
            "blocked": (f"COALESCE(SUM(CASE WHEN {free} AND {due} AND NOT ({head}) "
                        "THEN 1 ELSE 0 END), 0)"),
            "lapsed": (f"COALESCE(SUM(CASE WHEN r.{f['locked_until']} < {self.now} "
                       "THEN 1 ELSE 0 END), 0)"),
            "oldest_ready_age": oldest_ready,
            "lease_left": f"-({self.age(soonest_end)})",
            "blocked_groups": blocked_groups,
        }
        # labels quoted: "delayed" is a reserved word in MySQL
        return text("SELECT " + ", ".join(f"{sql} AS {self.quote(name)}"
                                          for name, sql in figures.items())
                    + f" FROM {f['table']} AS r WHERE {unfinished}")

    def bounded_count(self, spec: TableSpec) -> TextClause:
        """How many unfinished rows the table has, counting no further than ``:limit``:
        what tells a table the dashboard counts exactly from one it estimates, at the cost
        of reading ``:limit`` rows at most."""
        f = self.fields(spec)
        unfinished = self._states(spec)[4]
        return text(f"SELECT COUNT(*) FROM (SELECT 1 AS one FROM {f['table']} AS r "
                    f"WHERE {unfinished} LIMIT :limit) AS s")

    def row_estimate(self, spec: TableSpec) -> TextClause | None:
        """The planner's estimate of the table's unfinished rows (:meth:`estimate_of`)."""
        f = self.fields(spec)
        return self.estimate_of(f"SELECT 1 FROM {f['table']} AS r WHERE {self._states(spec)[4]}")


    def _states(self, spec: TableSpec) -> tuple[str, str, str, str, str]:
        """The conditions on a row ``r`` that tell its state: a live lease, no live lease,
        due, the head of its FIFO group (or not in one), unfinished."""
        f = self.fields(spec)
        live = f"r.{f['locked_until']} >= {self.now}"
        free = f"(r.{f['locked_until']} IS NULL OR r.{f['locked_until']} < {self.now})"
        due = (f"r.{f['available_at']} <= {self.now}" if spec.has(Role.AVAILABLE_AT)
               else "1 = 1")
        group = spec.column(Role.GROUP)
        head = (self.head_of(spec, Role.GROUP) if group is not None and group.fifo
                else "1 = 1")
        unfinished = (f"r.{f['processed_at']} IS NULL" if spec.has(Role.PROCESSED_AT)
                      else "1 = 1")
        return live, free, due, head, unfinished

    def ready_page(self, spec: TableSpec) -> TextClause:
        """Up to ``:limit`` ready rows (claimable now) after id ``:after``, by id: a
        keyset page walking the primary key, never a count or an offset. Each with its
        stored columns, ``ready_age`` (seconds since due), ``priority`` and ``grp``."""
        f = self.fields(spec)
        _, free, due, head, unfinished = self._states(spec)
        age = self.age(f"r.{f['available_at']}") if spec.has(Role.AVAILABLE_AT) else "NULL"
        priority = f"r.{f['priority']}" if spec.has(Role.PRIORITY) else "NULL"
        group = f"r.{f['group']}" if spec.has(Role.GROUP) else "NULL"
        return text(f"SELECT {self.stored_columns(spec)}, {age} AS ready_age, "
                    f"{priority} AS priority, {group} AS grp FROM {f['table']} AS r "
                    f"WHERE r.{f['id']} > :after AND {unfinished} AND {free} AND {due} "
                    f"AND {head} ORDER BY r.{f['id']} LIMIT :limit")

    def blocked_groups(self, spec: TableSpec) -> TextClause | None:
        """A FIFO table's groups whose head is in work with rows behind it (None for any
        other table): up to ``:limit`` heads after id ``:after``, by id, each with its
        group ``grp``, ``attempt``, ``lease_left`` (seconds) and ``behind`` (its group's
        unfinished rows after it, counted on the ``(group, id)`` index)."""
        group = spec.column(Role.GROUP)
        if group is None or not group.fifo:
            return None
        f = self.fields(spec)
        live, _, _, _, unfinished = self._states(spec)
        after = (f"FROM {f['table']} AS b WHERE b.{f['group']} = r.{f['group']} "
                 f"AND b.{f['id']} > r.{f['id']}"
                 + (f" AND b.{f['processed_at']} IS NULL" if spec.has(Role.PROCESSED_AT)
                    else ""))
        lease_left = self.age(f"r.{f['locked_until']}")
        return text(f"SELECT r.{f['id']} AS id, r.{f['group']} AS grp, "
                    f"r.{f['attempt']} AS attempt, -({lease_left}) AS lease_left, "
                    f"(SELECT COUNT(*) {after}) AS behind FROM {f['table']} AS r "
                    f"WHERE r.{f['id']} > :after AND {live} AND {unfinished} "
                    f"AND EXISTS (SELECT 1 {after}) ORDER BY r.{f['id']} LIMIT :limit")

    def stored_columns(self, spec: TableSpec) -> str:
        """A stored message's columns as operations read it: id, payload, headers (NULL
        where the table keeps its envelope in the payload), attempt."""
        f = self.fields(spec)
        headers = f"r.{f['headers']}" if spec.has(Role.HEADERS) else "NULL"
        return (f"r.{f['id']} AS id, r.{f['payload']} AS payload, {headers} AS headers, "
                f"r.{f['attempt']} AS attempt")

    def stored_page(self, spec: TableSpec) -> TextClause:
        """Up to ``:limit`` stored messages not in work, by id, after ``:after`` and up to
        ``:upto``."""
        row_id = f"r.{self.fields(spec)['id']}"
        return text(self._stored(spec, f"{row_id} > :after AND {row_id} <= :upto",
                                 "LIMIT :limit"))

    def stored_locked(self, spec: TableSpec) -> TextClause:
        """The stored messages ``:ids`` still not in work, by id, locked for a move
        (skipping rows another move holds): exactly the rows a page showed, whatever
        committed between them meanwhile."""
        return _expanding(self._stored(spec, f"r.{self.fields(spec)['id']} IN :ids",
                                       self.lock_clause, self.index_hint(spec, "PRIMARY")))

    def _stored(self, spec: TableSpec, where: str, tail: str, hint: str = "") -> str:
        """The stored messages ``where`` picks that are not in work (nor processed), by
        id, then ``tail`` (read through the index ``hint`` names, if any)."""
        f = self.fields(spec)
        unfinished = (f" AND r.{f['processed_at']} IS NULL" if spec.has(Role.PROCESSED_AT)
                      else "")
        return (f"SELECT {self.stored_columns(spec)} FROM {f['table']} AS r{hint} WHERE {where} "
                f"AND (r.{f['locked_until']} IS NULL OR r.{f['locked_until']} < {self.now})"
                f"{unfinished} ORDER BY r.{f['id']} {tail}")

    def stored_one(self, spec: TableSpec) -> TextClause:
        """The stored message with id ``:id``, whatever its state."""
        f = self.fields(spec)
        return text(f"SELECT {self.stored_columns(spec)} FROM {f['table']} AS r "
                    f"WHERE r.{f['id']} = :id")

    def last_id(self, spec: TableSpec) -> TextClause:
        f = self.fields(spec)
        return text(f"SELECT MAX({f['id']}) FROM {f['table']}")

    def remove(self, spec: TableSpec) -> TextClause:
        """Delete the rows ``:ids`` (a move's first half: locked by :meth:`stored_locked`,
        not in work). MariaDB reads a small table whole for a DELETE by primary key
        alone, its index hint notwithstanding, and locks each row it reads."""
        f = self.fields(spec)
        return _expanding(f"{self.by_id(spec)[1]} WHERE {f['id']} IN :ids AND "
                          f"({f['locked_until']} IS NULL OR {f['locked_until']} < {self.now})")

    def restore(self, spec: TableSpec) -> TextClause | None:
        """The default publish statement with the attempt count bound too (``:attempt``):
        a dead letter put back keeps its deliveries, or starts again from 0. None for a
        declared publish statement: a requeue runs it as a publish does."""
        if spec.publish is not None:
            return None
        return text(self._insert(spec, self._publish_values(spec) + self._attempt(spec)))

    def restore_row(self, spec: TableSpec, columns: Sequence[str]) -> TextClause:
        """The insert of a row as other code wrote it: ``columns`` (bound as ``:c0``,
        ``:c1``...) and the attempt count (``:attempt``)."""
        pairs = [(self.quote(name), f":c{at}") for at, name in enumerate(columns)]
        return text(self._insert(spec, pairs + self._attempt(spec)))

    def _attempt(self, spec: TableSpec) -> list[tuple[str, str]]:
        return [(self.quote(spec.name_of(Role.ATTEMPT)), ":attempt")] if spec.has(
            Role.ATTEMPT) else []
