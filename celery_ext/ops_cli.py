"""``celery sqlinbox``: queue health, dead letters, recent failures, DDL, the schema
check, the outbox.

As a Celery sub-command (``celery -A proj sqlinbox queues``), registered under the
``celery.commands`` entry point, or standalone where the app is not installed::

    sqlinbox --url postgresql://app@db/app queues --format prometheus
    sqlinbox --url sqlite:///jobs.db --transport-options '{"queues": {...}}' dead list

With the app, the broker URL, the transport options and the queue names are the
app's; ``--url`` and ``--transport-options`` stand in for them.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime, timezone
from functools import partial
from types import SimpleNamespace
from typing import Any

import click
from celery.app.utils import find_app
from celery.bin.base import CeleryCommand, CeleryOption

from kombu_sqlinbox.codec import DEATH_HEADER, DELIVERY_PROPERTIES
from kombu_sqlinbox.dead_letters import EVERY
from kombu_sqlinbox.dialects.limits import PLAN_PARAMS as LIMIT_PLAN_PARAMS
from kombu_sqlinbox.dialects.pausing import PLAN_PARAMS as PAUSE_PLAN_PARAMS
from kombu_sqlinbox.dialects.rates import PLAN_PARAMS as RATE_PLAN_PARAMS
from kombu_sqlinbox.dialects.results import PLAN_PARAMS as RESULT_PLAN_PARAMS
from kombu_sqlinbox.dialects.schedules import PLAN_PARAMS as SCHEDULE_PLAN_PARAMS
from kombu_sqlinbox.history import history_problems
from kombu_sqlinbox.limits import limited
from kombu_sqlinbox.operations import DeadFilter, DeadLetter, Operations

from .dashboard_cli import dashboard
from .history_cli import failures, failures_section
from .ops_context import operations
from .ops_render import age_text, decoded_arguments, render_prometheus, render_text, text_table
from .outbox_cli import outbox, progress
from .pause_cli import commands as pause_commands
from .results import backend_options
from .schedules_cli import schedules

__all__ = ["main", "sqlinbox"]

#: how ``check`` names the result tables' problems
RESULTS = "(results)"
SCHEDULES = "(schedules)"
PAUSED = "(paused)"
LIMITS = "(limits)"
RATES = "(rates)"


def database_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """``--url`` and ``--transport-options``: the database without the app's settings;
    ``--traceback``: the whole traceback of a database failure, not one line."""
    command = click.option(
        "--traceback", "show_traceback", is_flag=True, cls=CeleryOption,
        help_group="Database",
        help="show the traceback of a database failure")(command)
    command = click.option(
        "--transport-options", cls=CeleryOption, help_group="Database",
        help="the transport options as JSON; default: the app's")(command)
    return click.option(
        "--url", cls=CeleryOption, help_group="Database",
        help="the database (an SQLAlchemy URL, with or without sqlinbox+); default: the "
             "app's broker URL")(command)


def configure(ctx: click.Context, app: Any, url: str | None,
              transport_options: str | None, show_traceback: bool = False) -> None:
    """``ctx.obj``: the app (or None), the URL and the transport options given."""
    try:
        options = None if transport_options is None else json.loads(transport_options)
    except ValueError as exc:
        raise click.BadParameter(f"not JSON: {exc}", param_hint="--transport-options") \
            from None
    ctx.obj = SimpleNamespace(app=app, url=url, transport_options=options,
                              traceback=show_traceback)


@click.group(name="sqlinbox", help="Queue health, dead letters, recent failures, DDL, the schema "
                     "check, the outbox.")
@database_options
@click.pass_context
def sqlinbox(ctx: click.Context, url: str | None, transport_options: str | None,
             show_traceback: bool) -> None:
    """Under ``celery``: the app is the one Celery found (``ctx.obj.app``)."""
    configure(ctx, getattr(ctx.obj, "app", None), url, transport_options, show_traceback)


@sqlinbox.command(cls=CeleryCommand)
@click.option("--format", "form", type=click.Choice(["text", "json", "prometheus"]),
              default="text", cls=CeleryOption, help_group="Output", help="how to print")
@click.option("--json", "as_json", is_flag=True, cls=CeleryOption, help_group="Output",
              help="same as --format json")
@click.option("--watch", type=click.FloatRange(min=0, min_open=True), default=None,
              metavar="SECONDS", cls=CeleryOption, help_group="Output",
              help="print again every SECONDS")
@click.option("--times", type=click.IntRange(min=1), default=None, cls=CeleryOption,
              help_group="Output", help="with --watch: stop after this many prints")
@click.pass_context
def queues(ctx: click.Context, form: str, as_json: bool, watch: float | None,
           times: int | None) -> None:
    """Per queue: ready, delayed, in work (and the oldest lease's age), FIFO rows and
    groups blocked behind a head in work, lapsed leases, oldest ready age, dead letters."""
    form = "json" if as_json else form
    printed = 0
    with operations(ctx) as ops:
        while True:
            figures = ops.figures()
            if form == "json":
                click.echo(json.dumps([f.as_dict() for f in figures], indent=2))
            elif form == "prometheus":
                click.echo(render_prometheus(figures), nl=False)
            else:
                if watch is not None:
                    click.echo(datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"))
                click.echo(render_text(figures, time.time()))
                section = failures_section(ctx, ops)
                if section is not None:
                    click.echo("\n" + section)
            printed += 1
            if watch is None or (times is not None and printed >= times):
                return
            sys.stdout.flush()
            time.sleep(watch)


# -- dead letters ------------------------------------------------------------------
SECONDS_AGO = click.FloatRange(min=0)
DLQ_HELP = ("the dead-letter queue(s) to look in (default: every one configured; any other "
            "queue is refused)")


def dead_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """The filters every ``dead`` command takes."""
    for option in reversed([
        click.option("--dead-letter-queue", "-D", "dlq", multiple=True, cls=CeleryOption,
                     help_group="Filters", help=DLQ_HELP),
        click.option("--queue", "-Q", default=None, cls=CeleryOption, help_group="Filters",
                     help="only dead letters of this queue"),
        click.option("--task", "-T", default=None, cls=CeleryOption, help_group="Filters",
                     help="only tasks of this name (a glob: 'billing.*')"),
        click.option("--reason", default=None, cls=CeleryOption, help_group="Filters",
                     help="only those whose reason contains this text"),
        click.option("--older-than", type=SECONDS_AGO, default=None, cls=CeleryOption,
                     help_group="Filters", help="only those dead for at least SECONDS"),
        click.option("--newer-than", type=SECONDS_AGO, default=None, cls=CeleryOption,
                     help_group="Filters", help="only those dead for at most SECONDS"),
    ]):
        command = option(command)
    return command


@contextmanager
def dead_letter_operations(ctx: click.Context) -> Iterator[Operations]:
    """:func:`operations` for the ``dead`` commands, once the database answered (a
    database that is down is said as every command says it) and the options configure a
    dead-letter queue: without one there is nowhere to look, which an empty list or
    "requeued: 0" would hide."""
    with operations(ctx) as ops:
        ops.broker.ping()
        if not ops.configured_dead_letter_queues():
            raise click.ClickException(
                "no dead-letter queue is configured: set dead_letter_queue in the transport "
                "options (for every queue, or for one under queues={'name': {...}})")
        yield ops


def _filter(queue: str | None, task: str | None, reason: str | None,
            older_than: float | None, newer_than: float | None) -> DeadFilter:
    return DeadFilter(queue, task, reason, older_than, newer_than)


def _dead_row(dead: DeadLetter) -> dict[str, Any]:
    return {"dead_letter_queue": dead.dead_letter_queue, "id": dead.id, "queue": dead.queue,
            "origin": dead.origin, "task": dead.task, "task_id": dead.task_id,
            "reason": dead.why, "attempts": dead.attempts, "at": dead.at}


@sqlinbox.group()
def dead() -> None:
    """Dead letters: list, show, requeue, purge."""


@dead.command(name="list", cls=CeleryCommand)
@dead_options
@click.option("--limit", type=click.IntRange(min=1), default=None, help="at most this many")
@click.option("--json", "as_json", is_flag=True, help="print JSON")
@click.pass_context
def dead_list(ctx: click.Context, /, dlq: tuple[str, ...], limit: int | None, as_json: bool,
              **filters: Any) -> None:
    """The dead letters, oldest first: id, queue, task, attempts, age, reason."""
    with dead_letter_operations(ctx) as ops:
        found = list(ops.dead_letters(_filter(**filters), dlq, limit))
    if as_json:
        click.echo(json.dumps([_dead_row(dead) for dead in found], indent=2))
        return
    now = time.time()
    click.echo(text_table(
        ("id", "dead-letter queue", "queue", "task", "attempts", "age", "reason"),
        [(d.id, d.dead_letter_queue, d.queue or "-", d.task or "-",
          "-" if d.attempts is None else d.attempts,
          age_text(None if d.at is None else now - d.at), d.why)
         for d in found], align="><<<>><"))


@dead.command(name="show", cls=CeleryCommand)
@click.argument("row_id", type=int)
@click.option("--dead-letter-queue", "-D", "dlq", multiple=True, help=DLQ_HELP)
@click.pass_context
def dead_show(ctx: click.Context, row_id: int, dlq: tuple[str, ...]) -> None:
    """One dead letter: its message, its death record and its decoded arguments."""
    with dead_letter_operations(ctx) as ops:
        found = ops.dead_letter(row_id, dlq)
    if not found:
        raise click.ClickException(f"no dead letter {row_id}")
    for dead_letter in found:
        click.echo(f"dead letter {dead_letter.id} in {dead_letter.dead_letter_queue}")
        if dead_letter.message is None:
            click.echo(f"undecodable: {dead_letter.undecodable}")
            continue
        message = dead_letter.message
        click.echo(f"task: {dead_letter.task} [{dead_letter.task_id}]")
        click.echo(f"arguments: {decoded_arguments(message)}")
        click.echo(f"death record ({DEATH_HEADER}):\n" + json.dumps(dead_letter.death, indent=2))
        shown = {key: value for key, value in message.items() if key != "body"}
        shown["headers"] = {key: value for key, value in message["headers"].items()
                            if key != DEATH_HEADER}
        shown["properties"] = {key: value for key, value in message["properties"].items()
                               if key not in DELIVERY_PROPERTIES}
        click.echo("message:\n" + json.dumps(shown, indent=2, default=str))


@dead.command(name="requeue", cls=CeleryCommand)
@dead_options
@click.option("--keep-attempts/--reset-attempts", default=False, cls=CeleryOption,
              help_group="Requeue",
              help="keep each message's delivery count (it may then die again at once when "
                   "it reached max_attempts), or start it from 0 (the default)")
@click.option("--batch", type=click.IntRange(min=1), default=500, cls=CeleryOption,
              help_group="Requeue", help="messages moved per transaction")
@click.pass_context
def dead_requeue(ctx: click.Context, /, dlq: tuple[str, ...], keep_attempts: bool, batch: int,
                 **filters: Any) -> None:
    """Move dead letters back to the queues they died in, in order, a batch per
    transaction."""
    chosen = _filter(**filters)
    with dead_letter_operations(ctx) as ops:
        ops.batch = batch
        total, left = _survey(ops, chosen, dlq, requeue=True)
        _nothing_chosen(ctx, ops, chosen, dlq, total + len(left))
        refused: list[str] = []
        with counted(ctx, "requeue", "requeued", total) as update:
            moved = ops.requeue(chosen, dlq, keep_attempts, progress=update,
                                refused=lambda dead, why: refused.append(
                                    f"dead letter {dead.id} of {dead.dead_letter_queue!r}: "
                                    f"{why}; left where it is"))
    click.echo(f"requeued: {moved}")
    for line in refused:
        click.echo(line, err=True)
    _refuse_left(ctx, left, bool(refused))


@dead.command(name="purge", cls=CeleryCommand)
@dead_options
@click.option("--yes", "-y", is_flag=True, help="do not ask for confirmation")
@click.pass_context
def dead_purge(ctx: click.Context, /, dlq: tuple[str, ...], yes: bool, **filters: Any) -> None:
    """Delete dead letters (there is no undo)."""
    chosen = _filter(**filters)
    with dead_letter_operations(ctx) as ops:
        total, left = _survey(ops, chosen, dlq, requeue=False)
        _nothing_chosen(ctx, ops, chosen, dlq, total + len(left))
        if not yes:
            click.confirm(f"delete {total} dead letter(s)? There is no undo", abort=True)
        with counted(ctx, "purge", "purged", total) as update:
            removed = ops.purge(chosen, dlq, progress=update)
    click.echo(f"purged: {removed}")
    _refuse_left(ctx, left)


@contextmanager
def counted(ctx: click.Context, label: str, verb: str, total: int
            ) -> Iterator[Callable[[int], None]]:
    """A progress bar's update that also counts the rows each committed batch moved: an
    operator's Ctrl-C mid-run then says how many moved (the rest stay dead letters,
    each batch being one transaction) and exits 130 instead of a bare ``Aborted!``."""
    done = 0
    with progress(label, total) as bar:
        def update(count: int) -> None:
            nonlocal done
            done += count
            bar.update(count)
        try:
            yield update
        except KeyboardInterrupt:
            click.echo(f"{verb}: {done}")
            click.echo(f"interrupted: {total - done} chosen dead letter(s) left where they "
                       "are", err=True)
            ctx.exit(130)


def _survey(ops: Operations, chosen: DeadFilter, dlq: Sequence[str], requeue: bool
            ) -> tuple[int, dict[tuple[str, str], list[int]]]:
    """How many chosen rows the command takes, and the ids of those it leaves alone (by
    dead-letter queue and why)."""
    total, left = 0, dict[tuple[str, str], list[int]]()
    for dead in ops.dead_letters(chosen, dlq):
        why = dead.left(requeue)
        if why is None:
            total += 1
        else:
            left.setdefault((dead.dead_letter_queue, why), []).append(dead.id)
    return total, left


def _nothing_chosen(ctx: click.Context, ops: Operations, chosen: DeadFilter,
                    dlq: Sequence[str], found: int) -> None:
    """Filters that choose nothing (a typo in a task glob or a queue name): say what the
    dead-letter queues hold instead, and exit 1."""
    if found or chosen == EVERY:
        return
    held: dict[str, list[DeadLetter]] = {}
    for dead in ops.dead_letters(EVERY, dlq):
        held.setdefault(dead.dead_letter_queue, []).append(dead)

    def names(found: Iterable[str | None]) -> str:
        distinct = sorted({name or "-" for name in found})
        return ", ".join(distinct[:20]) + (", ..." if len(distinct) > 20 else "")

    what = "; ".join(
        f"{name} holds {len(letters)} dead letter(s) of queue(s) "
        f"{names(d.queue for d in letters)}, task(s) {names(d.task for d in letters)}"
        for name, letters in held.items()) or "the dead-letter queues are empty"
    click.echo(f"no dead letter matches the filters given: nothing done; {what}", err=True)
    ctx.exit(1)


def _refuse_left(ctx: click.Context, left: dict[tuple[str, str], list[int]],
                 refused: bool = False) -> None:
    """Say which chosen rows were left alone, and exit 1 if any were (or ``refused``)."""
    for (queue, why), ids in left.items():
        shown = ", ".join(map(str, ids[:10])) + (", ..." if len(ids) > 10 else "")
        click.echo(f"left {len(ids)} row(s) of {queue} {why} (ids {shown}): not dead "
                   "letters this command can take; look at them with dead list", err=True)
    if left or refused:
        ctx.exit(1)


# -- schema ---------------------------------------------------------------------------
@sqlinbox.command(cls=CeleryCommand)
@click.argument("names", nargs=-1)
@click.pass_context
def ddl(ctx: click.Context, names: tuple[str, ...]) -> None:
    """CREATE TABLE and CREATE INDEX for the queues named (default: every queue of the app
    and the options, with their dead-letter queues, the routing tables and the result
    backend's and the scheduler's tables), for the database of the URL."""
    with operations(ctx) as ops:
        chosen = names or ops.names
        for name in chosen:
            spec = ops.broker.spec_for(name)
            click.echo(f"-- queue {name}")
            click.echo(";\n".join(ops.dialect.create_ddl(spec)) + ";")
            if (spec.publish is None and spec.rows is None and not spec.plain
                    and ops.dialect.unique_refusal(spec) is None):
                click.echo("-- unique keys (added by the first send with a key where the "
                           "transport creates tables):\n-- "
                           + ";\n-- ".join(ops.dialect.unique_ddl(spec)) + ";")
        if not names:
            routing = ops.dialect.routing_statements(ops.broker.options.table_prefix)
            click.echo("-- routing tables (bindings, queue registry, transient messages)")
            click.echo(";\n".join(routing.ddl) + ";")
            results = ops.dialect.result_statements(
                result_settings(ctx.obj.app, ops.broker.options.table_prefix)[0])
            click.echo("-- result tables (result_backend = 'sqlinbox+...')")
            click.echo(";\n".join(results.ddl) + ";")
            timed = ops.dialect.schedule_statements(ops.broker.options.table_prefix)
            click.echo("-- schedule tables (celery beat -S celery_ext.beat:DatabaseScheduler)")
            click.echo(";\n".join(timed.ddl) + ";")
            keys = ops.dialect.key_statements(ops.broker.options.table_prefix)
            click.echo("-- timed unique keys (made by the first send with unique_scope=N):")
            click.echo(";\n".join(keys.ddl) + ";")
            paused = ops.broker.pauses.sql
            click.echo("-- paused queues (sqlinbox pause)")
            click.echo(";\n".join(paused.ddl) + ";")
            click.echo("-- concurrency limits' slots (made by the first claim of a queue "
                       "with concurrency_limits or max_in_work)")
            click.echo(";\n".join(ops.broker.limits.sql.ddl) + ";")
            click.echo("-- rate budget (queues with a rate_limit)")
            click.echo(";\n".join(ops.broker.rates.sql.ddl) + ";")
            click.echo("-- throughput counts (the dashboard's charts; count_throughput)")
            click.echo(";\n".join(ops.broker.throughput.sql.ddl) + ";")


def result_settings(app: Any, table_prefix: str) -> tuple[str, bool]:
    """The result tables' prefix, and whether they are created on first use: the app's
    sqlinbox result backend's options, else the transport's prefix (and created)."""
    if app is not None and str(app.conf.result_backend or "").startswith("sqlinbox+"):
        options = backend_options(app)
        return str(options["table_prefix"]), bool(options["create_tables"])
    return table_prefix, True


@sqlinbox.command(cls=CeleryCommand)
@click.pass_context
def check(ctx: click.Context) -> None:
    """Plan every statement the transport runs on each queue (and the result backend and
    the scheduler on their tables) against the live schema (nothing is run): missing
    tables or columns, wrong types, a claim that does not use its index. Exits 1 on any
    problem."""
    with operations(ctx) as ops:
        planned, problems = ops.check()
        count = len(ops.queues())
        prefix, create = result_settings(ctx.obj.app, ops.broker.options.table_prefix)
        results = ops.dialect.result_statements(prefix)
        more, found = ops.tables_check(RESULTS, "result", results, RESULT_PLAN_PARAMS, create,
                                       "no task's result can be stored",
                                       partial(history_problems, results, create))
        planned, problems = planned + more, problems + found
        timed = ops.dialect.schedule_statements(ops.broker.options.table_prefix)
        more, found = ops.tables_check(SCHEDULES, "schedule", timed, SCHEDULE_PLAN_PARAMS,
                                       True, "no schedule can run")
        planned, problems = planned + more, problems + found
        more, found = ops.tables_check(PAUSED, "paused queues'", ops.broker.pauses.sql,
                                       PAUSE_PLAN_PARAMS, ops.options.create_tables,
                                       "no queue can be paused (sqlinbox pause)")
        planned, problems = planned + more, problems + found
        options = ops.options
        needed = any(limited(each) for each in (options.defaults, *options.queues.values()))
        more, found = ops.tables_check(LIMITS, "concurrency limits'", ops.broker.limits.sql,
                                       LIMIT_PLAN_PARAMS, options.create_tables or not needed,
                                       "no queue with concurrency limits can be claimed")
        planned, problems = planned + more, problems + found
        more, found = ops.tables_check(RATES, "rate budget", ops.broker.rates.sql,
                                       RATE_PLAN_PARAMS, options.create_tables,
                                       "no queue's rate_limit can be kept")
        planned, problems = planned + more, problems + found
    for problem in problems:
        click.echo(f"PROBLEM {problem.queue} ({problem.table}): {problem.what}")
    click.echo(f"checked {planned} statements on {count} queues: {len(problems)} problem(s)")
    if problems:
        ctx.exit(1)


sqlinbox.add_command(failures)
sqlinbox.add_command(outbox)
pause_commands(sqlinbox, operations)
sqlinbox.add_command(schedules)
sqlinbox.add_command(dashboard)


@click.group(name="sqlinbox", help=sqlinbox.help)
@click.option("-A", "--app", "app_name", default=None,
              help="the Celery app, e.g. proj (optional with --url)")
@database_options
@click.pass_context
def main(ctx: click.Context, app_name: str | None, url: str | None,
         transport_options: str | None, show_traceback: bool) -> None:
    """Standalone: the app is optional where ``--url`` names the database."""
    configure(ctx, find_app(app_name) if app_name else None, url, transport_options,
              show_traceback)


for _name, _command in sqlinbox.commands.items():
    main.add_command(_command, _name)


def run() -> None:
    """The ``sqlinbox`` console script."""
    main(prog_name="sqlinbox")


if __name__ == "__main__":
    run()
