"""PostgreSQL's concurrency-limit statements (:mod:`.limits`): the slots read for the rows
picked, the lease and the slots' take in one statement, and the whole claim in one."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from sqlalchemy import TextClause

from ..tables import Role, TableSpec
from .driver import _expanding
from .limits import LimitFamily, LimitStatements


class PostgreSQLLimits(LimitFamily):
    """The concurrency-limit statements of :class:`~.postgresql.PostgreSQLDialect`."""

    #: PostgreSQL reads the envelope of each row the candidates pass over again for
    #: each use of its key: a claim there read slower with its slots in the scan than
    #: with them read for the rows picked
    slots_in_scan = False

    def slots_after(self, picked: str, count: int, listed: Callable[[str], str]) -> str:
        """The rows picked and locked first (materialized: each envelope read once), then
        their keys' slots; a scan of the materialized rows returns them in their order."""
        names = ["i", "k", *(f"c{n}" for n in range(2, count))]
        return (f"WITH c ({', '.join(names)}) AS MATERIALIZED ({picked}) "
                f"SELECT c.i, c.k, {listed('c.k')}{''.join(f', c.{n}' for n in names[2:])} "
                "FROM c")

    def key_digest(self, key: str) -> str:
        return f"encode(sha256(convert_to({key}, 'UTF8')), 'hex')"

    def slot_list(self, parts: Sequence[str]) -> str:
        return f"string_agg(concat_ws(':', {', '.join(parts)}), ',')"

    def build_claim_taking(self, spec: TableSpec, prefix: str, count: int) -> TextClause:
        """Data-modifying ``WITH``s on one snapshot: the slots are written for the rows
        the lease wrote, at the attempt it returned; each in the order of the slots'
        key, as the separate statements are."""
        (claim,) = self.statements(spec).claim_ids
        slots = self.quote(LimitStatements.tables(prefix)[0])
        values = ", ".join(f"(CAST(:k{n} AS TEXT), CAST(:s{n} AS INTEGER), "
                           f"CAST(:h{n} AS BIGINT), CAST(:e{n} AS BIGINT), "
                           f"CAST(:f{n} AS INTEGER))" for n in range(count))
        return _expanding(
            f"WITH claimed AS ({claim.text}), wanted AS (SELECT v.k, v.s, v.e, v.f, c.id, "
            f"c.attempt FROM (VALUES {values}) AS v (k, s, h, e, f) JOIN claimed AS c "
            "ON c.id = v.h), "
            f"taken AS (INSERT INTO {slots} (queue_table, limit_key, slot, holder_id, "
            "holder_attempt) SELECT :queue_table, k, s, id, attempt FROM wanted "
            "WHERE e IS NULL ORDER BY k, s ON CONFLICT (queue_table, limit_key, slot) "
            "DO NOTHING RETURNING 1), "
            f"stolen AS (UPDATE {slots} AS t SET holder_id = w.id, holder_attempt = w.attempt "
            "FROM wanted AS w WHERE t.queue_table = :queue_table AND t.limit_key = w.k "
            "AND t.slot = w.s AND t.holder_id = w.e AND t.holder_attempt = w.f RETURNING 1) "
            "SELECT claimed.*, (SELECT count(*) FROM taken) + (SELECT count(*) FROM stolen) "
            "AS written FROM claimed")

    def locked_version(self, spec: TableSpec) -> list[str]:
        """The tuple id of the version each picked row was locked in (:meth:`whole_claim`
        matches only the rows whose locked version its snapshot shows)."""
        return ["r.ctid"]

    def whole_claim(self, spec: TableSpec, prefix: str, picked: str, holder: str,
                    completing: bool = False) -> TextClause | None:
        """Data-modifying ``WITH``s on one snapshot: each key's free slot numbers (below
        its limit, not held by a row in work) ranked, matched to its rows in claim order
        up to its room (the limit less its live slots); the slots written, never-held
        ones by an ``INSERT`` that writes nothing where the slot exists, seen-free ones
        by compare-and-set on the holder seen; then the rows whose slots were written,
        and those of no limited key, leased (a row that lost its slot is never leased).
        Completing, the rows completed first are no holders in work (the snapshot still
        shows them).

        Only the rows locked in the version the snapshot shows are matched to slots. A row
        another session claimed and gave back after the snapshot was taken is locked in its
        newest version, which the lease by tuple id does not see (on a declared table, the
        lease by row ids, rechecking the newest version, missed such rows too under racing
        claimers): a slot written for it would name an attempt the row reaches only when
        a later claim leases it, and that claim could find the slot free and its own while
        a third, which saw it free before, takes it by compare-and-set on that very
        holder: the row would run without a slot, its key past its limit. On a declared
        table (perhaps partitioned: a tuple id names a row in each partition) the version
        is looked up by row id too."""
        f = self.fields(spec)
        if spec.has(Role.GROUP):
            return None  # a FIFO group's head takes the claim of several statements
        (claim,) = self.statements(spec).claim_ids
        by_ids = f"r.{f['id']} IN :ids"
        assert by_ids in claim.text, claim.text
        lease = claim.text.replace(by_ids, f"r.{f['id']} IN (SELECT id FROM won)")
        slots = self.quote(LimitStatements.tables(prefix)[0])
        done = (f"completed AS ({self.statements(spec).complete.text} RETURNING "
                f"{f['id']} AS id), ") if completing else ""
        gone = f" AND h.{f['id']} NOT IN (SELECT id FROM completed)" if completing else ""
        # the rows whose locked version is the snapshot's (see above)
        same_row = "" if spec.own else f" AND v.{f['id']} = c.i"
        columns, current = "i, k, a, t, o", (
            f"(SELECT * FROM c WHERE EXISTS (SELECT 1 FROM {f['table']} AS v "
            f"WHERE v.ctid = c.t{same_row}))")
        return self.clocked(_expanding(
            f"WITH {done}c ({columns}) AS MATERIALIZED (SELECT x.*, row_number() OVER () "
            f"FROM ({picked}) AS x), "
            f"kl AS (SELECT * FROM (SELECT k, {self.key_digest('k')} AS d, (SELECT l.n "
            "FROM unnest(CAST(:prefixes AS TEXT[]), CAST(:limits AS BIGINT[])) "
            "WITH ORDINALITY AS l (p, n, o) WHERE l.p = '*' OR starts_with(k, l.p) "
            "ORDER BY l.o LIMIT 1) AS n FROM c WHERE k IS NOT NULL GROUP BY k) AS z "
            "WHERE n IS NOT NULL), "
            f"sl AS (SELECT s.limit_key AS d, s.slot, s.holder_id AS e, s.holder_attempt "
            f"AS f, h.{f['id']} IS NOT NULL{gone} AS alive FROM {slots} AS s LEFT JOIN {holder} "
            "WHERE s.queue_table = :queue_table AND s.limit_key IN (SELECT d FROM kl)), "
            "room AS (SELECT kl.k, kl.d, kl.n - (SELECT count(*) FROM sl WHERE sl.d = kl.d "
            "AND sl.alive) AS free, LEAST(kl.n, (SELECT count(*) FROM sl WHERE sl.d = kl.d) "
            "+ (SELECT count(*) FROM c WHERE c.k = kl.k)) AS span FROM kl), "
            "fr AS (SELECT room.k, room.d, g.n AS slot, sl.e, sl.f, row_number() OVER "
            "(PARTITION BY room.k ORDER BY g.n) AS j FROM room CROSS JOIN LATERAL "
            "generate_series(0, room.span - 1) AS g (n) LEFT JOIN sl ON sl.d = room.d "
            "AND sl.slot = g.n WHERE sl.alive IS NOT TRUE), "
            "rk AS (SELECT c.i, c.a, c.o, c.k, room.free, row_number() OVER (PARTITION BY "
            f"c.k ORDER BY c.o) AS j FROM {current} AS c JOIN room ON room.k = c.k), "
            "pick AS (SELECT rk.i, rk.a, rk.o, fr.d, fr.slot, fr.e, fr.f FROM rk JOIN fr "
            "ON fr.k = rk.k AND fr.j = rk.j WHERE rk.j <= rk.free UNION ALL SELECT c.i, "
            f"c.a, c.o, NULL, NULL, NULL, NULL FROM {current} AS c WHERE c.k IS NULL OR "
            "c.k NOT IN (SELECT k FROM kl)), "
            "chosen AS (SELECT * FROM pick ORDER BY o LIMIT :wanted), "
            f"taken AS (INSERT INTO {slots} (queue_table, limit_key, slot, holder_id, "
            "holder_attempt) SELECT :queue_table, d, slot, i, a + 1 FROM chosen "
            "WHERE d IS NOT NULL AND e IS NULL ORDER BY d, slot ON CONFLICT (queue_table, "
            "limit_key, slot) DO NOTHING RETURNING holder_id), "
            f"stolen AS (UPDATE {slots} AS t SET holder_id = w.i, holder_attempt = w.a + 1 "
            "FROM chosen AS w WHERE w.e IS NOT NULL AND t.queue_table = :queue_table "
            "AND t.limit_key = w.d AND t.slot = w.slot AND t.holder_id = w.e "
            "AND t.holder_attempt = w.f RETURNING t.holder_id), "
            "won AS (SELECT holder_id AS id FROM taken UNION ALL SELECT holder_id FROM "
            "stolen UNION ALL SELECT i FROM chosen WHERE d IS NULL), "
            f"claimed AS ({lease}) "
            "SELECT n.*, claimed.* FROM (SELECT count(*) AS seen"
            f"{', (SELECT count(*) FROM completed) AS completed' if completing else ''} "
            "FROM c) AS n LEFT JOIN claimed ON true"))

    def limited_give_back(self, uncounted: TextClause,
                          release: TextClause) -> tuple[TextClause, ...]:
        """One statement: the keeper settles on a session in autocommit, where two would
        commit apart, and a claim between them would find the row back at the attempt
        its slot still names: the slot free, taken from under the row claimed again."""
        return (_expanding(f"WITH released AS ({release.text}) {uncounted.text}"),)
