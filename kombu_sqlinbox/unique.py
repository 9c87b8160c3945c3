"""Unique keys: a publish whose key is taken writes nothing and names the task that holds it.

A message asks for it with the property ``unique_key`` (Celery: ``apply_async(...,
unique_key=...)``), and ``unique_scope`` says how long a row holds its key:

* ``"active"`` (the default): while it is in the table, waiting or running: until its
  task is acknowledged, moved to the dead-letter queue or dropped;
* ``"waiting"``: while no worker holds it: a row under a lease gives its key up to the
  next publish with that key;
* a number of seconds: for that long from the publish, whatever becomes of the row (a
  row of the timed keys' table, ``<prefix>unique_keys``, written in the publish's
  transaction and expiring by the database's clock).

The queue table's unique index decides (:mod:`.dialects.unique`; for a timed scope, the
timed keys' primary key): of two processes publishing one key at the same moment, one row
lands. The key is a column of the row
itself, so nothing outlives the row: a killed worker's row keeps its key only as long as
the row waits to run again.

A publish with the key of a row of the same task id is that task's retry (Celery
republishes a retried task under its id while its row is held): the earlier row gives its
key to the new one, which it is about to be acknowledged for.
"""

from __future__ import annotations

import hashlib
import json
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from weakref import WeakKeyDictionary

from sqlalchemy import Connection, inspect
from sqlalchemy.exc import DBAPIError

from . import binding
from .database import Database
from .dialects import UniqueStatements
from .errors import ConfigurationError, DuplicateTask, SchemaMismatch
from .options import TransportOptions
from .rows import QueueTable

#: the message properties that carry a key and its scope
KEY_PROPERTY, SCOPE_PROPERTY = "unique_key", "unique_scope"
SCOPES = ("active", "waiting")
#: the longest key taken (it travels in the message's envelope too)
MAX_KEY_LENGTH = 1024


@dataclass(frozen=True)
class UniqueKey:
    """A message's key and scope; the row stores the key's SHA-256 (:attr:`digest`)."""

    key: str
    #: a scope of :data:`SCOPES`, or seconds
    scope: str | float = "active"

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.key.encode("utf-8", "surrogatepass")).hexdigest()


def unique_of(properties: dict[str, Any]) -> UniqueKey | None:
    """The unique key a message's properties ask for, or None; a key that is no non-empty
    string of at most :data:`MAX_KEY_LENGTH` characters, or an unknown scope, is refused."""
    key = properties.get(KEY_PROPERTY)
    if key is None:
        return None
    if not isinstance(key, str) or not key or len(key) > MAX_KEY_LENGTH:
        raise ConfigurationError(
            f"unique_key must be a non-empty string of at most {MAX_KEY_LENGTH} characters, "
            f"got {type(key).__name__} {str(key)[:80]!r}")
    scope = properties.get(SCOPE_PROPERTY, "active")
    if isinstance(scope, (int, float)) and not isinstance(scope, bool):
        if not math.isfinite(scope) or scope <= 0:
            raise ConfigurationError(f"unique_scope: {scope!r} is no number of seconds")
        return UniqueKey(key, float(scope))
    if scope not in SCOPES:
        raise ConfigurationError(
            f"unique_scope must be one of {SCOPES} or seconds, got {scope!r}")
    return UniqueKey(key, scope)


def task_id_of(stored: bytes | str | None) -> str | None:
    """The task id in a stored envelope (Celery's ``id`` header, else the message's
    correlation id)."""
    try:
        envelope = json.loads(stored or "null")
    except ValueError:
        return None
    if not isinstance(envelope, dict):
        return None
    found = (envelope.get("headers") or {}).get("id") or (
        envelope.get("properties") or {}).get("correlation_id")
    return found if isinstance(found, str) else None


