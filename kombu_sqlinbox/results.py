"""Task results in the service's database: the result tables (one row per task, one per
saved group), and waiting for a result without sleeping a fixed interval.

A stored result announces itself where the database can: PostgreSQL NOTIFYs the
result's own channel in the writing transaction; elsewhere the writer sends the
same-host signal after its commit (to result waiters, not to queue consumers: their
directory is another), and a waiter also polls, soon at first and less often the longer
it waits, for writers on other hosts. Whatever wakes it, a waiter reads the row again,
so a lost wake-up costs time, never a result.

Celery's side (:mod:`celery_ext.results`) encodes and decodes; this module stores bytes.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

from sqlalchemy import Connection, TextClause, inspect
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError

from .database import Database
from .dialects import ResultStatements
from .dialects.results import RESULT_ID_BYTES
from .errors import ResultIdRefused, ResultIdTooLong, ResultTooLarge, reason_of
from .history import ResultsMissing, add_history_index
from .result_waiters import Waiter
from .wakeups import LocalSignal

logger = logging.getLogger(__name__)
T = TypeVar("T")
#: waiters (each a LISTEN connection on PostgreSQL) kept open between waits: threads
#: come and go (a web server's), the connections they waited on must not stay with them
IDLE_WAITERS = 4


@dataclass(frozen=True)
class StoredResult:
    """A task's row: its state, its encoded meta and when it was last written (epoch
    seconds: when it finished, once it has)."""

    status: str
    meta: bytes
    date_done: float | None


class ResultStore:
    """The result tables of one database and table prefix, and their waiters (one per
    waiting thread, lent for the wait: a waiting thread holds its LISTEN connection or
    signal socket alone; at most :data:`IDLE_WAITERS` stay open between waits)."""

    def __init__(self, database: Database, prefix: str, create_tables: bool = True,
                 max_bytes: int | None = None) -> None:
        self.database = database
        self.dialect = database.dialect
        self.prefix = prefix
        self.create_tables = create_tables
        self.max_bytes = max_bytes
        self.sql: ResultStatements = self.dialect.result_statements(prefix)
        directory = self.dialect.signal_directory()
        #: where writers signal the waiters of this host (SQLite)
        self.signal_directory = None if directory is None else directory + "-results"
        self._sender = None if directory is None else LocalSignal(directory + "-results")
        self._ready = False
        self._lock = threading.Lock()
        self._waiters: list[Waiter] = []
        self._idle: list[Waiter] = []
        self.pid = os.getpid()

    # -- tables --------------------------------------------------------------------------
    def ensure(self) -> None:
        """Create the tables on first use (``create_tables``), else check they exist:
        without them no result can be stored, and the error gives the DDL."""
        if self._ready:
            return
        with self._lock:
            if self._ready:
                return
            missing = self.database.run(lambda conn: [
                name for name in self.sql.names if not inspect(conn).has_table(name)],
                read_only=True)
            if missing and not self.create_tables:
                raise ResultsMissing(
                    f"the result tables {', '.join(missing)} do not exist (create_tables "
                    "is off); create them with:\n" + ";\n".join(self.sql.ddl) + ";")
            if missing:
                try:
                    self.database.run(self._create)
                except DBAPIError:  # another process created them at the same moment
                    self.database.run(self._create)
            # a kept task table (made by an earlier release) lacks it: MariaDB/MySQL's
            # CREATE TABLE IF NOT EXISTS, which carries it, leaves a kept table as it is
            add_history_index(self.database, self.sql, self.create_tables)
            self._ready = True

    def tables_gone(self) -> bool:
        """Whether a result table is missing (dropped since :meth:`ensure`): if so, the
        next use looks for them again, creating them where it may."""
        gone = self.database.run(lambda conn: not all(
            inspect(conn).has_table(name) for name in self.sql.names), read_only=True)
        if gone:
            self._ready = False
        return gone

    def _create(self, conn: Connection) -> None:
        for statement in self.sql.ddl:
            conn.exec_driver_sql(statement)

    def _run(self, work: Callable[[Connection], T], read_only: bool = False) -> T:
        self.ensure()
        return self.database.run(work, read_only=read_only, repeatable=True)

    # -- tasks ---------------------------------------------------------------------------
    def check_size(self, task_id: str, meta: bytes) -> None:
        """Refuse an id longer than the tables' key, or an encoded meta larger than the
        table or server takes, saying which (the server's limit is read as the first
        connection opens)."""
        check_id(task_id)
        self.ensure()
        size = self.dialect.sent_bytes(meta)
        limit, why = self.dialect.result_limit()
        if self.max_bytes is not None and self.max_bytes < limit:
            size, limit, why = len(meta), self.max_bytes, \
                "the result backend's max_result_bytes option"
        if size > limit:
            raise ResultTooLarge(
                f"task {task_id}: its result takes {size} bytes encoded, more than the "
                f"result table {self.sql.names[0]} stores ({limit} bytes: {why}); return "
                "a smaller result (a reference to where the data is kept)")

    def store(self, task_id: str, status: str, meta: bytes,
              task_name: str | None = None, worker: str | None = None) -> None:
        """Write a task's state (a row already in SUCCESS stays), and announce it."""
        self.check_size(task_id, meta)
        self._run(partial(self.write, task_id, status, meta, task_name, worker))
        self.announce()

    def write(self, task_id: str, status: str, meta: bytes, task_name: str | None,
              worker: str | None, conn: Connection) -> None:
        """:meth:`store`'s write in the caller's transaction on this database (its NOTIFY
        sent as that commits); the caller checks the size first and calls
        :meth:`announce` after its commit."""
        label = self.dialect.result_label
        conn.execute(self.sql.store, {"task_id": task_id, "status": status, "meta": meta,
                                      "task_name": label(task_name),
                                      "worker": label(worker)})
        self.dialect.result_notify(conn, self.dialect.result_channel(self.prefix, task_id))

    def write_new(self, task_id: str, status: str, meta: bytes, task_name: str | None,
                  worker: str | None, conn: Connection) -> bool:
        """:meth:`write` of a task that has no row yet, in the caller's transaction: True
        if this wrote it. A writer racing this one waits for its commit, then writes
        nothing."""
        label = self.dialect.result_label
        return bool(conn.execute(self.sql.store_new, {
            "task_id": task_id, "status": status, "meta": meta,
            "task_name": label(task_name), "worker": label(worker)}).rowcount)

    def announce(self) -> None:
        """Wake this host's waiters after a commit (where the database has no NOTIFY)."""
        if self._sender is not None:
            self._sender.send()

    def read(self, task_id: str) -> StoredResult | None:
        row = self._run(lambda conn: conn.execute(self.sql.read, {"task_id": task_id}).first(),
                        read_only=True)
        if row is None:
            return None
        return StoredResult(str(row[0]), bytes(row[1]),
                            None if row[2] is None else float(row[2]))

    def read_many(self, task_ids: Sequence[str], conn: Connection | None = None
                  ) -> dict[str, StoredResult]:
        """The stored rows of ``task_ids`` in one select, by id; in ``conn``'s transaction
        when given (a chord's last part reads its own result, not yet committed)."""
        def work(c: Connection) -> list[Any]:
            return list(c.execute(self.sql.read_many, {"task_ids": list(task_ids)}))

        rows = work(conn) if conn is not None else self._run(work, read_only=True)
        return {_text(row[0]): StoredResult(str(row[1]), bytes(row[2]),
                                            None if row[3] is None else float(row[3]))
                for row in rows}

    def forget(self, task_id: str) -> None:
        self._run(lambda conn: conn.execute(self.sql.forget, {"task_id": task_id}))

    # -- groups --------------------------------------------------------------------------
    def save_group(self, group_id: str, meta: bytes) -> None:
        self.check_size(group_id, meta)
        self._run(lambda conn: conn.execute(self.sql.save_group,
                                            {"group_id": group_id, "meta": meta}))

    def restore_group(self, group_id: str) -> tuple[bytes, float] | None:
        row = self._run(lambda conn: conn.execute(self.sql.restore_group,
                                                  {"group_id": group_id}).first(),
                        read_only=True)
        return None if row is None else (bytes(row[0]), float(row[1]))

    def delete_group(self, group_id: str) -> None:
        self._run(lambda conn: conn.execute(self.sql.delete_group, {"group_id": group_id}))

    # -- chords --------------------------------------------------------------------------
    def save_chord(self, group_id: str, meta: bytes, generated: bool = False,
                   into: Connection | None = None) -> None:
        """A chord's counter row, nothing counted and no size yet (a chord applied again
        under the same id starts over); ``generated``: its parts record their ids as
        they are counted (a header given as a generator). In ``into``'s transaction if
        given."""
        self.check_size(group_id, meta)

        def work(conn: Connection) -> None:
            conn.execute(self.sql.chord_save,
                         {"group_id": group_id, "meta": meta, "generated": int(generated)})
            conn.execute(self.sql.chord_parts_delete, {"group_id": group_id})

        self._write_in(into, work)

    def size_chord(self, group_id: str, size: int, into: Connection | None = None) -> None:
        self._write_in(into, lambda conn: conn.execute(
            self.sql.chord_size, {"group_id": group_id, "size": size}))

    def add_to_chord(self, group_id: str, change: Callable[[bytes], bytes | None],
                     into: Connection | None = None) -> bool:
        """One more task expected by chord ``group_id`` (Celery's ``add_to_chord``), its
        meta rewritten by ``change`` (None: kept) under the row's lock, in ``into``'s
        transaction if given; False without a counter row."""
        def work(conn: Connection) -> bool:
            if conn.execute(self.sql.chord_add, {"group_id": group_id}).rowcount == 0:
                return False
            meta = change(bytes(conn.execute(self.sql.chord_read,
                                             {"group_id": group_id}).one()[0]))
            if meta is not None:
                self.check_size(group_id, meta)
                conn.execute(self.sql.chord_meta, {"group_id": group_id, "meta": meta})
            return True

        return self._write_in(into, work)

    def _write_in(self, into: Connection | None, work: Callable[[Connection], T]) -> T:
        """``work`` in the caller's open transaction ``into`` (on this database), else in
        one of its own. Beside the caller's (a chord's body published as its header is
        counted), one of its own would wait on SQLite for the write lock the caller holds:
        the same thread's, so until the busy timeout, retried ten times."""
        if into is None:
            return self._run(work)
        self.ensure()
        return work(into)

    def count_chord(self, conn: Connection, group_id: str, task_id: str,
                    group_index: int | None) -> tuple[int, int | None] | None:
        """One more header task done, in the caller's transaction: ``(done, size)`` after
        it, or None without a counter row; a generator's part records its id. The UPDATE
        comes first: it locks the row (SQLite: the database) until the caller's
        transaction ends, so the parts count one at a time and the one reaching the size
        sees every other's result. Only the row's numbers are read: a count costs the
        same at a chord's end as at its start, whatever the header's size."""
        if conn.execute(self.sql.chord_count, {"group_id": group_id}).rowcount == 0:
            return None
        done, size, generated = conn.execute(self.sql.chord_numbers,
                                             {"group_id": group_id}).one()
        if generated:
            conn.execute(self.sql.chord_part, {"task_id": task_id, "group_id": group_id,
                                               "group_index": group_index})
        return int(done), None if size is None else int(size)

    def finish_chord(self, conn: Connection, group_id: str
                     ) -> tuple[bytes, list[tuple[int | None, str]]]:
        """A counted chord's meta and its generator's parts (``(group_index, task_id)``,
        in no order), its rows deleted, in the caller's transaction (:meth:`count_chord`'s,
        holding the counter row's lock)."""
        params = {"group_id": group_id}
        meta = bytes(conn.execute(self.sql.chord_read, params).one()[0])
        parts = [(None if index is None else int(index), _text(task_id))
                 for index, task_id in conn.execute(self.sql.chord_parts, params)]
        conn.execute(self.sql.chord_delete, params)
        conn.execute(self.sql.chord_parts_delete, params)
        return meta, parts

    # -- expiry --------------------------------------------------------------------------
    def expire(self, older_than: float, batch: int = 1000) -> int:
        """Delete the results and groups done more than ``older_than`` seconds ago, at
        most ``batch`` rows per transaction (a long delete would hold its locks, and on
        SQLite the whole database, for as long as it runs). Returns how many went.

        It goes on until a batch deletes none (PostgreSQL picks a batch's rows first: one
        forgotten meanwhile leaves it short), its cutoff fixed at its start."""
        total = 0
        started = time.monotonic()
        for statement in self.sql.expire:
            while True:
                expires = float(older_than) + time.monotonic() - started
                deleted = self._run(partial(_delete, statement, {
                    "expires": expires, "limit": batch}))
                total += deleted
                if deleted == 0:
                    break
        return total

    # -- waiting -------------------------------------------------------------------------
    def wait(self, task_id: str, ready: Callable[[], T | None], timeout: float | None,
             ceiling: float, on_round: Callable[[], object] | None = None) -> T | None:
        """``ready()``'s first value that is not None, read once at first and again after
        each wake-up for ``task_id`` (or each wait of at most ``ceiling`` seconds), with
        ``on_round()`` after each read, the one finding the value too; None
        once ``timeout`` seconds passed without one. A read the database does not answer
        (a server restarting, a connection cut) is read again at the next round: the
        driver's error is raised at the timeout, not before."""
        self.ensure()
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lent() as waiter, waiter.watching(task_id):
            lost: DBAPIError | None = None
            while True:
                try:
                    found, lost = ready(), None
                except (OperationalError, InterfaceError) as exc:
                    if lost is None:
                        logger.warning("sqlinbox: reading the result of %s failed (%s); "
                                       "reading again until get()'s timeout", task_id,
                                       reason_of(exc))
                    found, lost = None, exc
                if on_round is not None:  # after every read, as Celery's async backends:
                    on_round()  # get() checks the parents there, so a parent's error wins
                if found is not None:
                    return found
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    if lost is not None:
                        raise lost
                    return None
                waiter.wait(ceiling if left is None else min(ceiling, left))

    @contextlib.contextmanager
    def _lent(self) -> Iterator[Waiter]:
        """An idle waiter (or a new one) for one wait; given back after it, or closed
        when :data:`IDLE_WAITERS` are idle already."""
        with self._lock:
            waiter = self._idle.pop() if self._idle else None
        if waiter is None:
            waiter = Waiter(self.database, self.prefix, self.signal_directory)
            with self._lock:
                self._waiters.append(waiter)
        try:
            yield waiter
        finally:
            with self._lock:
                kept = waiter in self._waiters and len(self._idle) < IDLE_WAITERS
                if kept:
                    self._idle.append(waiter)
                elif waiter in self._waiters:
                    self._waiters.remove(waiter)
            if not kept:
                waiter.close(self.pid == os.getpid())

    def close(self) -> None:
        """Close every waiter's connection and socket, and the engine's pool (the
        process's own only: a forked child leaves its parent's alone)."""
        with self._lock:
            waiters, self._waiters, self._idle = self._waiters, [], []
        mine = self.pid == os.getpid()
        for waiter in waiters:
            waiter.close(mine)
        if self._sender is not None and mine:
            self._sender.close()
        self.database.dispose(close=mine)


