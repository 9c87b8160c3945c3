"""Exchanges, bindings and the queue registry, shared by every process on one database.

kombu's virtual channel keeps its bindings in the memory of one process. Remote control
and events need them shared: a worker replies through the ``reply.celery.pidbox``
exchange to a queue only the caller bound, and ``celery inspect`` broadcasts to every
worker's queue. So bindings live in a table, and a publish to an exchange is one
``INSERT ... SELECT`` over them.

Queues that AMQP would not keep across a broker restart (not durable, auto-delete or
exclusive: pidbox, reply and ``celeryev.*`` queues) share one table of transient
messages, keyed by queue name, instead of a table each: they come and go by the
thousand, and a CREATE or DROP TABLE per ``celery inspect`` would cost more than the
messages. A queue registry records which queues are transient, their ``x-expires`` and
``x-message-ttl``; a bounded sweep deletes what expired, also when its owner crashed.
The transient messages themselves: :mod:`.transient`.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar
from weakref import WeakSet

from sqlalchemy import Connection, event, inspect
from sqlalchemy.exc import DBAPIError, SQLAlchemyError

from .database import Database
from .dialects import RoutingStatements
from .errors import SchemaMismatch
from .lapsing import Lapsing
from .renewal import Doomed, Renewer
from .tables import check_name
from .written import Written

logger = logging.getLogger(__name__)
T = TypeVar("T")

#: seconds a process keeps the bindings of an exchange it publishes to
BINDINGS_CACHE = 2.0
#: bound callers' connections whose transaction wrote bindings (until it ends): their
#: publishes read the bindings in it, not from a cache
_BINDING_CALLERS: WeakSet[Connection] = WeakSet()


@dataclass(frozen=True)
class Declared:
    """A queue as this process declared it: what keeps it registered."""

    transient: bool
    expires: float | None
    message_ttl: float | None


def matches(kind: str, routing_key: str, bound_key: str, pattern: str) -> bool:
    """Whether a binding takes a routing key, as kombu's exchange types decide."""
    if kind == "fanout":
        return True
    if kind == "topic":
        return re.match(pattern, routing_key) is not None
    return bound_key == routing_key


def _renewal(expires: float) -> float:
    """How long after a queue's expiry was pushed back it is pushed back again while
    consumed: a quarter of its x-expires, at most 30 s."""
    return min(expires / 4, 30.0)