class UniquePublisher:
    """Publishes with a unique key on one database; adds the key column and index to a table
    on its first keyed publish (where the transport may create tables)."""

    def __init__(self, database: Database, options: TransportOptions,
                 wake: Callable[[], None]) -> None:
        self.database, self.dialect = database, database.dialect
        self.create = options.create_tables
        self.keys = self.dialect.key_statements(options.table_prefix)
        self.keys_table = f"{options.table_prefix}unique_keys"
        self.wake = wake
        #: by table as this process uses it: a queue deleted and declared again is a new one
        self._ready: WeakKeyDictionary[QueueTable, UniqueStatements] = WeakKeyDictionary()
        self._keys_ready = False
        self._lock = threading.Lock()

    def publish(self, table: QueueTable, params: dict[str, Any], unique: UniqueKey,
                task_id: str | None) -> None:
        """Write the row unless its key is taken; :class:`~.errors.DuplicateTask` (naming
        the holder's task id) when it is. In the caller's bound transaction when there is
        one (rows it held for one INSERT go first)."""
        caller = binding.current()
        if isinstance(unique.scope, float):
            self._publish_timed(table, params, unique, task_id, caller)
            return
        statements = self._statements(table, caller)
        params = {**params, "unique_key": unique.digest}

        def work(conn: Connection) -> str | None:
            """None once written, else the holder's task id. Each turn round the loop
            follows a change another transaction made (the holder went, or gave its key
            up), so it ends."""
            while True:
                if self.dialect.insert_unique(conn, table.spec, statements.insert, params):
                    return None
                found = conn.execute(statements.find, {"unique_key": unique.digest}).first()
                if found is None:
                    continue  # the holder went since the INSERT: try again
                row_id, stored, held = found
                holder = task_id_of(stored)
                if held and (unique.scope == "waiting" or (
                        task_id is not None and holder == task_id)):
                    conn.execute(statements.release, {"id": row_id,
                                                      "unique_key": unique.digest})
                    continue
                return holder or ""

        self._run(table, unique, work, caller)

    def _run(self, table: QueueTable, unique: UniqueKey,
             work: Callable[[Connection], str | None], caller: Connection | None) -> None:
        """``work`` in the caller's transaction (after the rows it held) or one of our own;
        :class:`~.errors.DuplicateTask` when it names a holder."""
        if caller is not None:
            binding.write_pending(caller)
            holder = work(caller)
        else:
            holder = self.database.run(work, durable=table.options.synchronous_commit)
        if holder is not None:
            raise DuplicateTask(table.queue, unique.key, holder or None)
        if caller is None:
            self.wake()

    def _publish_timed(self, table: QueueTable, params: dict[str, Any], unique: UniqueKey,
                       task_id: str | None, caller: Connection | None) -> None:
        """Take the key in the timed keys' table, then write the row, in one transaction
        (a key whose time is up is dropped first, and a few other expired keys with it). A
        retry of the task holding the key is written."""
        self._check(table)
        keys = self.keys
        if not self._keys_ready:
            self._ready_keys(caller)
        key = {"queue_table": table.spec.table, "unique_key": unique.digest}

        def work(conn: Connection) -> str | None:
            """As in :meth:`publish`: a turn round the loop follows another's change."""
            while True:
                conn.execute(keys.expire, key)
                if self.dialect.claim_key(conn, keys.claim,
                                          {**key, "task_id": task_id, "seconds": unique.scope}):
                    conn.execute(keys.sweep)
                    break
                found = conn.execute(keys.holder, key).first()
                if found is None:
                    continue  # dropped since, expired: try again
                if found[0] != task_id or task_id is None:
                    return found[0] or ""
                break  # the holder's own retry
            self.dialect.publish(conn, table.spec, [params])
            return None

        self._run(table, unique, work, caller)

    def _ready_keys(self, caller: Connection | None) -> None:
        """Create the timed keys' table (or name its DDL where the transport creates no
        tables); in the caller's transaction where ours would wait for it (SQLite)."""
        def ready(conn: Connection) -> None:
            if inspect(conn).has_table(self.keys_table):
                return
            if not self.create:
                raise SchemaMismatch(
                    f"table {self.keys_table!r} (timed unique keys) does not exist "
                    "(create_tables is off); create it with:\n"
                    + ";\n".join(self.keys.ddl) + ";")
            try:
                with conn.begin_nested():
                    for statement in self.keys.ddl:
                        conn.exec_driver_sql(statement)
            except DBAPIError:
                # another process created it at that moment (PostgreSQL reports a
                # duplicate type): there it is
                if not inspect(conn).has_table(self.keys_table):
                    raise

        if caller is not None and self.dialect.transactional_ddl and (
                not self.dialect.capabilities.row_locks):
            ready(caller)
            return
        with self._lock:
            self.database.run(ready)
            self._keys_ready = True

    def _check(self, table: QueueTable) -> None:
        """Refuse a queue whose rows are no Celery messages the transport writes."""
        spec = table.spec
        if table.transient or spec.publish is not None or spec.plain or spec.rows is not None:
            raise ConfigurationError(
                f"queue {table.queue!r}: unique keys need a queue table storing Celery's "
                "messages with the transport's publish statement (not a transient queue, "
                "a declared publish statement, row mode or plain rows)")

    def _statements(self, table: QueueTable, caller: Connection | None) -> UniqueStatements:
        """The table's keyed statements, once it is found (or made) ready for them: in a
        transaction of our own, remembered; in the bound caller's where ours would wait
        for it (SQLite's one writer) or not see the table (made in it), remembered only
        once seen outside it (the caller may roll back)."""
        found = self._ready.get(table)
        if found is not None:
            return found
        spec = table.spec
        self._check(table)
        refusal = self.dialect.unique_refusal(spec)
        if refusal is not None:
            raise ConfigurationError(f"queue {table.queue!r}: {refusal}")
        create, queue = self.create and table.created_by_transport, table.queue
        ddl = ";\n".join(self.dialect.unique_ddl(spec)) + ";"

        def ready(conn: Connection, bounded: bool = True) -> None:
            if self.dialect.has_unique(conn, spec):
                return
            if not create:
                raise SchemaMismatch(
                    f"queue {queue!r}: table {spec.table!r} has no unique key column "
                    "and index (made by this version on a keyed publish where the transport "
                    f"creates its tables); add them with:\n{ddl}")
            try:
                self.dialect.add_unique(conn, spec, bounded)
            except DBAPIError as exc:
                if not self.dialect.is_lock_timeout(exc):
                    raise
                raise SchemaMismatch(
                    f"queue {queue!r}: table {spec.table!r} got no unique key column within "
                    f"{self.dialect.unique_ddl_wait} s: a transaction holds the table (a "
                    "bound caller that used it before its first keyed send waits for this "
                    f"in turn); send a keyed message outside it first, or add them with:\n{ddl}"
                ) from exc

        if caller is not None and self.dialect.transactional_ddl and (
                not self.dialect.capabilities.row_locks or not self.database.has_table(spec)):
            ready(caller, bounded=False)  # its own lock waits are its own
            return self.dialect.unique_statements(spec)
        with self._lock:
            self.database.run(ready)
            found = self._ready[table] = self.dialect.unique_statements(spec)
        return found
