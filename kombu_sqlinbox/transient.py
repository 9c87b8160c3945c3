"""Transient messages: the one table every transient queue's messages share.

A message for transient queues is published in one statement, to one queue or to every
transient queue bound to an exchange that takes its routing key (the bindings table of
:mod:`.routing`). It leaves its table when it is claimed (delivered at most once, like a
message of an AMQP transient queue without acknowledgement).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

from sqlalchemy import Connection, TextClause

from .codec import priority_of
from .dialects import plain_payload
from .errors import SchemaMismatch
from .routing import Routes
from .rows import ClaimedRow, Held, QueueTable, Settlement
from .tables import TableBuilder, TableSpec, check_name
from .wakeups import Wakeup

T = TypeVar("T")
#: the reads of a claim on MariaDB that claims racing it beat to the ids it read
RACED_READS = 3


@dataclass(frozen=True)
class TransientHeld(Held):
    """A claimed transient message: it already left its table, so giving it back
    (a requeue, a consumer cancelled with it buffered) publishes it again."""

    row: ClaimedRow | None = None



class TransientQueues:
    """The transient messages of one table prefix, for this process; also the claim form
    of transient queues (:class:`~.rows.Claims`)."""

    def __init__(self, routes: Routes, wakeup: Wakeup) -> None:
        self.routes = routes
        self.database = routes.database
        self.dialect = routes.dialect
        self.prefix = routes.prefix
        self.sql = routes.sql
        self.wakeup = wakeup
        #: where a claim of one statement runs: the wake-up's LISTEN connection (one round
        #: trip, straight after the wake-up) where there is one; two statements (a read,
        #: then its delete) need a transaction of the pool's
        self._claim_on = wakeup.claim if len(self.sql.claim) == 1 else self.database.run_fenced
        #: queues consumed here whose NOTIFY came since they were last claimed
        self._told: set[str] = set()
        #: the transient messages' table, as the codec and the claim glue see a queue table
        self.spec: TableSpec = TableBuilder(self.sql.names[2]).id().payload().headers().build()

    # -- messages --------------------------------------------------------------
    def route(self, exchange: str, routing_key: str, payload: bytes | str,
              headers: str | None, ttl: float | None, priority: int = 0) -> None:
        """Publish to every transient queue bound to ``exchange`` that takes
        ``routing_key``: one statement, whatever the number of queues."""
        check_name(exchange, "exchange name")
        check_name(routing_key, "routing key", empty=True)
        if not self.routes.available():
            return
        self._publish(self.sql.route, {"exchange": exchange, "routing_key": routing_key,
                                       "payload": payload, "headers": headers, "ttl": ttl,
                                       "priority": priority})

    def put(self, queue: str, payload: bytes | str, headers: str | None,
            ttl: float | None, priority: int = 0) -> None:
        """Publish to one transient queue (nothing when it is no longer registered)."""
        self._publish(self.sql.put, {"queue": queue, "payload": payload, "headers": headers,
                                     "ttl": ttl, "priority": priority})

    def _current(self) -> None:
        """Refuse transient messages while their table lacks what this release needs."""
        if self.routes.outdated_by is not None:
            raise SchemaMismatch(self.routes.outdated_by)

    def _publish(self, statement: Any, params: dict[str, Any]) -> None:
        self._current()
        params["channel_prefix"] = self.prefix + "t_"

        def publish(conn: Connection) -> Any:
            return self.dialect.execute(conn, statement, params)

        # on the LISTEN connection: an INSERT waits for no lock; the registry's writes,
        # which may, stay on the pool (one waiting there would hold every claim here)
        if self._on_listen_connection():
            self.wakeup.publish(publish)
        else:
            self.routes.write(publish, durable=False, one=True)
        self.wakeup.published()

    def channel(self, queue: str) -> str:
        return self.dialect.transient_channel(self.prefix, queue)

    def listen(self, queue: str) -> None:
        """Wake this process's consumers when a message for ``queue`` is published
        elsewhere: by NOTIFY on the queue's channel where the database has it (noted for
        :meth:`told`), else by the same-host signal where there is one."""
        if not self.dialect.notify:
            self.wakeup.listen(None)
        else:
            self.wakeup.watch(self.channel(queue), partial(self._told.add, queue))

    def unlisten(self, queue: str) -> None:
        """``queue`` was deleted here: nothing of it is watched any more."""
        if self.dialect.notify:
            self.wakeup.unwatch(self.channel(queue))
        self._told.discard(queue)

    def told(self, queue: str) -> bool:
        """Whether a NOTIFY said that a message for ``queue`` came since this was last
        asked (also when the LISTEN connection was made: what came before is unknown)."""
        if queue not in self._told:
            return False
        self._told.discard(queue)
        return True

    def size(self, queue: str) -> int:
        """The queue's unexpired messages: counted where its claims run (one statement, on
        the LISTEN connection and prepared there, where there is one: every
        ``app.control`` call counts its new reply queue twice) unless the bound caller's
        transaction must see them."""
        def count(conn: Connection) -> int:
            return int(self.dialect.execute(conn, self.sql.size, {"queue": queue}).scalar_one())

        if self._on_listen_connection():
            return self.wakeup.claim(count)
        return self.routes.read(count)

    def _on_listen_connection(self) -> bool:
        """Whether transient work runs on the LISTEN connection: where the database has
        one, unless a bound caller's transaction must see it."""
        return self.dialect.notify and self.database.bound_caller() is None

    def purge(self, queue: str) -> int:
        return int(self.routes.write(
            lambda conn: conn.execute(self.sql.purge, {"queue": queue}).rowcount))

    # -- the claim form of transient queues ----------------------------------------
    def claim(self, table: QueueTable, limit: int, skip: Sequence[Any] = ()) -> list[ClaimedRow]:
        """Take up to ``limit`` unexpired messages of the queue, higher priority first,
        then oldest: on a connection in autocommit where the server's DELETE returns rows
        (:attr:`~.dialects.routing.RoutingStatements.claim_alone`), else by the claim's
        own statements."""
        self._current()
        params = {"queue": table.queue, "limit": limit}
        rows: list[Any]
        if self.sql.claim_alone is not None and self.database.engine.dialect.delete_returning:
            rows = self._take_alone(self.sql.claim_alone, params)
        else:
            rows = self._claim_on(partial(self._take, params))
        rows.sort(key=lambda row: (-row[3], row[0]))  # higher priority first, then oldest
        return [ClaimedRow(id=row[0], attempt=1, payload=plain_payload(row[1]),
                           headers=row[2], group=None, partition_key=None) for row in rows]

    def _take(self, params: dict[str, Any], conn: Connection) -> list[Any]:
        first, *then = self.sql.claim
        rows = list(self.dialect.execute(conn, first, params).all())
        for statement in then:  # where DELETE cannot return: delete what was read
            if rows:
                conn.execute(statement, {"ids": [row[0] for row in rows]})
        return rows

    def _take_alone(self, statements: tuple[TextClause, TextClause],
                    params: dict[str, Any]) -> list[Any]:
        """Read the first ids, then DELETE them, which returns what this claim took; while
        a claim racing it took some of a full read's ids, read on (at most
        :data:`RACED_READS` times), so a queue holding more is not found empty. Each
        round alone: one that fails runs again without losing the rows of the last."""
        taken: list[Any] = []
        for _ in range(RACED_READS):
            wanted = params["limit"] - len(taken)
            ids, rows = self.database.alone(
                partial(self._read_and_delete, statements, {**params, "limit": wanted}))
            taken += rows
            if len(rows) == len(ids) or len(ids) < wanted:
                break
        return taken

    def _read_and_delete(self, statements: tuple[TextClause, TextClause],
                         params: dict[str, Any], conn: Connection) -> tuple[list[int], list[Any]]:
        read, delete = statements
        ids = list(self.dialect.execute(conn, read, params).scalars())
        return ids, list(self.dialect.execute(conn, delete, {"ids": ids})) if ids else []

    def held_for(self, table: QueueTable, row: ClaimedRow) -> Held:
        return TransientHeld(table, row.id, row.attempt, row=row)

    def settle(self, how: Settlement, held: Held, delay: float = 0.0) -> None:
        """An ack has nothing to do; a message given back is published again."""
        row = getattr(held, "row", None)
        if how is Settlement.COMPLETE or row is None:
            return
        properties = json.loads(row.headers or "{}").get("properties") or {}
        self.put(held.table.queue, row.payload, row.headers, None, priority_of(properties))

    def run_held(self, held: Held, work: Callable[[Connection], T]) -> T:
        return self.database.run(work)

    def completed(self, held: Held) -> None:
        """Taken out of its table when claimed: nothing to let go of."""

    def settled(self, rows: Iterable[Held]) -> None:
        """Nothing is leased, so nothing to forget."""
