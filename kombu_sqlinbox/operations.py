"""Operations on a live inbox: queue figures, dead letters, the schema check: what ``celery
sqlinbox`` runs, usable without a command line. Queues resolve to tables as the transport
resolves them (a :class:`~.broker.Broker` of its own), every statement comes from the
dialect, and each move of a dead letter is one transaction: a row is never in both tables,
nor in neither. Beside the transport, at the top of the layers."""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from sqlalchemy import Connection, TextClause, inspect
from sqlalchemy.exc import DBAPIError, ProgrammingError

from .broker import Broker, QueueTable
from .codec import EXPIRES_KEY, Undecodable, decode_row
from .dead_letters import EVERY, DeadFilter, DeadLetter, read_death, restored, row_task, typed
from .dialects.base import json_text, plain_payload
from .errors import ConfigurationError, SchemaMismatch
from .options import TransportOptions
from .pause_operations import Paused, QueuePausing
from .rows import ClaimedRow
from .tables import TableSpec, default_table, table_name_for_queue

__all__ = ["DeadFilter", "DeadLetter", "Operations", "Paused", "Problem", "QueueFigures"]

#: the columns that make a table under the prefix a queue table of the default layout
#: (other tables sharing the prefix are left alone)
DEFAULT_COLUMNS = frozenset(column.name for column in default_table("probe").columns)
#: values the schema check binds to every statement it plans
PLAN_PARAMS: Mapping[str, Any] = {
    "limit": 1, "lease": 30.0, "delay": 0.0, "ids": [0], "skip": ["-"], "attempt": 0, "id": 0,
    "payload": b"", "headers": "{}", "priority": 0, "eta": None, "group": None,
    "partition_key": None, "after": 0, "upto": 0, "floor": 0.0, "candidates": 2, "window": 1,
    "channel": "sqlinbox_check",
}
#: what the schema check binds to the routing tables' statements
ROUTING_PLAN_PARAMS: Mapping[str, Any] = {
    "name": "-", "ids": ["-"], "exchange": "-", "queue": "-", "routing_key": "-",
    "type": "direct", "pattern": "-", "transient": 0, "expires": None, "message_ttl": None,
    "payload": b"", "headers": "{}", "ttl": None, "priority": 0, "limit": 1, "channel_prefix": "-",
}
#: how the schema check names the routing tables' problems (they serve every queue)
ROUTING = "(routing)"


@dataclass(frozen=True)
class QueueFigures:
    """One queue's figures (see :meth:`~.dialects.Dialect.queue_stats`). Ages are in
    seconds; ``oldest_lease_age`` is the time since the oldest live lease was taken or
    last extended (a live worker extends every third of ``visibility_timeout``)."""

    queue: str
    table: str
    exists: bool
    ready: int = 0
    delayed: int = 0
    in_work: int = 0
    blocked: int = 0
    blocked_groups: int = 0
    lapsed: int = 0
    oldest_ready_age: float | None = None
    oldest_lease_age: float | None = None
    dead_letter_queue: str | None = None
    dead_letters: int | None = None
    paused: Paused | None = None
    #: the planner's estimate of the unfinished rows (``total``) where none were counted
    about: int | None = None

    @property
    def total(self) -> int:
        counted = self.ready + self.delayed + self.in_work + self.blocked
        return counted if self.about is None else self.about

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Problem:
    """Something in the live schema the transport's statements cannot run on."""

    queue: str
    table: str
    what: str


Progress = Callable[[int], None]
#: told of each chosen dead letter a requeue leaves where it is, and why
Refused = Callable[[DeadLetter, str], None]


