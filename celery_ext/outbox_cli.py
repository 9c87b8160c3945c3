"""Outbox operations from the command line: status, republish, prune.

As a Celery sub-command (``celery -A proj outbox status``) once the distribution
registers :data:`outbox` under the ``celery.commands`` entry point, or standalone::

    python -m celery_ext.outbox_cli -A proj status
    python -m celery_ext.outbox_cli -A proj republish --older-than 0
    python -m celery_ext.outbox_cli -A proj prune --older-than 86400

The app module must install the outbox (``celery_ext.install(app, ...)``). The same
commands are ``celery -A proj sqlinbox outbox ...`` (:mod:`celery_ext.ops_cli`).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import click
from celery.app.utils import find_app
from sqlalchemy.exc import InterfaceError, OperationalError

from kombu_sqlinbox.errors import reason_of
from kombu_sqlinbox.urls import masked

from .outbox import Outbox, OutboxError, outbox_of

__all__ = ["database_failed", "main", "outbox", "progress"]


def database_failed(url: str, exc: OperationalError | InterfaceError) -> click.ClickException:
    """A database that is down or refuses the command is the operator's to fix, not a bug:
    one line naming the database (its password masked) and the driver's reason, instead
    of SQLAlchemy's chained traceback (``--traceback`` shows it)."""
    return click.ClickException(
        f"the database {masked(url)} failed: {reason_of(exc)} (--traceback for the details)")


@contextmanager
def _outbox(ctx: click.Context) -> Iterator[Outbox]:
    """The app's outbox; an app without one, or its database failing, is one line."""
    app = getattr(ctx.obj, "app", None)
    if app is None:
        raise click.UsageError("the outbox commands need the app: -A proj")
    try:
        found = outbox_of(app)
        yield found
    except OutboxError as exc:  # none installed, no database given yet
        raise click.UsageError(str(exc)) from None
    except (OperationalError, InterfaceError) as exc:
        if getattr(ctx.obj, "traceback", False):  # ``sqlinbox --traceback outbox ...``
            raise
        url = found.engine.url.render_as_string(hide_password=False)
        raise database_failed(url, exc) from None


class _Quiet:
    """Progress not shown: stderr is no terminal (a pipe, a log file, a cron job)."""

    def __enter__(self) -> _Quiet:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def update(self, steps: int) -> None:
        """Nothing to draw."""


def progress(label: str, length: int) -> Any:
    """A progress bar on stderr when it is a terminal (stdout keeps the counts)."""
    if not sys.stderr.isatty():
        return _Quiet()
    return click.progressbar(length=length, label=label, file=sys.stderr, show_pos=True)


@click.group(name="outbox", help="The transactional outbox: status, republish, prune.")
def outbox() -> None:
    """Sub-commands find the app in ``ctx.obj.app``, as Celery's own commands do."""


@outbox.command(help="Counts of unprocessed and processed records, oldest unprocessed age.")
@click.pass_context
def status(ctx: click.Context) -> None:
    with _outbox(ctx) as found_outbox:
        found = found_outbox.status()
    age = "-" if found.oldest_unprocessed_age is None else f"{found.oldest_unprocessed_age:.1f}s"
    click.echo(f"unprocessed: {found.unprocessed}\nprocessed: {found.processed}\n"
               f"oldest unprocessed age: {age}")


@outbox.command(help="Send again the records unprocessed for longer than the grace period.")
@click.option("--older-than", type=float, default=None,
              help="seconds unprocessed (default: the outbox's grace period)")
@click.option("--limit", type=int, default=None, help="at most this many records")
@click.pass_context
def republish(ctx: click.Context, older_than: float | None, limit: int | None) -> None:
    with _outbox(ctx) as found, progress("republish", found.status().unprocessed) as bar:
        done = found.republish(older_than, limit, progress=bar.update)
    failed = ", ".join(map(str, done.failed)) or "none"
    click.echo(f"republished: {done.sent}\nfailed (see the log): {failed}\n"
               f"held back for their eta: {done.held}")


@outbox.command(help="Delete the records processed longer ago than the retention period.")
@click.option("--older-than", type=float, default=None,
              help="seconds since processed (default: the outbox's retention)")
@click.pass_context
def prune(ctx: click.Context, older_than: float | None) -> None:
    with _outbox(ctx) as found, progress("prune", found.status().processed) as bar:
        pruned = found.prune(older_than, progress=bar.update)
    click.echo(f"pruned: {pruned}")


@click.group(help=__doc__.splitlines()[0] if __doc__ else None)
@click.option("-A", "--app", "app_name", required=True, help="the Celery app, e.g. proj")
@click.pass_context
def main(ctx: click.Context, app_name: str) -> None:
    ctx.obj = SimpleNamespace(app=find_app(app_name))


for _command in (status, republish, prune):
    main.add_command(_command)

if __name__ == "__main__":
    main(prog_name="python -m celery_ext.outbox_cli")
