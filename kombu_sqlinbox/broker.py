"""Per-process state behind every Transport on one database: the process's Transports on
one URL and options share one :class:`Broker` (:mod:`.brokers`), one engine with a bounded
pool and one view of which queue lives in which table. It composes the layers below it:
the :class:`~.database.Database`, and on it the claim forms (:mod:`.claims`), the lease
keeper (:mod:`.keeper`), the wake-up (:mod:`.wakeups`) and the counts (:mod:`.throughput`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar
from weakref import WeakSet

from sqlalchemy import Connection, Engine
from sqlalchemy.exc import DBAPIError, NoSuchTableError

from . import binding
from .claims import claim_forms
from .codec import Undecodable, convert_payload, dead_letter_headers, parked_payload, parked_row
from .database import engine_for as engine_for  # re-exported: imported from here
from .database import open_database
from .database import same_database as same_database
from .dialects import RowsInsert
from .errors import ConfigurationError
from .exact import row_checks
from .keeper import LeaseKeeper
from .limits import Limiter, limited
from .options import TransportOptions
from .pausing import Pauses
from .routing import Declared, Routes
from .rows import ClaimedRow, Held, Settlement
from .rows import QueueTable as QueueTable
from .tables import Role, TableSpec, check_name, default_table, table_name_for_queue
from .task_rates import TaskRates
from .throughput import Throughput
from .transient import TransientQueues
from .unique import UniqueKey, UniquePublisher
from .urls import sqlalchemy_url as sqlalchemy_url
from .wakeups import Wakeup

logger = logging.getLogger(__name__)
T = TypeVar("T")


class Broker:
    """One database as a message broker, for this process."""

    def __init__(self, url: str, options: TransportOptions) -> None:
        self.options = options
        self.database = open_database(url, options)
        self.engine, self.dialect = self.database.engine, self.database.dialect
        # the database's own, for the transport's statements
        self.run = self.database.run
        self.bound_caller = self.database.bound_caller
        self.ping = self.database.ping
        self._tables: dict[str, QueueTable] = {}
        self._tables_lock = threading.Lock()
        self._inserts: dict[str, tuple[QueueTable, RowsInsert | None]] = {}
        #: the engines of bound transactions found on this database
        self._same_engines: WeakSet[Engine] = WeakSet()
        self.dialect.notify = options.notify and self.dialect.notify
        self.wakeup = Wakeup(self.database, local=options.notify)
        self.keeper = LeaseKeeper(self.database, wake=self.wakeup.poke)
        self.forms = claim_forms(self.database, self.keeper, self.wakeup)
        self.unique = UniquePublisher(self.database, options, self.wakeup.published)
        self.routes = Routes(self.database, options.table_prefix, options.create_tables,
                             sweep_interval=options.sweep_interval,
                             sweep_batch=options.sweep_batch)
        self.routes.restore_table = self._restore_table
        self.limits = Limiter(self.database, self.keeper, options,
                              self.wakeup.claim_in_transaction, self.wakeup.claim)
        self.pauses = Pauses(self.database, self.wakeup, options.table_prefix,
                             options.create_tables, options.pause_check_interval)
        self.rates = TaskRates(self.database, self.keeper, options.table_prefix,
                               options.create_tables)
        self.transient = TransientQueues(self.routes, self.wakeup)
        self.throughput = Throughput(self.database, options)
        #: how a message for transient queues is encoded (the codec's view of their table)
        self.transient_template = QueueTable("", self.transient.spec, options.defaults, False,
                                             True, self.transient, transient=True)
        self.pid = os.getpid()
        self.closed = False

    # -- running work --------------------------------------------------------
    def read(self, table: QueueTable, work: Callable[[Connection], T]) -> T:
        """Run read-only ``work`` on ``table`` in a deferred transaction of our own; in the
        bound caller's when the table was created in that transaction (not yet remembered
        by :meth:`table`), the one place it exists until the caller commits."""
        caller = self.bound_caller()
        if caller is not None and self._tables.get(table.queue) is not table:
            binding.write_pending(caller)
            return work(caller)
        return self.run(work, read_only=True)

    # -- queues --------------------------------------------------------------
    def table(self, queue: str) -> QueueTable:
        """The queue's table, created or checked on first use in this process, together
        with every table it may move messages to (its dead-letter queue's, and so on): a
        missing one fails now, not when the first message is parked.

        A missing table, while a caller's transaction on this database is bound (a bound
        publish or queue declaration, a transactional task), is created in that
        transaction where the database's DDL joins one: a second connection could wait on
        the caller's own locks (SQLite has one writer). It is remembered once it is seen
        committed (the caller may roll back).
        """
        found = self._tables.get(queue)
        if found is not None:
            return found
        caller = self.bound_caller()
        with self._tables_lock:
            chain: dict[str, tuple[QueueTable, bool]] = {}
            name: str | None = queue
            while name is not None and name not in self._tables and name not in chain:
                chain[name] = self._resolve(name, caller)
                name = chain[name][0].options.dead_letter_queue
            # none of them unless all of them passed
            self._tables.update({name: table for name, (table, lasting) in chain.items()
                                 if lasting})
            return self._tables.get(queue) or chain[queue][0]

    def _resolve(self, queue: str, caller: Connection | None) -> tuple[QueueTable, bool]:
        options = self.options.for_queue(queue)
        if not self.has_own_table(queue) and self.routes.is_transient(queue):
            return QueueTable(queue, self.transient.spec, options, False, True, self.transient,
                              transient=True), True
        spec = self.spec_for(queue)
        created = options.table is None
        form = self.forms[options.claim]
        form.check(queue)
        spec.require(Role.LOCKED_UNTIL, f"claim={options.claim!r}", queue)
        spec.require(Role.ATTEMPT, f"claim={options.claim!r} (attempt is the fencing token)",
                     queue)
        id_column = spec.column(Role.ID)
        if id_column is not None and not id_column.generated:
            raise ConfigurationError(
                f"queue {queue!r}: table {spec.table!r} has a non-generated id; the transport "
                "can only publish into a table whose id the database generates"
            )
        def ensure(conn: Connection) -> QueueTable:
            payload_is_text = self.dialect.ensure_table(conn, spec, self.options.create_tables)
            exact, as_json = row_checks(conn, spec)
            return QueueTable(queue, spec, options, payload_is_text, created, form,
                              exact=exact, as_json=as_json)

        if (caller is not None and self.dialect.transactional_ddl
                and not self.database.has_table(spec)):
            return ensure(caller), False
        try:
            return self.run(ensure, read_only=True), True
        except (DBAPIError, NoSuchTableError):
            # another process created the table at the same moment (PostgreSQL reports
            # a duplicate type), or dropped it between its creation and its check (the
            # sweep of an expired queue): the second look finds and checks it
            return self.run(ensure, read_only=True), True

    def has_own_table(self, queue: str) -> bool:
        """A queue configured in the transport options always has a table of its own."""
        return queue in self.options.queues

    def declare_queue(self, queue: str, durable: bool = True, auto_delete: bool = False,
                      exclusive: bool = False, arguments: dict[str, Any] | None = None,
                      ) -> QueueTable:
        """Declare a queue as kombu does: one that AMQP would not keep (not durable,
        auto-delete or exclusive) is transient; ``x-expires`` and ``x-message-ttl``
        (milliseconds) are registered. An auto-delete or exclusive queue gets
        ``idle_queue_expires`` when it sets no expiry, so a crashed owner's queue goes."""
        check_name(queue)
        arguments = arguments or {}
        transient = not self.has_own_table(queue) and (not durable or auto_delete or exclusive)
        expires = _seconds(arguments.get("x-expires"))
        if expires is None and transient and (auto_delete or exclusive):
            expires = self.options.idle_queue_expires
        message_ttl = _seconds(arguments.get("x-message-ttl"))
        self.routes.declare(queue, Declared(transient, expires, message_ttl))
        known = self._tables.get(queue)
        if known is not None and known.transient != transient:
            self.forget_table(queue)
        return self.table(queue)

    def listen(self, table: QueueTable) -> None:
        """Wake this process's consumers when a message for ``table`` is published
        elsewhere: by NOTIFY where the database has it, else by the same-host signal
        where there is one."""
        if table.transient:
            self.transient.listen(table.queue)
            return
        self.pauses.consuming()  # told when a queue is paused or resumed
        # without NOTIFY, the same-host signal alone, where there is one
        self.wakeup.listen(self.dialect.channel(table.spec) if self.dialect.notify else None)

    def sweep(self) -> None:
        """Delete what expired (bounded, at most every ``sweep_interval``); an expired
        queue with a table of its own is deleted as ``queue_delete`` would, unless its
        consumer registered it again meanwhile (back from an outage)."""
        for queue in self.routes.sweep():
            if not self.routes.registered(queue):
                self._drop_expired(queue)

    def _drop_expired(self, queue: str) -> None:
        """:meth:`_drop` a swept queue, looked up, never created (another sweep may be first)."""
        known = self._tables.get(queue)
        spec = known.spec if known is not None else self.spec_for(queue)
        self.run(lambda conn: self._drop(conn, spec, self.options.for_queue(queue).table is None))
        self.forget_table(queue)

    def _drop(self, conn: Connection, spec: TableSpec, own: bool) -> None:
        """Drop a queue's table if the transport made it, with its limits' slots (see
        :meth:`.Limiter.dropped`); else empty it."""
        statements = self.dialect.statements(spec)
        conn.execute(statements.drop if own else statements.purge)
        if own:
            self.limits.dropped(conn, spec)

    def restore_dropped(self, table: QueueTable) -> bool:
        """After a claim failed: whether the next round may claim again, its table back.
        A sweep that raced this process's registering the queue again may have dropped
        it: a queue this process declared with an expiry is registered again, its table
        and bindings included (unless the renewal did so meanwhile; a database out of
        reach fails the look for the table). False: a queue of another kind, whose
        failure propagates."""
        if table.transient or not self.routes.expires_here(table.queue):
            return False
        if not self.database.has_table(table.spec):
            self.routes.register_again(table.queue)
        return True

    def _restore_table(self, queue: str) -> None:
        """A consumed queue a sweep deleted is registered again: its table, which the
        sweep may have dropped, is looked for (and created) again."""
        self.forget_table(queue)
        self.table(queue)

    def forget_table(self, queue: str) -> None:
        with self._tables_lock:
            self._tables.pop(queue, None)

    def spec_for(self, queue: str) -> TableSpec:
        """The queue's declared table, or the default layout under the table prefix."""
        return self.options.for_queue(queue).table or default_table(
            table_name_for_queue(queue, self.options.table_prefix))

    def known_table(self, queue: str) -> bool:
        return self.database.has_table(self.spec_for(queue))

    # -- message operations ----------------------------------------------------
    def publish(self, table: QueueTable, params: dict[str, Any],
                caller: Connection | None = None) -> None:
        """Insert one message: in the caller's bound transaction when there is one (it
        then exists only if the caller commits; held for a multi-row INSERT when the
        binding batches, see :mod:`.binding`), else in a transaction of our own, through
        the driver's cursor. A declared publish statement runs through SQLAlchemy, one
        row at a time."""
        insert = self._rows_insert(table)
        if caller is not None:
            self.check_same_database(caller, table.queue)
            batch = binding.batch_for(caller, self._write_held) if insert else None
            if batch is not None:
                batch.add(insert, params)  # one per table and driver, hashed by identity
                return
            binding.write_pending(caller)  # rows published before this one go first
            self.dialect.publish(caller, table.spec, [params])
            return
        # a queue whose tasks may be lost in a database crash does not wait for the disk
        durable = table.options.synchronous_commit
        if insert is None:
            self.run(lambda conn: self.dialect.publish(conn, table.spec, [params]),
                     durable=durable)
        else:
            self.database.write(insert, [params], durable=durable)
        self.wakeup.published()

    def _rows_insert(self, table: QueueTable) -> RowsInsert | None:
        """The table's publish statement for the driver, remembered by queue name (cheaper
        to look up than by its table's layout)."""
        found = self._inserts.get(table.queue)
        if found is None or found[0] is not table:
            found = self._inserts[table.queue] = (table, self.database.rows_insert(table.spec))
        return found[1]

    @staticmethod
    def _write_held(conn: Connection, insert: RowsInsert,
                    rows: list[Mapping[str, Any]]) -> None:
        """A batch's rows of one table: one INSERT per chunk the server's limits allow."""
        for chunk in insert.chunks(rows):
            conn.exec_driver_sql(insert.sql(len(chunk)), insert.parameters(chunk))

    def check_same_database(self, caller: Connection, queue: str) -> None:
        """Refuse a bound transaction on another database (an engine found on this one is
        remembered: a bulk publish asks once per message)."""
        if caller.engine in self._same_engines:
            return
        if same_database(self.engine, caller.engine):
            self._same_engines.add(caller.engine)
            return
        raise ConfigurationError(
            f"queue {queue!r}: the bound transaction is on {caller.engine.url}, the broker "
            f"on {self.engine.url}; a transactional enqueue needs both on one database")

    def claim(self, table: QueueTable, limit: int, skip: Sequence[Any] = ()) -> list[ClaimedRow]:
        if not table.transient and self.pauses.paused(table.queue):
            return []  # its rows wait (:mod:`.pausing`); remote control never pauses
        claims = self.limits if limited(table.options) else table.claims  # :mod:`.limits`
        if self.rates.applies(table):  # :mod:`.rates`, :mod:`.task_rates`
            return self.rates.claim(table, limit, skip, claims)  # as its budgets give
        return claims.claim(table, limit, skip)

    def dead_letter(
        self, held: Held, row: ClaimedRow, reason: str, undecodable: bool = False,
    ) -> None:
        """Move a held row to its queue's dead-letter queue (or delete it) in one transaction,
        fenced: a row no longer held here is left alone."""
        source = held.table
        target_name = source.options.dead_letter_queue
        target = self.table(target_name) if target_name else None
        death = {
            "queue": source.queue,
            "reason": reason,
            "attempts": held.attempt,
            "id": held.id,
            "at": time.time(),
        }
        payload: bytes | str | None
        if source.spec.rows is not None and row.headers is None:
            # a row no kombu wrote (row mode) is parked as its raw columns
            payload, headers = parked_row(row, source, death)
        else:
            if undecodable:  # start a clean envelope so the dead letter itself decodes
                death["original_headers"] = row.headers
            headers = dead_letter_headers(None if undecodable else row.headers, death)
            payload = parked_payload(row.payload)
        if target is not None:
            payload = convert_payload(payload, target.payload_is_text)
        statements = self.dialect.statements(source.spec)
        tokens = {held.attempt: [held.id]}

        def work(conn: Connection) -> bool:
            # moved rows leave the table; dropped ones end as an ack would. The fenced
            # statement finds nothing when the row was claimed again after its lease
            # lapsed: it is the new holder's, so no copy is parked
            if not self.dialect.settle(conn, statements.complete if target is None else
                                       statements.delete, tokens):
                return False
            if target is not None:
                self.dialect.publish(conn, target.spec, [self.dialect.publish_params(
                    target.spec, payload, headers)])
            return True

        if not source.claims.run_held(held, work):
            logger.info("sqlinbox: message %s of queue %r was claimed again elsewhere before "
                        "it could be parked (%s); left to its new holder",
                        held.id, source.queue, reason)
            return
        logger.warning("sqlinbox: message %s of queue %r %s: %s", held.id, source.queue,
                       f"moved to {target_name!r}" if target_name else "dropped", reason)

    def settle(self, how: Settlement, held: Held, delay: float = 0.0) -> None:
        held.table.claims.settle(how, held, delay)

    def close(self) -> None:
        self.closed = True
        self.routes.renewer.stop()
        self.keeper.stop()
        self.throughput.stop()
        self.wakeup.close()
        self.database.dispose()

    # -- what the kombu glue and transactional tasks ask of the broker ---------
    def publish_message(
        self, table: QueueTable, payload: bytes | str | None, headers: str | None,
        priority: int = 0, eta: float | None = None, group: str | None = None,
        partition_key: str | None = None, ttl: float | None = None,
        task: tuple[str | None, str | None] = (None, None), columns: Sequence[Any] = (),
        unique: UniqueKey | None = None,
    ) -> None:
        """Publish one encoded message, in the bound caller's transaction when there is
        one; refused (:class:`~.errors.MessageTooLarge`) before the server would refuse
        the statement. ``ttl`` (seconds) bounds a transient message's life; ``task``
        (name, id) is for a declared publish statement, ``columns`` are the row columns'
        values (row mode); ``unique``, a key: see :mod:`.unique`."""
        self.dialect.check_message_size(table.queue, payload, headers)
        if unique is not None:
            caller = binding.current()
            if caller is not None:
                self.check_same_database(caller, table.queue)
            return self.unique.publish(table, self.dialect.publish_params(
                table.spec, payload, headers, priority, eta, group, partition_key), unique, task[1])
        if table.transient:
            self.transient.put(table.queue, payload or b"", headers, ttl, priority)
            return
        self.publish(table, self.dialect.publish_params(
            table.spec, payload, headers, priority, eta, group, partition_key, task, columns),
            binding.current())

    def held_for(self, table: QueueTable, row: ClaimedRow) -> Held:
        return table.claims.held_for(table, row)

    def admit(self, held: Held, row: ClaimedRow,
              decode: Callable[[], dict[str, Any]]) -> dict[str, Any] | None:
        """The message of a claimed row (``decode`` reads it), or None when the row went to
        its dead-letter queue instead: one claimed more often than its queue's
        ``max_attempts`` allows, checked before anything is read from the row, or one
        whose message does not decode (:class:`~.codec.Undecodable` says why)."""
        limit = held.table.options.max_attempts
        if limit is not None and row.attempt > limit and not held.table.transient:
            try:  # decoded only to know whether the parked copy needs a fresh envelope
                decode()
                undecodable = False
            except Undecodable:
                undecodable = True
            self.dead_letter(held, row, f"delivered {row.attempt} times, max_attempts is "
                             f"{limit} (earlier deliveries crashed, expired or were requeued)",
                             undecodable=undecodable)
            return None
        try:
            return decode()
        except Undecodable as exc:
            if held.table.transient:  # taken out of its table already: nothing to park
                logger.warning("sqlinbox: transient message of queue %r dropped: %s",
                               held.table.queue, exc)
            else:
                self.dead_letter(held, row, str(exc), undecodable=True)
            return None

    def reject(self, held: Held, row: ClaimedRow, requeue: bool) -> None:
        """A consumer's reject: back in place (the delivery counts towards
        ``max_attempts``), or else to the dead-letter queue. A row whose move fails goes
        back too, rather than stay held, and the failure propagates."""
        if requeue:
            self.settle(Settlement.RELEASE, held)
            return
        if held.table.transient:  # taken out of its table already
            return
        try:
            self.dead_letter(held, row, "rejected without requeue by the consumer")
        except Exception:
            self.settle(Settlement.RELEASE, held)
            raise

    def retry_later(self, held: Held, seconds: float) -> None:
        """Requeue in place (same row, attempt counted), hidden for ``seconds``; at once
        on a table without an available_at column, which cannot hide a row."""
        if not held.table.spec.has(Role.AVAILABLE_AT):
            logger.warning("sqlinbox: queue %r has no available_at column: retry_after "
                           "requeues at once instead of in %gs", held.table.queue, seconds)
            self.settle(Settlement.RELEASE, held)
            return
        self.settle(Settlement.RETRY, held, max(0.0, float(seconds)))

    def size(self, table: QueueTable) -> int:
        """How many of the queue's messages are not in work (ready or delayed)."""
        if table.transient:
            return self.transient.size(table.queue)
        statement = self.dialect.statements(table.spec).size
        return int(self.read(table, lambda conn: conn.execute(statement).scalar_one()))

    def purge(self, table: QueueTable) -> int:
        """Delete the queue's messages not in work; how many went."""
        if table.transient:
            return self.transient.purge(table.queue)
        statement = self.dialect.statements(table.spec).purge
        return int(self.run(lambda conn: conn.execute(statement).rowcount))

    def delete_queue(self, queue: str, later: bool = False) -> None:
        """Drop the queue's table if the transport created it; a declared (service-owned) table
        is only emptied; one not there is not made to be dropped (``later``: Routes.forget)."""
        if (queue not in self._tables and not self.has_own_table(queue)
                and self.bound_caller() is None and not self.routes.is_transient(queue)
                and not self.known_table(queue)):
            self.routes.forget(queue)  # bindings may outlive their queue's table
            return
        table = self.table(queue)
        if not table.transient:
            self.run(lambda conn: self._drop(conn, table.spec, table.created_by_transport))
        self.transient.unlisten(queue)  # nothing when it has no channel watched here
        self.routes.forget(queue, later)  # its registry row, bindings and transient messages
        self.forget_table(queue)

    def still_held(self, conn: Connection, table: QueueTable, row_id: int,
                   attempt: int) -> bool:
        """Whether the row is still held with this fencing token, as ``conn``'s
        transaction sees it (a transactional task taking its delivery over)."""
        statement = self.dialect.statements(table.spec).still_held
        return conn.execute(statement, {"id": row_id, "attempt": attempt}).first() is not None

    def complete_in(self, conn: Connection, table: QueueTable, row_id: int,
                    attempt: int) -> bool:
        """Complete a held row in the caller's transaction, fenced by its attempt, so it
        commits with the caller's writes; False when the row is no longer this holder's."""
        statement = self.dialect.statements(table.spec).complete
        return self.dialect.settle(conn, statement, {attempt: [row_id]}) == 1


def _seconds(milliseconds: Any) -> float | None:
    """A queue argument in milliseconds (``x-expires``, ``x-message-ttl``) in seconds."""
    return None if milliseconds is None else float(milliseconds) / 1000.0