class Routes:
    """The routing tables of one table prefix, for this process: the queue registry, the
    bindings and the sweep (the transient messages themselves: :mod:`.transient`)."""

    def __init__(self, database: Database, prefix: str, create: bool,
                 sweep_interval: float, sweep_batch: int) -> None:
        self.database = database
        self.dialect = database.dialect
        self.prefix = prefix
        self.create = create
        self.sweep_interval = sweep_interval
        self.sweep_batch = sweep_batch
        self.sql: RoutingStatements = self.dialect.routing_statements(prefix)
        self._lock = threading.Lock()
        self._ready = False
        #: why transient messages cannot be written or claimed (an earlier release's table)
        self.outdated_by: str | None = None
        self._transient: dict[str, bool] = {}
        self._declared: dict[str, Declared] = {}
        self._bound: dict[str, set[tuple[str, str, str, str, str]]] = {}
        self._touched: dict[str, float] = {}
        self._written = Written(database, BINDINGS_CACHE)
        #: each exchange's bindings, as read at most every BINDINGS_CACHE seconds
        self._tables_of: Lapsing[str, list[tuple[str, str, str, str, int]]] = Lapsing()
        self._next_sweep = 0.0
        #: queues' message TTLs (seconds) as registered elsewhere
        self._ttls: Lapsing[str, float | None] = Lapsing()
        #: how many consumers of this process are on each queue: those never expire
        self._consumers: Counter[str] = Counter()
        #: the x-expires (seconds) of queues consumed here that another process declared
        self._consumed_expires: dict[str, float | None] = {}
        self._renewing = threading.Lock()
        #: transient queues deleted here whose rows the renewal thread deletes (:meth:`forget`)
        self._doomed = Doomed(lambda doomed: self.database.run(
            lambda conn: self._forget(conn, doomed), durable=False))
        self.renewer = Renewer(self.renew, self._doomed.delete)
        #: called with a table-backed queue as it is registered again (a sweep may have
        #: dropped its table): the broker creates the table again
        self.restore_table: Callable[[str], None] = lambda queue: None

    # -- tables ----------------------------------------------------------------
    def available(self) -> bool:
        """Whether the routing tables exist: created once per process, or, when
        ``create_tables`` is off, looked for once (the service's migrations own them).
        Without them exchanges route within each process only, as in kombu's other
        virtual transports, and no queue can be transient (looked for again each time:
        they may be created while the process runs).

        While a caller's transaction is bound, where DDL joins a transaction, they are
        looked for and created in it (SQLite has one writer: a connection of ours would
        wait for the caller's), and not remembered until seen committed."""
        if self._ready:
            return True
        caller = self.database.bound_caller()
        if caller is not None and self.dialect.transactional_ddl:
            return self._find_or_create(caller)
        with self._lock:
            if not self._ready:
                self._ready = self._find_or_create(None)
                if self._ready:  # bindings made here before the tables were there
                    for bindings in list(self._bound.values()):
                        for binding in bindings:
                            self._write_binding(*binding)
        return self._ready

    def _find_or_create(self, caller: Connection | None) -> bool:
        def missing(conn: Connection) -> list[str]:
            """The tables missing, or what an earlier release's transient table needs;
            what the dialect finds wrong in tables that are there is logged (tables an
            earlier version made, say)."""
            absent = [name for name in self.sql.names if not inspect(conn).has_table(name)]
            if absent:
                return absent
            for table, problem in self.dialect.routing_problems(conn, self.sql.names):
                logger.warning("sqlinbox: routing table %s: %s", table, problem)
            return self._outdated(conn)

        lacking = missing(caller) if caller is not None else self.read(missing)
        if not lacking:
            return True
        if not self.create:
            if lacking != [self.sql.upgrade[1]]:
                return False
            # bindings and the registry serve as they are; transient messages wait for it
            self.outdated_by = (
                f"table {self.sql.names[2]!r} has no column {self.sql.upgrade[0]!r} "
                f"(create_tables is off); add it with:\n{self.sql.upgrade[1]};")
            return True
        if caller is not None:
            self._create(caller)
            return True
        try:
            self.database.run(self._create)
        except DBAPIError:
            # another process created them at the same moment; the second run finds them
            self.database.run(self._create)
        return True

    def read(self, work: Callable[[Connection], T]) -> T:
        """Run read-only ``work`` in the bound caller's transaction when there is one
        (what it wrote is visible only there), else on its own (:meth:`.Database.look`)."""
        caller = self.database.bound_caller()
        return work(caller) if caller is not None else self.database.look(work)

    def require(self, what: str) -> None:
        if not self.available():
            raise SchemaMismatch(
                f"{what} needs the routing tables {', '.join(self.sql.names)}, which do not "
                "exist (create_tables is off); create them with:\n"
                + ";\n".join(self.sql.ddl) + ";")

    def _create(self, conn: Connection) -> None:
        """The tables, what an earlier release's table lacks, then the indexes (which may
        be on what it lacked)."""
        indexes = [statement for statement in self.sql.ddl
                   if statement.startswith("CREATE INDEX")]
        for statement in self.sql.ddl:
            if statement not in indexes:
                conn.exec_driver_sql(statement)
        for statement in [*self._outdated(conn), *indexes]:
            conn.exec_driver_sql(statement)

    def _outdated(self, conn: Connection) -> list[str]:
        """What the transient messages' table, made by an earlier release, needs."""
        column, alter = self.sql.upgrade
        found = {c["name"] for c in inspect(conn).get_columns(self.sql.names[2])}
        return [] if column in found else [alter]

    def write(self, work: Callable[[Connection], T], durable: bool = True,
              one: bool = False) -> T:
        """Run ``work`` in the bound caller's transaction when there is one on this database
        (SQLite has one writer: ours would wait for the caller's), else in a transaction
        of our own (``one`` statement: :meth:`.Database.alone`)."""
        caller = self.database.bound_caller()
        if caller is not None:
            return work(caller)
        if one:
            return self.database.alone(work, repeatable=False, durable=durable)
        return self.database.run(work, durable=durable)

    # -- the queue registry ----------------------------------------------------
    def declare(self, queue: str, declared: Declared) -> None:
        """Register a queue that is transient or expires (others need no row)."""
        self._transient[queue] = declared.transient
        if not declared.transient and declared.expires is None and declared.message_ttl is None:
            self._declared.pop(queue, None)
            if self.available() and self._registered([queue]):
                self.forget(queue)  # declared durable now: no transient row of it stays
            return
        self.require(f"queue {queue!r} (transient, or with x-expires or x-message-ttl)")
        self._doomed.spare(queue)
        if self._declared.get(queue) == declared and self._written.holds((queue,)):
            return  # declared again by kombu for another use (see :class:`.Written`)
        self._declared[queue] = declared
        self.write(lambda conn: conn.execute(self.sql.declare, self._declare_params(
            queue, declared)), not declared.transient, one=True)  # lost as its queue is
        self._written.wrote((queue,), declared.expires, _renewal)
        if declared.expires is not None:  # the declaration pushed its expiry back
            self._touched[queue] = time.monotonic() + _renewal(declared.expires)

    @staticmethod
    def _declare_params(queue: str, declared: Declared) -> dict[str, Any]:
        return {"name": queue, "transient": int(declared.transient),
                "expires": declared.expires, "message_ttl": declared.message_ttl}

    def is_transient(self, queue: str) -> bool:
        """Whether the queue lives in the transient messages' table (as registered by
        whichever process declared it)."""
        found = self._transient.get(queue)
        if found is None:
            if not self.available():
                return False
            kind = self.read(
                lambda conn: conn.execute(self.sql.kind, {"name": queue}).scalar())
            found = self._transient[queue] = bool(kind)
        return found

    def message_ttl(self, queue: str) -> float | None:
        """The queue's ``x-message-ttl`` (seconds), as whichever process declared it
        registered it: this process's own declaration at once, others' read at most
        every :data:`BINDINGS_CACHE` seconds per queue."""
        declared = self._declared.get(queue)
        if declared is not None:
            return declared.message_ttl
        if not self._ttls.fresh(queue) and not self.available():
            return None

        def load() -> float | None:
            found = self.read(lambda conn: conn.execute(
                self.sql.message_ttl, {"name": queue}).scalar())
            return None if found is None else float(found)

        return self._ttls.read(queue, BINDINGS_CACHE, load)

    def registered(self, queue: str) -> bool:
        """Whether the queue is in the registry (committed)."""
        return bool(self._registered([queue]))

    def _registered(self, queues: Sequence[str]) -> set[str]:
        return set(self.read(
            lambda conn: conn.execute(self.sql.registered, {"ids": list(queues)}).scalars().all()))

    def consuming(self, queue: str, added: bool) -> None:
        """A consumer of this process started (``added``) or stopped consuming ``queue``:
        while one is on it, the queue never expires (:meth:`renew`)."""
        if added:
            self._consumers[queue] += 1  # first: counted as its cancel will be, come what may
            if queue not in self._declared and self.available():  # another's declaration
                found = self.read(lambda conn: conn.execute(
                    self.sql.expires, {"name": queue}).scalar())
                self._consumed_expires[queue] = None if found is None else float(found)
            if self._expires(queue) is not None:
                self.renewer.start()
        elif self._consumers[queue] > 1:
            self._consumers[queue] -= 1
        else:
            del self._consumers[queue]
            self._consumed_expires.pop(queue, None)

    def keep_alive(self, queue: str) -> None:
        """A consumer claims from ``queue``: :meth:`renew` it (a ``basic_get`` without a
        consumer keeps a queue too, as on RabbitMQ)."""
        if self._expires(queue) is not None:
            self.renew([queue])

    def renew(self, queues: Iterable[str] | None = None) -> float | None:
        """Push back the expiry of ``queues`` (by default every queue a consumer of this
        process is on) that declare one, each at most every quarter of it (at most every
        30 s), in one statement; register again, bindings included, any a sweep took
        meanwhile (this process could not reach the database for longer than its expiry).
        Returns the seconds until the next is due (None: nothing to renew)."""
        if not self._renewing.acquire(blocking=queues is None):
            return None  # the renewal thread is at it: a claim does not wait for it
        try:
            if queues is None:  # the renewal thread: first the deletes left to it (forget)
                self._doomed.delete()
            now = time.monotonic()
            due: dict[str, float] = {}
            next_at: float | None = None
            for queue in list(self._consumers if queues is None else queues):
                expires = self._expires(queue)
                if expires is None:
                    continue
                at = self._touched.get(queue, 0.0)
                if at <= now:
                    at = due[queue] = now + _renewal(expires)
                next_at = at if next_at is None else min(next_at, at)
            if due:
                self._touch(list(due))
                self._touched.update(due)
            return None if next_at is None else max(0.0, next_at - now)
        finally:
            self._renewing.release()

    def _touch(self, queues: list[str]) -> None:
        touched = self.database.run(
            lambda conn: conn.execute(self.sql.touch, {"ids": queues}).rowcount, durable=False)
        if touched >= len(queues):
            return
        for queue in set(queues) - self._registered(queues):
            self.register_again(queue)

    def _expires(self, queue: str) -> float | None:
        """The queue's x-expires: this process's declaration of it, else, for a queue
        consumed here, the one another process registered."""
        declared = self._declared.get(queue)
        if declared is not None:
            return declared.expires
        return self._consumed_expires.get(queue)

    def expires_here(self, queue: str) -> bool:
        """Whether this process declared ``queue`` with an ``x-expires``."""
        declared = self._declared.get(queue)
        return declared is not None and declared.expires is not None

    def register_again(self, queue: str) -> None:
        """Register a queue a sweep took again, as this process declared it, its table
        and bindings included (nothing when this process holds no declaration of it)."""
        declared = self._declared.get(queue)
        if declared is None:  # deleted here meanwhile
            return
        logger.warning("sqlinbox: queue %r expired while consumed; registering it again",
                       queue)
        self._written.drop(queue)
        try:
            self.declare(queue, declared)
            if not declared.transient:
                self.restore_table(queue)
            for binding in list(self._bound.get(queue, ())):
                self.bind(*binding)
        except SQLAlchemyError as exc:
            # its table dropped again meanwhile (sweeps racing, each after a missed
            # renewal), or the database out of reach: the next renewal or claim tries again
            logger.warning("sqlinbox: queue %r could not be registered again yet (%s)",
                           queue, exc)

    def forget(self, queue: str, later: bool = False) -> None:
        """Delete a queue's registry row, bindings and transient messages (a transient
        queue that expires: without waiting for the disk, as a crash that lost the delete
        leaves it to expire; deleted ``later``, an auto-delete's, e.g. every ping's reply
        queue: by the renewal thread, off the caller's way)."""
        declared = self._declared.get(queue)
        expiring = declared is not None and declared.transient and declared.expires is not None
        self._forget_here(queue)
        if later and expiring and self.database.bound_caller() is None:
            self._doomed.add(queue)
            self.renewer.start()
        elif self.available():
            self.write(lambda conn: self._forget(conn, [queue]), durable=not expiring)

    def _forget_here(self, queue: str) -> None:
        """Drop what this process remembers of a deleted queue."""
        for remembered in (self._declared, self._bound, self._transient, self._touched):
            remembered.pop(queue, None)  # type: ignore[attr-defined]
        self._written.drop(queue)

    def _forget(self, conn: Connection, queues: list[str]) -> None:
        for statement in self.sql.forget:
            conn.execute(statement, {"ids": queues})

    # -- bindings --------------------------------------------------------------
    def _wrote_bindings(self) -> None:
        """Bindings are about to be written in the bound caller's transaction, if any: its
        publishes must see them, which other processes' caches do not yet."""
        caller = self.database.bound_caller()
        if caller is not None and caller not in _BINDING_CALLERS:
            _BINDING_CALLERS.add(caller)
            for ended in ("commit", "rollback"):
                if not event.contains(caller, ended, _BINDING_CALLERS.discard):
                    event.listen(caller, ended, _BINDING_CALLERS.discard)

    def bind(self, exchange: str, kind: str, queue: str, routing_key: str, pattern: str) -> None:
        check_name(exchange, "exchange name")
        check_name(routing_key, "routing key", empty=True)
        binding = (exchange, kind, queue, routing_key, pattern)
        self._doomed.spare(queue)
        self._bound.setdefault(queue, set()).add(binding)
        if self._written.holds(binding):
            return
        self._tables_of.forget(exchange)
        if self.available():
            self._wrote_bindings()
            self._write_binding(exchange, kind, queue, routing_key, pattern)
            self._written.wrote(binding, self._expires(queue), _renewal)

    def _write_binding(self, exchange: str, kind: str, queue: str, routing_key: str,
                       pattern: str) -> None:
        transient = self._transient.get(queue, False)  # lost in a crash as its queue is
        self.write(lambda conn: conn.execute(self.sql.bind, {
            "exchange": exchange, "type": kind, "queue": queue, "routing_key": routing_key,
            "pattern": pattern}), durable=not transient, one=True)

    def unbind(self, exchange: str, queue: str, routing_key: str) -> None:
        self._bound[queue] = {b for b in self._bound.get(queue, ())
                              if (b[0], b[3]) != (exchange, routing_key)}
        self._written.drop(queue, exchange, routing_key)
        self._tables_of.forget(exchange)
        if not self.available():
            return
        self._wrote_bindings()
        self.write(lambda conn: conn.execute(self.sql.unbind, {
            "exchange": exchange, "queue": queue, "routing_key": routing_key}))

    def delete_exchange(self, exchange: str) -> None:
        self._tables_of.forget(exchange)
        self._written.drop(exchange=exchange)
        if self.available():
            self._wrote_bindings()
            self.write(lambda conn: conn.execute(self.sql.unbind_exchange,
                                                  {"exchange": exchange}))

    def bound(self, exchange: str, routing_key: str) -> tuple[set[str], bool] | None:
        """The table-backed queues bound to ``exchange`` that take ``routing_key``, and
        whether a transient one takes it, by the bindings table (None without one): read
        at most every :data:`BINDINGS_CACHE` seconds per exchange, but in a caller's
        transaction that wrote bindings, on every publish in it (what it bound routes at
        once). It holds this process's bindings too, and not those another process
        unbound since."""
        caller = self.database.bound_caller()
        if caller is not None and caller in _BINDING_CALLERS:
            rows = self._read_bindings(exchange)
        else:
            if not self._tables_of.fresh(exchange) and not self.available():
                return None
            rows = self._tables_of.read(exchange, BINDINGS_CACHE,
                                        lambda: self._read_bindings(exchange))
        taking = [(queue, transient) for bound_key, pattern, queue, kind, transient in rows
                  if matches(kind, routing_key, bound_key, pattern)]
        return ({queue for queue, transient in taking if not transient},
                any(transient for _, transient in taking))

    def _read_bindings(self, exchange: str) -> list[tuple[str, str, str, str, int]]:
        return self.read(lambda conn: [
            (row[0], row[1], row[2], row[3], int(row[4]))
            for row in conn.execute(self.sql.bound, {"exchange": exchange})])

    # -- expiry ----------------------------------------------------------------
    def sweep(self) -> list[str]:
        """At most every ``sweep_interval`` seconds: delete up to ``sweep_batch`` expired
        queues (their bindings and transient messages with them), expired messages, and
        messages published to a queue deleted meanwhile. Returns the expired queues that
        have tables of their own, for the broker to drop."""
        now = time.monotonic()
        if now < self._next_sweep or not self._ready:
            return []
        self._next_sweep = now + self.sweep_interval
        limit = {"limit": self.sweep_batch}

        consumed = list(self._consumers)  # the touch leaves queues without x-expires

        def expire(conn: Connection) -> list[tuple[str, int]]:
            if consumed:  # a queue consumed here never expires, whenever it was renewed
                conn.execute(self.sql.touch, {"ids": consumed})
            expired = [(row[0], row[1]) for row in conn.execute(self.sql.expired_queues, limit)]
            if expired:
                self._forget(conn, [name for name, _ in expired])
            conn.execute(self.sql.expired_messages, limit)
            conn.execute(self.sql.orphans, limit)
            return expired

        expired = self.database.run_fenced(expire)
        for name, _ in expired:
            self._forget_here(name)
        if expired:
            logger.info("sqlinbox: %d expired queue(s) deleted", len(expired))
        return [name for name, transient in expired if not transient]