class Operations(QueuePausing):
    """Operations on one database. ``queues`` are the queue names known from the app
    (its task queues); those of the transport options and their dead-letter queues
    are added, and so are tables of the default layout found under the table prefix."""

    def __init__(self, url: str, options: TransportOptions, queues: Iterable[str] = (),
                 batch: int = 500) -> None:
        self.options = options
        self.broker = Broker(url.removeprefix("sqlinbox+"), options)
        self.dialect = self.broker.dialect
        self.batch = batch
        names = dict.fromkeys([*queues, *options.queues])
        for name in list(names):
            dead = options.for_queue(name).dead_letter_queue
            while dead is not None and dead not in names:
                names[dead] = None
                dead = options.for_queue(dead).dead_letter_queue
        self.names = list(names)

    def close(self) -> None:
        self.broker.close()

    # -- queues --------------------------------------------------------------------
    def queues(self) -> list[tuple[str, TableSpec]]:
        """Every queue: the known names, then tables of the default layout under the
        table prefix that none of them maps to (named by their queue where the table
        name gives it back, else by the table)."""
        found = [(name, self.broker.spec_for(name)) for name in self.names]
        known = {spec.table for _, spec in found}
        prefix = self.options.table_prefix

        def look(conn: Connection) -> list[str]:
            inspector = inspect(conn)
            return [table for table in sorted(inspector.get_table_names())
                    if table.startswith(prefix) and table not in known
                    and {c["name"] for c in inspector.get_columns(table)} >= DEFAULT_COLUMNS]

        for table in self.broker.run(look, read_only=True):
            name = table[len(prefix):]
            if table_name_for_queue(name, prefix) != table:
                name = table
            found.append((name, default_table(table)))
        return found

    def figures(self, only: Sequence[str] = (),
                read: Callable[[Connection, str, TableSpec, bool], QueueFigures] | None = None,
                ) -> list[QueueFigures]:
        """The figures of every queue (:meth:`queues`; ``only``: of those and their
        dead-letter queues), read in one transaction, each by ``read`` (default: exact)."""
        wanted = {*only, *(self.options.for_queue(name).dead_letter_queue for name in only)}
        queues = [found for found in self.queues() if not only or found[0] in wanted]

        def look(conn: Connection) -> list[QueueFigures]:
            existing = set(inspect(conn).get_table_names())
            # by table: a queue listed by its table's name shows its own name's pause
            paused = {self.broker.spec_for(found.queue).table: found
                      for found in self.broker.pauses.records(conn)}
            by_name = {name: (read or self.exact_figures)(conn, name, spec, spec.table in existing)
                       for name, spec in queues}
            result = []
            for name, spec in queues:
                figures = dataclasses.replace(by_name[name], paused=paused.get(spec.table))
                dead = self.options.for_queue(name).dead_letter_queue
                if dead in by_name:
                    figures = dataclasses.replace(
                        figures, dead_letter_queue=dead, dead_letters=by_name[dead].total)
                result.append(figures)
            return result

        try:
            return self.broker.run(look, read_only=True, repeatable=True)
        except ProgrammingError:  # a queue table dropped once listed: listed again, missing
            return self.broker.run(look, read_only=True, repeatable=True)

    def exact_figures(self, conn: Connection, name: str, spec: TableSpec,
                      exists: bool) -> QueueFigures:
        """A queue's figures as :meth:`~.dialects.Dialect.queue_stats` counts them."""
        if not exists:
            return QueueFigures(name, spec.table, False)
        row = conn.execute(self.dialect.queue_stats(spec)).one()._mapping
        lease, lease_left = self.options.for_queue(name).visibility_timeout, row["lease_left"]
        return QueueFigures(
            name, spec.table, True, int(row["ready"]), int(row["delayed"]),
            int(row["in_work"]), int(row["blocked"]), int(row["blocked_groups"]),
            int(row["lapsed"]), _seconds(row["oldest_ready_age"]),
            None if lease_left is None else max(0.0, lease - float(lease_left)))

    # -- dead letters ----------------------------------------------------------------
    def configured_dead_letter_queues(self) -> list[str]:
        """Every dead-letter queue the options configure (for the known queues)."""
        names = [self.options.for_queue(name).dead_letter_queue for name in self.names]
        return list(dict.fromkeys(
            name for name in (*names, self.options.defaults.dead_letter_queue)
            if name is not None))

    def dead_letter_queues(self, only: Sequence[str] = ()) -> list[QueueTable]:
        """The dead-letter queues named (default: every one the options configure) whose
        tables exist. A name that is not a configured dead-letter queue is refused: the
        commands would act on live messages."""
        configured = self.configured_dead_letter_queues()
        for name in only:
            if name not in configured:
                raise ConfigurationError(
                    f"{name!r} is not a dead-letter queue (these are: "
                    f"{', '.join(configured) or 'none configured'})")
        names = list(only) or configured
        return [self.broker.table(name) for name in names if self.broker.known_table(name)]

    def dead_letters(self, chosen: DeadFilter = EVERY, only: Sequence[str] = (),
                     limit: int | None = None, after: int = 0) -> Iterator[DeadLetter]:
        """The rows of dead-letter queues that ``chosen`` takes, by dead-letter queue,
        oldest first (their ids after ``after``: a keyset page)."""
        now, given = time.time(), 0
        for table in self.dead_letter_queues(only):
            for dead in (found for page in self._pages(table, after) for found in page):
                if chosen(dead, now):
                    yield dead
                    given += 1
                    if limit is not None and given >= limit:
                        return

    def dead_letter(self, row_id: int, only: Sequence[str] = ()) -> list[DeadLetter]:
        """The dead letter of that id in each dead-letter queue holding one."""
        found = []
        for table in self.dead_letter_queues(only):
            statement = self.dialect.stored_one(table.spec)
            rows = self.broker.run(partial(_rows, statement, {"id": row_id}), read_only=True)
            found += [self._read(table, row) for row in rows]
        return found

    def _pages(self, table: QueueTable, after: int = 0) -> Iterator[list[DeadLetter]]:
        """The table's stored messages not in work after id ``after``, a page at a time."""
        statement = self.dialect.stored_page(table.spec)
        upto = self._last_id(table)
        while True:
            rows = self.broker.run(partial(_rows, statement, {
                "after": after, "upto": upto, "limit": self.batch}), read_only=True)
            if not rows:
                return
            after = rows[-1].id
            yield [self._read(table, row) for row in rows]

    def _last_id(self, table: QueueTable) -> int:
        statement = self.dialect.last_id(table.spec)
        found = self.broker.run(lambda conn: conn.execute(statement).scalar(), read_only=True)
        return int(found or 0)

    def _read(self, table: QueueTable, row: Any) -> DeadLetter:
        """A stored row as a dead letter, whichever driver read it (psycopg2's BYTEA is a
        memoryview, psycopg's JSON parsed)."""
        stored = ClaimedRow(id=int(row.id), attempt=int(row.attempt),
                            payload=plain_payload(row.payload), headers=json_text(row.headers),
                            group=None, partition_key=None)
        try:
            message = decode_row(stored, table, 0)
            message.pop(EXPIRES_KEY, None)
        except Undecodable as exc:
            return DeadLetter(table.queue, stored.id, None, None, None, None, None, None,
                              None, str(exc))
        headers = message["headers"]
        death, queue, reason, attempts, at = read_death(headers)
        task, task_id = typed(headers, "task", str), typed(headers, "id", str)
        if isinstance(death.get("columns"), dict) and isinstance(queue, str):
            task, task_id = row_task(self.broker.spec_for(queue), queue, death, message)
        return DeadLetter(table.queue, stored.id, queue, reason, attempts, at, task, task_id,
                          message)

    def requeue(self, chosen: DeadFilter = EVERY, only: Sequence[str] = (),
                keep_attempts: bool = False, progress: Progress | None = None,
                refused: Refused | None = None) -> int:
        """Move the chosen dead letters back to the queues they died in, a batch per
        transaction, in their order, each written as its queue writes rows (through its
        declared publish statement; a parked row of a queue in row mode as the row it was),
        with the death record it had before it died (if it died in a dead-letter queue);
        attempts start again from 0 unless ``keep_attempts`` (refused for a queue whose
        declared statement writes its rows). Rows without a death record, or one naming no
        queue, stay; so does one that cannot be written back (its table does not take it,
        its parked row does not read back: ``refused`` is told why). How many moved."""
        if keep_attempts:
            for dead in self.dead_letters(chosen, only):
                if (dead.left(requeue=True) is None and not dead.parked
                        and self.broker.spec_for(str(dead.queue)).publish is not None):
                    raise ConfigurationError(
                        f"queue {dead.queue!r} has a declared publish statement: a requeue "
                        "runs it as a publish does, and its deliveries start from 0 (leave "
                        "out --keep-attempts)")
        return self._move(chosen, only, progress, requeue=True, keep_attempts=keep_attempts,
                          refused=refused)

    def purge(self, chosen: DeadFilter = EVERY, only: Sequence[str] = (),
              progress: Progress | None = None) -> int:
        """Delete the chosen dead letters (rows without a death record stay), a batch per
        transaction; how many went."""
        return self._move(chosen, only, progress, requeue=False)

    def _move(self, chosen: DeadFilter, only: Sequence[str], progress: Progress | None,
              requeue: bool, keep_attempts: bool = False,
              refused: Refused | None = None) -> int:
        """Each page is read first (the origin tables are resolved then, outside the
        move's transaction), then the rows chosen on it locked again by id and moved in
        one transaction: a row another run moved or purged meanwhile is simply not found,
        and a row that committed meanwhile between two of the page's ids waits for the
        next run."""
        moved = 0
        now = time.time()
        for table in self.dead_letter_queues(only):
            locked = self.dialect.stored_locked(table.spec)
            for page in self._pages(table, max(0, (chosen.row_id or 0) - 1)):
                wanted = {dead.id for dead in page
                          if dead.left(requeue) is None and chosen(dead, now)}
                targets: dict[str, QueueTable] = {}
                for dead in page:
                    if requeue and dead.id in wanted and (
                            why := self._unwritable(dead, targets)) is not None:
                        wanted.discard(dead.id)
                        if refused is not None:
                            refused(dead, why)
                if not wanted:
                    continue
                done = self.broker.run(partial(
                    self._move_page, table, locked, wanted, targets if requeue else None,
                    keep_attempts))
                moved += done
                if progress is not None:
                    progress(done)
        return moved

    def _unwritable(self, dead: DeadLetter, targets: dict[str, QueueTable]) -> str | None:
        """Why ``dead`` cannot be written back into its queue (None: it can; its queue's
        table is then in ``targets``), found before the move's transaction so that one
        such letter does not stop the others."""
        queue = str(dead.queue)
        try:
            target = targets.get(queue) or self.broker.table(queue)
            restored(self.dialect, dead, target)
        except (ConfigurationError, Undecodable) as exc:
            return str(exc)
        targets[queue] = target
        return None

    def _move_page(self, table: QueueTable, locked: TextClause, wanted: set[int],
                   targets: Mapping[str, QueueTable] | None, keep_attempts: bool,
                   conn: Connection) -> int:
        """One transaction of a move: the wanted rows locked again, those still there
        deleted and (``targets`` given) inserted into their queues."""
        taken = [self._read(table, row)
                 for row in conn.execute(locked, {"ids": sorted(wanted)})]
        if not taken:
            return 0
        conn.execute(self.dialect.remove(table.spec), {"ids": [dead.id for dead in taken]})
        if targets is not None:
            self._restore(conn, taken, targets, keep_attempts)
        return len(taken)

    def _restore(self, conn: Connection, taken: list[DeadLetter],
                 targets: Mapping[str, QueueTable], keep_attempts: bool) -> None:
        """Insert the dead letters into their queues, in order, with the death record
        they had before (if any); a PostgreSQL queue's idle consumers are woken at the
        commit. Consecutive rows of one statement go in one execution."""
        runs: list[tuple[TextClause, list[dict[str, Any]]]] = []
        for dead in taken:
            target = targets[str(dead.queue)]
            statement, params = restored(self.dialect, dead, target)
            params["attempt"] = int(dead.attempts or 0) if keep_attempts else 0
            if runs and runs[-1][0].text == statement.text:
                runs[-1][1].append(params)
            else:
                runs.append((statement, [params]))
        for statement, rows in runs:
            conn.execute(statement, rows)
        for spec in {targets[str(dead.queue)].spec for dead in taken}:
            self.dialect.wake(conn, spec)

    # -- the schema check --------------------------------------------------------------
    def check(self) -> tuple[int, list[Problem]]:
        """Plan every statement the transport and these operations run against each
        queue on the live schema, without running any; also check each table's columns
        and that the claim walks its index (where it does not, the table's statements are
        not planned: MySQL's name that index). A missing table is a problem only where the
        transport does not create tables (``create_tables=False``). Returns how many
        statements were planned, and the problems. The routing tables (remote control,
        fanout, transient queues) are checked likewise (:meth:`routing_check`)."""
        planned, problems = self.routing_check()
        for name, spec in self.queues():
            if self.options.create_tables and not self.broker.database.has_table(spec):
                continue  # the transport creates it on first use, as the DDL says

            def problem(what: str, name: str = name, spec: TableSpec = spec) -> None:
                problems.append(Problem(name, spec.table, what))

            try:
                self.broker.run(partial(self.dialect.ensure_table, spec=spec, create=False),
                                read_only=True)
            except SchemaMismatch as exc:
                problem(str(exc))
                continue
            if spec.publish is None:  # a declared publish statement may give the id itself
                unmade = self.broker.run(partial(self.dialect.id_problem, spec=spec),
                                         read_only=True)
                if unmade is not None:
                    problem(unmade)
            plan = self.broker.run(partial(self.dialect.claim_plan_problem, spec=spec),
                                   read_only=True)
            if plan is not None:
                # without its claim index, a statement naming it (MySQL's index hints on
                # the transport's own tables) cannot be planned
                problem(plan)
                continue
            # a publish's values too: a declared statement binds :task_name, row columns...
            params = {**PLAN_PARAMS, **self.dialect.publish_params(spec, b"", "{}")}
            for _, statement in self.statements(spec):
                explained = self.dialect.explained(statement)
                # the columns and their types passed: a statement that still does not
                # plan is a bug of the dialect, raised with its SQL
                self.broker.run(partial(_rows, explained, params), attempts=1,
                                read_only=True)
                planned += 1
        return planned, problems

    def routing_check(self) -> tuple[int, list[Problem]]:
        """Plan the statements on the routing tables (:meth:`tables_check`); then what the
        dialect finds wrong in them (names compared otherwise than the statements
        expect)."""
        sql = self.dialect.routing_statements(self.options.table_prefix)
        return self.tables_check(
            ROUTING, "routing", sql, ROUTING_PLAN_PARAMS, self.options.create_tables,
            "a worker cannot declare its remote-control queue, nor any process a transient "
            "queue or a fanout binding", partial(self.dialect.routing_problems, names=sql.names))

    def tables_check(self, label: str, kind: str, sql: Any, params: Mapping[str, Any],
                     create: bool, without: str,
                     more: Callable[[Connection], list[tuple[str, str]]] | None = None,
                     ) -> tuple[int, list[Problem]]:
        """Plan every statement of ``sql`` (statements of tables ``sql.names``), as
        :meth:`check` does a queue's; missing tables are a problem only where they are
        not created on first use (``create`` false; ``without``: what fails then). A table
        whose statements do not plan is named once, with the first error; ``more``
        finds other problems in tables that are there."""
        missing = self.broker.run(
            lambda conn: [name for name in sql.names if not inspect(conn).has_table(name)],
            read_only=True)
        if missing:
            if create:
                return 0, []  # created on first use, as printed
            return 0, [Problem(label, missing[0], (
                f"the {kind} tables {', '.join(missing)} do not exist (create_tables is off): "
                f"{without}; create them with:\n" + ";\n".join(sql.ddl) + ";"))]
        planned, failed = 0, dict[str, str]()
        for field in dataclasses.fields(sql):
            value = getattr(sql, field.name)
            parts = value if isinstance(value, tuple) else (value,)
            for statement in (part for part in parts if isinstance(part, TextClause)):
                table = min(sql.names, key=lambda name: _position(statement.text, name))
                try:
                    self.broker.run(partial(_rows, self.dialect.explained(statement), params),
                                    attempts=1, read_only=True)
                    planned += 1
                except DBAPIError as exc:
                    failed.setdefault(table, f"{field.name}: {exc.orig}")
        problems = [Problem(label, table, (
            f"the statement {what} (the ddl command prints what makes the {kind} tables)"))
            for table, what in failed.items()]
        found = [] if more is None else self.broker.run(more, read_only=True)
        return planned, problems + [Problem(label, table, what) for table, what in found]

    def statements(self, spec: TableSpec) -> list[tuple[str, TextClause]]:
        """Every statement run on a queue table, by name: the transport's, these
        operations' and the dashboard's (DDL aside)."""
        found: list[tuple[str, TextClause]] = []
        statements = self.dialect.statements(spec)
        for field in dataclasses.fields(statements):
            value = getattr(statements, field.name)
            if field.name == "drop" or value is None:
                continue
            parts = value if isinstance(value, tuple) else (value,)
            found += [(f"{field.name}[{n}]" if len(parts) > 1 else field.name, part)
                      for n, part in enumerate(parts)]
        found += [
            ("queue_stats", self.dialect.queue_stats(spec)),
            ("bounded_count", self.dialect.bounded_count(spec)),
            ("stored_page", self.dialect.stored_page(spec)),
            ("stored_locked", self.dialect.stored_locked(spec)),
            ("stored_one", self.dialect.stored_one(spec)),
            ("remove", self.dialect.remove(spec)),
            ("ready_page", self.dialect.ready_page(spec)),
        ]
        more = [("blocked_groups", self.dialect.blocked_groups(spec)),  # None: not FIFO
                ("restore", self.dialect.restore(spec))]  # None: a declared publish statement
        return found + [(name, sql) for name, sql in more if sql is not None]


def _rows(statement: TextClause, params: Mapping[str, Any], conn: Connection) -> list[Any]:
    return list(conn.execute(statement, dict(params)).all())


def _position(sql: str, name: str) -> int:
    """Where the table ``name`` is first named in ``sql`` (after the end: nowhere)."""
    found = re.search(rf"\b{re.escape(name)}\b", sql)
    return len(sql) if found is None else found.start()


def _seconds(value: Any) -> float | None:
    return None if value is None else max(0.0, float(value))
