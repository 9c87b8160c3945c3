"""``celery -A proj sqlinbox schedules list|add|pause|resume|remove``: the database
scheduler's schedules (:mod:`celery_ext.beat`), on the app's broker database and table
prefix, or on ``--url`` and ``--transport-options``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import click
from sqlalchemy.exc import InterfaceError, OperationalError

from kombu_sqlinbox.database import open_database
from kombu_sqlinbox.errors import ConfigurationError
from kombu_sqlinbox.options import parse_options

from .beat import Schedules
from .ops_render import render_schedules, schedule_record
from .outbox_cli import database_failed
from .schedule_times import DEFAULT_GRACE, MISFIRE, ScheduleError, parse


@contextmanager
def _schedules(ctx: click.Context) -> Iterator[Schedules]:
    """The schedules of ``--url`` (and ``--transport-options``), else of the app."""
    obj = ctx.obj
    url, raw = obj.url, obj.transport_options
    if raw is None and obj.app is not None:
        raw = obj.app.conf.broker_transport_options
    try:
        if url is not None:
            options = parse_options(raw)
            made = Schedules(open_database(url, options), options.table_prefix, obj.app)
        elif obj.app is not None:
            made = Schedules.for_app(obj.app)
        else:
            raise click.UsageError("no sqlinbox database: pass --url URL, or -A proj")
    except ConfigurationError as exc:
        raise click.UsageError(str(exc)) from None
    try:
        yield made
    except (ScheduleError, ConfigurationError) as exc:
        raise click.UsageError(str(exc)) from None
    except (OperationalError, InterfaceError) as exc:
        if obj.traceback:
            raise
        raise database_failed(url or made.database.engine.url.render_as_string(False),
                              exc) from None
    finally:
        made.close()


@click.group(name="schedules", help="The database scheduler's schedules (celery beat -S "
             "celery_ext.beat:DatabaseScheduler).")
def schedules() -> None:
    """Sub-commands find the app in ``ctx.obj.app``, as Celery's own commands do."""


@schedules.command(name="list", help="Every schedule: its timing, state, last and next run.")
@click.option("--json", "as_json", is_flag=True, help="print JSON")
@click.pass_context
def list_schedules(ctx: click.Context, as_json: bool) -> None:
    with _schedules(ctx) as store:
        found, now = store.all(), store.now()
    if as_json:
        click.echo(json.dumps([schedule_record(each) for each in found], indent=2))
    else:
        click.echo(render_schedules(found, now))


def _json(kind: type, value: str | None, name: str) -> Any:
    try:
        loaded = kind() if value is None else json.loads(value)
    except ValueError as exc:
        raise click.BadParameter(f"not JSON: {exc}", param_hint=name) from None
    if not isinstance(loaded, kind):
        raise click.BadParameter(f"a JSON {kind.__name__} is needed", param_hint=name)
    return loaded


@schedules.command(help="Add a schedule. SCHEDULE: every:SECONDS, crontab:'M H DOW DOM MOY' "
                   "or solar:EVENT:LAT:LON.")
@click.argument("name")
@click.argument("task")
@click.argument("schedule")
@click.option("--args", "args_json", default=None, help="positional arguments, a JSON list")
@click.option("--kwargs", "kwargs_json", default=None, help="keyword arguments, a JSON object")
@click.option("--queue", default=None, help="the queue to send to (default: the task's route)")
@click.option("--misfire", type=click.Choice(MISFIRE), default="skip",
              help="missed ticks: skip them, or run one catch-up")
@click.option("--grace", type=click.FloatRange(min=0), default=DEFAULT_GRACE,
              help="seconds an occurrence may run late under skip")
@click.option("--paused", is_flag=True, help="add it paused")
@click.option("--replace", is_flag=True, help="replace a schedule of that name")
@click.pass_context
def add(ctx: click.Context, name: str, task: str, schedule: str, args_json: str | None,
        kwargs_json: str | None, queue: str | None, misfire: str, grace: float, paused: bool,
        replace: bool) -> None:
    args = _json(list, args_json, "--args")
    kwargs = _json(dict, kwargs_json, "--kwargs")
    with _schedules(ctx) as store:
        if store.get(name) is not None and not replace:
            raise click.UsageError(f"a schedule {name!r} exists: pass --replace")
        added = store.add(name, task, parse(schedule, store.app), args, kwargs,
                          {} if queue is None else {"queue": queue}, misfire, grace,
                          enabled=not paused, replace=replace)
        now = store.now()
    click.echo(render_schedules([added], now))


def _switch(ctx: click.Context, name: str, verb: str) -> None:
    with _schedules(ctx) as store:
        done = getattr(store, verb)(name)
    if not done:
        raise click.ClickException(f"no schedule {name!r}")
    click.echo(f"{name}: {verb}d" if verb.endswith("e") else f"{name}: {verb}ed")


@schedules.command(help="Stop sending a schedule's ticks (kept across restarts).")
@click.argument("name")
@click.pass_context
def pause(ctx: click.Context, name: str) -> None:
    _switch(ctx, name, "pause")


@schedules.command(help="Send a paused schedule's ticks again (missed ones follow its "
                   "misfire policy).")
@click.argument("name")
@click.pass_context
def resume(ctx: click.Context, name: str) -> None:
    _switch(ctx, name, "resume")


@schedules.command(help="Delete a schedule and its ticks.")
@click.argument("name")
@click.pass_context
def remove(ctx: click.Context, name: str) -> None:
    _switch(ctx, name, "remove")
