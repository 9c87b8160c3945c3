"""``celery sqlinbox failures``: the recent failures in the result table, one by one and
per task; and the short per-task section ``queues`` prints under its table.

The result table is the app's sqlinbox result backend's (its prefix, its serializer), or,
without the app (``sqlinbox --url ...``), the one under the transport's table prefix in
that database, its results read as JSON (Celery's default). A result that does not
decode is shown as undecodable, never a failure of the command.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import click
from celery.bin.base import CeleryCommand, CeleryOption
from celery.utils.serialization import UnpickleableExceptionWrapper
from kombu.serialization import loads
from sqlalchemy.exc import InterfaceError, OperationalError

from kombu_sqlinbox.database import same_database
from kombu_sqlinbox.history import Failure, History, ResultsMissing, TaskFailures
from kombu_sqlinbox.operations import Operations
from kombu_sqlinbox.urls import masked

from .ops_context import operations
from .ops_render import text_table
from .outbox_cli import database_failed
from .results import SqlInboxBackend, backend_options

__all__ = ["failures", "failures_section"]

#: the window and the tasks ``queues`` shows
SECTION_WINDOW, SECTION_TASKS = 3600.0, 5
UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
#: the longest exception a table shows (``--json`` shows them whole)
SHOWN = 120
#: the most ``--limit`` takes: a LIMIT every database binds (a larger number is refused
#: by click, not by the driver with a traceback)
MOST_LISTED = 2**31 - 1
NO_NAMES = ("task names are not stored: result_extended is off (every failure is "
            "counted under -)")


class Duration(click.ParamType[float]):
    """Seconds, or a number with a unit: ``90s``, ``30m``, ``1h``, ``2d``."""

    name = "duration"

    def convert(self, value: Any, param: Any, ctx: Any) -> float:
        if isinstance(value, int | float):
            return float(value)
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", str(value))
        if match is None:
            self.fail(f"{value!r} is not a duration (90s, 30m, 1h, 2d)", param, ctx)
        seconds = float(match[1]) * UNITS[match[2] or "s"]
        if not math.isfinite(seconds):  # too many digits for a float: inf, not JSON
            self.fail(f"{value!r} is longer than any window", param, ctx)
        return seconds


@dataclass(frozen=True)
class Source:
    """Where the failures are read, how their results decode, and whether task names
    are stored (None: no app to say)."""

    history: History
    url: str
    decode: Callable[[bytes], Any]
    extended: bool | None


def json_decode(meta: bytes) -> Any:
    return loads(meta, "application/json", "utf-8", accept={"application/json"})


def source(app: Any, ops: Operations, results_only: bool) -> Source | None:
    """The app's sqlinbox result backend's table (in its own database when not the
    broker's, unless ``results_only``: then None), or the transport's prefix in the
    ``--url`` database without an app; None for an app whose backend is another."""
    database, url = ops.broker.database, str(ops.broker.engine.url)
    if app is None:
        if results_only:
            return None
        sql = ops.dialect.result_statements(ops.broker.options.table_prefix)
        return Source(History(database, sql), url, json_decode, None)
    if not str(app.conf.result_backend or "").startswith("sqlinbox+"):
        return None
    backend = app.backend
    assert isinstance(backend, SqlInboxBackend)
    if not same_database(database.engine, backend.store.database.engine):
        if results_only:
            return None
        database, url = backend.store.database, str(backend.url)
    sql = database.dialect.result_statements(backend_options(app)["table_prefix"])
    return Source(History(database, sql), url, backend.decode,
                  bool(app.conf.result_extended))


@contextmanager
def reading(found: Source, show_traceback: bool) -> Iterator[None]:
    """The result database failing is one line naming it (``--traceback``: the whole)."""
    try:
        yield
    except (OperationalError, InterfaceError) as exc:
        if show_traceback:
            raise
        raise database_failed(found.url, exc) from None


def exception_text(failure: Failure, decode: Callable[[bytes], Any]) -> str:
    """A failure's exception on one line (``Type: message``), or why it is not shown."""
    try:
        meta = decode(failure.meta)
        raised = meta["result"]
    except Exception as exc:  # a row this app's serializer does not read
        return f"undecodable: {type(exc).__name__}: {exc}".replace("\n", " ")
    if isinstance(raised, UnpickleableExceptionWrapper):  # its class did not pickle
        kind, args = raised.exc_cls_name, tuple(raised.exc_args)
    elif isinstance(raised, BaseException):
        kind, args = type(raised).__name__, raised.args
    elif isinstance(raised, dict) and "exc_type" in raised:
        kind, args = str(raised["exc_type"]), raised.get("exc_message") or ()
        args = args if isinstance(args, list | tuple) else (args,)
    else:
        return f"not an exception: {raised!r}"[:200]
    message = ", ".join(str(arg) for arg in args)
    return " ".join((f"{kind}: {message}" if message else kind).split())


def duration_text(seconds: float) -> str:
    """A window as ``--since`` takes it, in its largest whole unit (``3600`` -> ``1h``)."""
    unit = next(name for name in "dhms" if name == "s" or seconds % UNITS[name] == 0)
    return f"{seconds / UNITS[unit]:g}{unit}"


def shown(text: str) -> str:
    """An exception as a table shows it: :data:`SHOWN` characters at most."""
    return text if len(text) <= SHOWN else text[:SHOWN - 1] + "…"


def when(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def failure_record(failure: Failure, decode: Callable[[bytes], Any]) -> dict[str, Any]:
    return {"task_id": failure.task_id, "task": failure.task_name, "worker": failure.worker,
            "date_done": failure.date_done, "exception": exception_text(failure, decode)}


def summary_table(found: Sequence[TaskFailures], decode: Callable[[bytes], Any]) -> str:
    return text_table(
        ("task", "failures", "last failure (UTC)", "last exception"),
        [(each.task_name or "-", each.count, when(each.last_done),
          "-" if each.last is None else shown(exception_text(each.last, decode)))
         for each in found], align="<><<")


def unnamed(found: Source, names: Sequence[str | None]) -> bool:
    """Whether to say task names are not stored: the app says so, or rows lack them."""
    return found.extended is False or (found.extended is None and None in names)


@click.command(cls=CeleryCommand)
@click.option("--task", "-T", default=None, cls=CeleryOption, help_group="Filters",
              help="only failures of this task (needs result_extended)")
@click.option("--since", type=Duration(), default="1h", cls=CeleryOption,
              help_group="Filters", help="the window: 90s, 30m, 1h (the default), 2d")
@click.option("--limit", type=click.IntRange(min=1, max=MOST_LISTED),
              default=20, cls=CeleryOption,
              help_group="Output", help="at most this many failures listed (default 20)")
@click.option("--json", "as_json", is_flag=True, cls=CeleryOption, help_group="Output",
              help="print JSON")
@click.pass_context
def failures(ctx: click.Context, task: str | None, since: float, limit: int,
             as_json: bool) -> None:
    """The recent failures in the result table, the latest first (task id, task, when,
    exception, worker), then per task: failures in the window, the last one's time and
    exception."""
    app = ctx.obj.app
    with operations(ctx) as ops:
        found = source(app, ops, results_only=False)
        if found is None:
            raise click.UsageError(
                "the app's result backend is not sqlinbox "
                f"({masked(str(app.conf.result_backend))!r}): "
                "its failures are not in this database")
        with reading(found, ctx.obj.traceback):
            try:
                listed = found.history.failures(since, limit, task)
                per_task = found.history.summary(since, 1000, task)
            except ResultsMissing as exc:
                raise click.ClickException(str(exc)) from None
    names = [each.task_name for each in per_task]
    if as_json:
        click.echo(json.dumps({
            "since_seconds": since, "task_names_stored": not unnamed(found, names),
            "failures": [failure_record(each, found.decode) for each in listed],
            "tasks": [{"task": each.task_name, "failures": each.count,
                       "last_failure": each.last_done,
                       "last_exception": None if each.last is None
                       else exception_text(each.last, found.decode)} for each in per_task],
        }, indent=2))
        return
    if unnamed(found, names):
        click.echo(NO_NAMES)
    click.echo(text_table(
        ("task id", "task", "failed at (UTC)", "exception", "worker"),
        [(each.task_id, each.task_name or "-", when(each.date_done),
          shown(exception_text(each, found.decode)), each.worker or "-") for each in listed],
        align="<<<<<"))
    click.echo(f"\nper task, last {duration_text(since)}:")
    click.echo(summary_table(per_task, found.decode))


def failures_section(ctx: click.Context, ops: Operations) -> str | None:
    """``queues``' section under its table: the last hour's failures per task, where the
    app's result backend is sqlinbox in the broker's database (None elsewhere); a result
    table that is not there is one line."""
    found = source(ctx.obj.app, ops, results_only=True)
    if found is None:
        return None
    head = (f"recent failures (last {duration_text(SECTION_WINDOW)}, "
            f"{found.history.sql.names[0]})")
    with reading(found, ctx.obj.traceback):
        try:
            per_task = found.history.summary(SECTION_WINDOW, SECTION_TASKS)
        except ResultsMissing as exc:
            return f"{head}: {exc}"
    if not per_task:
        return f"{head}: none"
    note = f"\n{NO_NAMES}" if unnamed(found, [each.task_name for each in per_task]) else ""
    return f"{head}:{note}\n{summary_table(per_task, found.decode)}"
