"""Celery beat's schedule in the service's database, safe with a scheduler on every worker.

``celery -A proj beat -S celery_ext.beat:DatabaseScheduler`` (or ``celery -A proj worker
-B --scheduler celery_ext.beat:DatabaseScheduler`` on each worker) reads its schedules from the
``<prefix>schedules`` table on the broker's database. Each due tick is claimed by a row
keyed by (schedule, due time) in ``<prefix>schedule_ticks``, written in the same
transaction as the task's queue row: schedulers racing for a tick cannot both send it, and
one killed mid-tick either sent it (both rows) or not (neither). Times are the database's.

:class:`Schedules` is the Python API the scheduler and the ``sqlinbox schedules`` commands
share.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from celery.beat import ScheduleEntry, Scheduler
from celery.schedules import BaseSchedule
from sqlalchemy import Connection, Row, inspect
from sqlalchemy.exc import DBAPIError

from kombu_sqlinbox.database import Database, open_database
from kombu_sqlinbox.dialects import ScheduleStatements
from kombu_sqlinbox.dialects.schedules import TICK_IDLE_LIMIT
from kombu_sqlinbox.errors import ConfigurationError
from kombu_sqlinbox.options import parse_options
from kombu_sqlinbox.urls import client_url, masked

from .binding import bind
from .schedule_times import (
    DEFAULT_GRACE,
    ScheduleError,
    check_misfire,
    check_name,
    decide,
    decode,
    encode,
    first_run,
)

__all__ = ["TICK_IDLE_LIMIT", "DatabaseScheduler", "Schedule", "Schedules", "Tick"]

logger = logging.getLogger(__name__)
#: how long sent ticks are kept (seconds): far longer than any race for one lasts
TICK_RETENTION = 86_400.0
#: how often a scheduler deletes ticks older than that (seconds)
PRUNE_EVERY = 300.0
#: how soon a scheduler looks again at a schedule still due after its tick (another
#: scheduler is sending it, or it cannot be read), rather than at once, in a spin
BUSY_WAIT = 1.0


@dataclass(frozen=True)
class Schedule:
    """A stored schedule: its definition, whether it runs, when it ran and runs next
    (epoch seconds by the database's clock)."""

    name: str
    task: str
    schedule: BaseSchedule
    kind: str
    spec: str
    args: list[Any]
    kwargs: dict[str, Any]
    options: dict[str, Any]
    misfire: str
    grace: float
    enabled: bool
    last_run_at: float | None
    next_run_at: float
    total_run_count: int


@dataclass(frozen=True)
class Tick:
    """A tick sent: the due time it claimed, when it was sent, its task's id."""

    due: float
    sent_at: float
    task_id: str | None


class Schedules:
    """The schedules on one database under one table prefix (the broker's, by default)."""

    def __init__(self, database: Database, prefix: str, app: Any = None,
                 connection: Connection | None = None) -> None:
        self.database = database
        self.dialect = database.dialect
        self.prefix = prefix
        self.app = app
        self.sql: ScheduleStatements = self.dialect.schedule_statements(prefix)
        #: where the work runs, in its owner's transaction (None: a transaction each)
        self.connection = connection
        self._ready = False

    @classmethod
    def for_app(cls, app: Any) -> Schedules:
        """The schedules of an app whose broker is the sqlinbox transport: its database,
        its transport options' table prefix and engine options."""
        broker_url = str(app.conf.broker_url or "")
        if not broker_url.startswith("sqlinbox+"):
            raise ConfigurationError(
                f"the database scheduler needs the sqlinbox transport as the broker (its "
                f"tick and its task commit together); the app's is {masked(broker_url)!r}")
        options = parse_options(app.conf.broker_transport_options)
        with app.connection_for_write() as connection:
            url = client_url(connection)
        return cls(open_database(url, options), options.table_prefix, app)

    def bound(self, connection: Connection) -> Schedules:
        """These schedules, worked on in ``connection``'s transaction, which its owner
        commits: Django's admin changes a schedule in the transaction that logs it."""
        found = Schedules(self.database, self.prefix, self.app, connection)
        found._ready = self._ready
        return found

    def close(self) -> None:
        self.database.dispose()

    # -- tables --------------------------------------------------------------------------
    def ensure(self) -> None:
        """Create the schedule tables unless they exist (two processes at once: one wins)."""
        if self._ready:
            return

        def create(conn: Connection) -> None:
            for statement in self.sql.ddl:
                conn.exec_driver_sql(statement)

        missing = self.database.run(lambda conn: [
            name for name in self.sql.names if not inspect(conn).has_table(name)],
            read_only=True)
        if missing:
            try:
                self.database.run(create)
            except DBAPIError:  # another process created them at the same moment
                self.database.run(create)
        self._ready = True

    def _run(self, work: Any, read_only: bool = False) -> Any:
        self.ensure()
        if self.connection is not None:
            return work(self.connection)
        return self.database.run(work, read_only=read_only)

    def now(self) -> float:
        """The database's time, epoch seconds."""
        return float(self._run(lambda conn: conn.execute(self.sql.now).scalar_one(),
                               read_only=True))

    # -- definitions ---------------------------------------------------------------------
    def add(self, name: str, task: str, schedule: BaseSchedule | timedelta | float,
            args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None,
            options: Mapping[str, Any] | None = None, misfire: str = "skip",
            grace: float = DEFAULT_GRACE, enabled: bool = True, replace: bool = False
            ) -> Schedule:
        """Store a schedule; a name already there is kept as it is, unless ``replace``:
        then its definition is replaced, its enabled flag and last run kept (its next run
        recomputed when its timing changed)."""
        check_name(name)
        try:
            check_misfire(misfire, grace)
            kind, spec = encode(schedule)
        except ScheduleError as exc:
            raise ScheduleError(f"schedule {name!r}: {exc}") from None
        try:
            stored = {"args": json.dumps(list(args)), "kwargs": json.dumps(dict(kwargs or {})),
                      "options": json.dumps(dict(options or {}))}
        except TypeError as exc:
            raise ScheduleError(f"schedule {name!r}: its arguments and options are stored as "
                                f"JSON: {exc}") from None
        values = {"name": name, "task": task, "kind": kind, "spec": spec, **stored,
                  "misfire": misfire, "grace": float(grace), "enabled": int(enabled)}
        timing = decode(kind, spec, self.app)

        def work(conn: Connection) -> None:
            now = float(conn.execute(self.sql.now).scalar_one())
            row = conn.execute(self.sql.read, {"name": name}).first()
            if row is None:
                conn.execute(self.sql.add, {**values, "next_run_at": first_run(timing, now)})
            elif replace:
                same = (row.kind, row.spec) == (kind, spec)
                conn.execute(self.sql.define, {
                    **values, "next_run_at": row.next_run_at if same else first_run(timing, now)})

        self._run(work)
        found = self.get(name)
        assert found is not None
        return found

    def load(self, beat_schedule: Mapping[str, Mapping[str, Any]]) -> None:
        """Celery's ``beat_schedule`` setting into the table: entries new to it added,
        changed ones redefined (enabled flag and last run kept); ``misfire`` and
        ``misfire_grace`` keys of an entry set its policy."""
        for name, entry in beat_schedule.items():
            self.add(name, entry["task"], entry["schedule"], entry.get("args") or (),
                     entry.get("kwargs"), entry.get("options"),
                     entry.get("misfire", "skip"), entry.get("misfire_grace", DEFAULT_GRACE),
                     replace=True)

    def get(self, name: str) -> Schedule | None:
        row = self._run(lambda conn: conn.execute(self.sql.read, {"name": name}).first(),
                        read_only=True)
        return None if row is None else self._schedule(row)

    def all(self) -> list[Schedule]:
        rows = self._run(lambda conn: conn.execute(self.sql.listed).all(), read_only=True)
        return [self._schedule(row) for row in rows]

    def _set(self, name: str, enabled: bool) -> bool:
        params = {"name": name, "enabled": int(enabled)}
        return bool(self._run(
            lambda conn: conn.execute(self.sql.set_enabled, params).rowcount))

    def pause(self, name: str) -> bool:
        """Stop sending ``name``'s ticks (False: no such schedule)."""
        return self._set(name, False)

    def resume(self, name: str) -> bool:
        """Send ``name``'s ticks again; the ones due while paused follow its misfire
        policy (False: no such schedule)."""
        return self._set(name, True)

    def remove(self, name: str) -> bool:
        """Delete a schedule and its ticks (False: no such schedule)."""
        def work(conn: Connection) -> int:
            conn.execute(self.sql.remove[1], {"name": name})
            return int(conn.execute(self.sql.remove[0], {"name": name}).rowcount)

        return bool(self._run(work))

    def ticks(self, name: str) -> list[Tick]:
        rows = self._run(lambda conn: conn.execute(self.sql.ticks, {"name": name}).all(),
                         read_only=True)
        return [Tick(float(row.due), float(row.sent_at), row.task_id) for row in rows]

    def _schedule(self, row: Row[Any]) -> Schedule:
        """A row as a schedule; one this process cannot read (a kind it does not know, a
        spec or JSON edited by hand, a solar schedule without ``ephem``) raises
        :class:`ScheduleError` naming it."""
        try:
            timing = decode(row.kind, row.spec, self.app)
            args, kwargs, options = (json.loads(value)
                                     for value in (row.args, row.kwargs, row.options))
        except Exception as exc:
            raise ScheduleError(f"schedule {row.name!r} cannot be read: {exc}") from exc
        return Schedule(
            name=row.name, task=row.task, schedule=timing, kind=row.kind, spec=row.spec,
            args=args, kwargs=kwargs, options=options,
            misfire=row.misfire, grace=float(row.grace), enabled=bool(row.enabled),
            last_run_at=None if row.last_run_at is None else float(row.last_run_at),
            next_run_at=float(row.next_run_at), total_run_count=int(row.total_run_count))

    # -- ticks ---------------------------------------------------------------------------
    def run_due(self) -> list[str]:
        """One tick: in one transaction, each enabled schedule due is claimed (its tick
        row), its task sent into the same transaction, and moved to its next run. Returns
        the names sent; a schedule another scheduler holds is left to it, a tick it
        claimed is not sent again, one that cannot be read is logged and left (the
        others are sent: one bad row must not stop every scheduler)."""
        def work(conn: Connection) -> list[str]:
            for statement in self.sql.guard:  # a scheduler frozen here lets go in time
                conn.exec_driver_sql(statement)
            sent = []
            for row in conn.execute(self.sql.due).all():
                try:
                    found = self._schedule(row)
                except ScheduleError as exc:
                    logger.error("Scheduler: %s; its ticks are not sent until it is fixed "
                                 "or removed", exc)
                    continue
                decision = decide(found.schedule, found.next_run_at, float(row.now),
                                  found.misfire, found.grace)
                sends = decision.send and self._send(conn, found)
                # a tick another scheduler claimed is its to count; moving the schedule
                # on is ours too (a no-op once the claimer has)
                self._advance(conn, found, decision.next_run_at, sends)
                if sends:
                    sent.append(found.name)
            for statement in self.sql.unguard:
                conn.exec_driver_sql(statement)
            return sent

        return list(self._run(work))

    def _send(self, conn: Connection, found: Schedule) -> bool:
        """Claim the tick and send its task in ``conn``'s transaction (False: taken, or
        the task could not be sent: logged, and the tick skipped rather than tried at
        every tick, the other schedules' sends kept)."""
        task_id = str(uuid.uuid4())
        claim = {"name": found.name, "due": found.next_run_at, "task_id": task_id}
        try:
            with conn.begin_nested():
                if not conn.execute(self.sql.claim, claim).rowcount:
                    return False
                with bind(conn):
                    self.app.send_task(found.task, found.args, found.kwargs,
                                       task_id=task_id, **found.options)
        except DBAPIError:
            raise  # the database's failure: the whole tick's
        except Exception:
            logger.exception("Scheduler: schedule %s: its task %s could not be sent; this "
                             "tick is skipped", found.name, found.task)
            return False
        return True

    def _advance(self, conn: Connection, found: Schedule, next_run_at: float,
                 sent: bool) -> None:
        conn.execute(self.sql.advance, {"name": found.name, "due": found.next_run_at,
                                        "next_run_at": next_run_at, "sent": int(sent)})

    def wait(self) -> float | None:
        """Seconds until a scheduler should tick again (None: no schedule is enabled):
        until the next enabled schedule falls due, or :data:`BUSY_WAIT` for one still due
        (held by another scheduler, or unreadable) unless another falls due before."""
        return self.sleep(*self.pending())

    def pending(self) -> tuple[float | None, float | None]:
        """Seconds until the first enabled schedule is due (negative: one is due; None:
        none is enabled), and until the first due after now (None: none)."""
        due, coming = self._run(lambda conn: conn.execute(self.sql.wait).one(),
                                read_only=True)
        return (None if due is None else float(due),
                None if coming is None else float(coming))

    @staticmethod
    def sleep(due: float | None, coming: float | None) -> float | None:
        """:meth:`wait` from :meth:`pending`'s figures."""
        if due is None or due > 0:
            return due
        return BUSY_WAIT if coming is None else min(coming, BUSY_WAIT)

    def prune(self, older_than: float = TICK_RETENTION) -> int:
        """Delete ticks due more than ``older_than`` seconds ago; returns how many."""
        return int(self._run(lambda conn: conn.execute(
            self.sql.prune, {"older_than": older_than}).rowcount))


class DatabaseScheduler(Scheduler):
    """Celery beat's scheduler on the schedule table (see the module doc)."""

    #: the longest sleep between ticks (seconds): a schedule added or resumed from
    #: another process is seen within it (``beat_max_loop_interval`` overrides)
    max_interval = 5

    def __init__(self, app: Any, *args: Any, **kwargs: Any) -> None:
        self.store: Schedules | None = None
        self._pruned_at = 0.0
        super().__init__(app, *args, **kwargs)

    def setup_schedule(self) -> None:
        """The tables made, the app's ``beat_schedule`` loaded into them."""
        self.store = Schedules.for_app(self.app)
        self.store.load(self.app.conf.beat_schedule or {})

    def tick(self, *args: Any, **kwargs: Any) -> float:
        """Send what is due; returns how long to sleep until the next due schedule. A
        database that fails is logged and tried again after the longest sleep: beat keeps
        running through a restart, and a tick whose commit went unanswered is never sent
        twice (its tick row is there, or neither it nor its task)."""
        assert self.store is not None
        try:
            for name in self.store.run_due():
                logger.info("Scheduler: sent due task %s", name)
            pending = self.store.pending()
            if pending[0] is not None and pending[0] <= 0:
                # one fell due after the tick read the time (PostgreSQL's is its
                # transaction's start), or another scheduler holds it: a second pass
                # sends the first now, rather than a busy wait later
                for name in self.store.run_due():
                    logger.info("Scheduler: sent due task %s", name)
                pending = self.store.pending()
            now = self.store.now()
            if now - self._pruned_at > PRUNE_EVERY:
                self.store.prune()
                self._pruned_at = now
            wait = self.store.sleep(*pending)
        except DBAPIError as exc:
            logger.error("Scheduler: the database failed (%s); trying again in %ss",
                         exc.orig, self.max_interval)
            return self.max_interval
        return self.max_interval if wait is None else min(wait, self.max_interval)

    @property
    def schedule(self) -> dict[str, ScheduleEntry]:
        """The stored schedules as Celery's entries (what ``beat`` shows at start)."""
        if self.store is None:
            return {}
        return {found.name: ScheduleEntry(
            name=found.name, task=found.task, schedule=found.schedule, args=found.args,
            kwargs=found.kwargs, options=found.options, app=self.app)
            for found in self.store.all()}

    def sync(self) -> None:
        """Nothing to write back: every tick committed its own state."""

    def close(self) -> None:
        if self.store is not None:
            self.store.close()

    @property
    def info(self) -> str:
        """What ``celery beat`` prints at start (before the scheduler set up its store)."""
        prefix = parse_options(self.app.conf.broker_transport_options).table_prefix
        return f"    . schedules -> table {prefix}schedules of the broker's database"