def check_id(task_id: str) -> None:
    """Refuse a task or group id the result tables cannot key: over
    :data:`RESULT_ID_BYTES`, or with a NUL (PostgreSQL's text cannot; refused everywhere)."""
    size = len(task_id.encode())
    if size > RESULT_ID_BYTES:
        raise ResultIdTooLong(
            f"task id {task_id[:40]}...: {size} bytes (UTF-8), more than the "
            f"{RESULT_ID_BYTES} the result tables key; use a shorter task_id")
    if "\0" in task_id:
        raise ResultIdRefused(f"task id {task_id[:40]!r}: it holds a NUL character, which "
                              "the result tables cannot key; use another task_id")


def _text(value: str | bytes) -> str:
    """An id as stored (MySQL's binary column returns bytes)."""
    return value if isinstance(value, str) else bytes(value).decode()


def _delete(statement: TextClause, params: dict[str, Any], conn: Connection) -> int:
    return int(conn.execute(statement, params).rowcount)


_STORES: dict[tuple[str, str, bool, int | None, str], ResultStore] = {}
_STORES_LOCK = threading.Lock()


def store_for(url: str, prefix: str, create_tables: bool = True, max_bytes: int | None = None,
              engine_options: dict[str, Any] | None = None) -> ResultStore:
    """The process's result store for this database, prefix and options (Celery makes a
    backend per thread; they share one engine and one creation of the tables)."""
    options = dict(engine_options or {})
    key = (url, prefix, create_tables, max_bytes, repr(sorted(options.items())))
    with _STORES_LOCK:
        found = _STORES.get(key)
        if found is None or found.pid != os.getpid():
            found = _STORES[key] = ResultStore(Database.open(url, **options), prefix,
                                               create_tables, max_bytes)
        return found


def close_all() -> None:
    """Close every result store of this process (at its exit; tests between tests)."""
    with _STORES_LOCK:
        stores = list(_STORES.values())
        _STORES.clear()
    for store in stores:
        store.close()


def _forget_after_fork() -> None:
    """A forked child opens its own connections: the parent's stay the parent's. It takes
    a new lock: its copy may be held for ever by a thread of the parent's."""
    global _STORES_LOCK
    _STORES_LOCK = threading.Lock()
    stores = list(_STORES.values())
    _STORES.clear()
    for store in stores:
        store.database.dispose(close=False)


os.register_at_fork(after_in_child=_forget_after_fork)
atexit.register(close_all)
