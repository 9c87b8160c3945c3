"""``celery -A proj sqlinbox pause|resume|paused``: stop and start claims of a queue on
every worker of the database (:mod:`kombu_sqlinbox.pausing`), kept across restarts."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from contextlib import AbstractContextManager

import click
from celery.bin.base import CeleryCommand

from kombu_sqlinbox.operations import Operations
from kombu_sqlinbox.pause_operations import unknown_queue

from .ops_render import paused_text, render_paused

Opened = Callable[[click.Context], AbstractContextManager[Operations]]


def commands(group: click.Group, operations: Opened) -> None:
    """Add the commands to ``group``; ``operations`` opens :class:`Operations` for a
    command's context (``ops_cli.operations``)."""

    @group.command(cls=CeleryCommand)
    @click.argument("queue")
    @click.option("--reason", default=None, help="why (shown by queues and paused)")
    @click.option("--by", default=None, help="who pauses (default: user@host)")
    @click.option("--force", is_flag=True,
                  help="pause a queue this app and database do not know yet")
    @click.pass_context
    def pause(ctx: click.Context, queue: str, reason: str | None, by: str | None,
              force: bool) -> None:
        """Stop every worker claiming QUEUE (within one wake-up; tasks in work finish,
        publishes go on and wait), until resume; kept across worker restarts."""
        with operations(ctx) as ops:
            kept, made = ops.pause(queue, reason, by, force)
            interval = ops.options.pause_check_interval
        now = time.time()
        if made:
            click.echo(f"paused {queue}: {paused_text(kept, now)}; workers stop claiming "
                       f"it at their next wake-up (within {interval:g}s without one)")
        else:
            click.echo(f"{queue} was paused already: {paused_text(kept, now)}")

    @group.command(cls=CeleryCommand)
    @click.argument("queue")
    @click.pass_context
    def resume(ctx: click.Context, queue: str) -> None:
        """Let workers claim QUEUE again (they are woken at once)."""
        with operations(ctx) as ops:
            if not ops.resume(queue):
                paused = [found.queue for found in ops.paused()]
                raise click.ClickException(str(unknown_queue(queue, paused, "paused")))
        click.echo(f"resumed {queue}")

    @group.command(name="paused", cls=CeleryCommand)
    @click.option("--json", "as_json", is_flag=True, help="print JSON")
    @click.pass_context
    def paused(ctx: click.Context, as_json: bool) -> None:
        """The paused queues: who paused each, when and why."""
        with operations(ctx) as ops:
            found = ops.paused()
        if as_json:
            click.echo(json.dumps([dataclasses.asdict(each) for each in found], indent=2))
        elif found:
            click.echo(render_paused(found, time.time()))
