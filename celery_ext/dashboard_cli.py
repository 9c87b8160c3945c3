"""``celery -A proj sqlinbox dashboard``: the dashboard (:mod:`celery_ext.dashboard`) run
alone, on the loopback interface unless told otherwise, behind a token."""

from __future__ import annotations

import os

import click
from celery.bin.base import CeleryCommand, CeleryOption

from .ops_context import operations

__all__ = ["dashboard"]

#: where it listens unless told otherwise
HOST, PORT = "127.0.0.1", 8215
MISSING = ("the dashboard needs Jinja2 and Werkzeug: pip install "
           "'kombu-sqlinbox[dashboard]'")


@click.command(cls=CeleryCommand)
@click.option("--host", default=HOST, show_default=True, cls=CeleryOption,
              help_group="Server", help="the interface to listen on")
@click.option("--port", type=click.IntRange(0, 65535), default=PORT, show_default=True,
              cls=CeleryOption, help_group="Server", help="the port to listen on")
@click.option("--token", default=None, cls=CeleryOption, help_group="Server",
              help="the token every request must carry (default: $SQLINBOX_DASHBOARD_TOKEN, "
                   "else one made now and printed)")
@click.option("--read-only", is_flag=True, cls=CeleryOption, help_group="Server",
              help="show, never act: requeue and purge are refused")
@click.option("--proxied", is_flag=True, cls=CeleryOption, help_group="Server",
              help="behind one proxy (ending TLS): its X-Forwarded-Proto, -Host, -Port and "
                   "-Prefix headers are the address browsers use")
@click.option("--refresh", type=click.FloatRange(min=0.5), default=5.0, show_default=True,
              cls=CeleryOption, help_group="Server",
              help="seconds between the live pages' refreshes")
@click.option("--worker-timeout", type=click.FloatRange(min=0.1, max=30.0), default=1.0,
              show_default=True, cls=CeleryOption, help_group="Server",
              help="seconds the workers page waits for the workers' answers")
@click.pass_context
def dashboard(ctx: click.Context, host: str, port: int, token: str | None, read_only: bool,
              proxied: bool, refresh: float, worker_timeout: float) -> None:
    """Serve the dashboard: the queues' figures live, a queue's ready rows and blocked
    groups, the dead letters (requeue, purge), the workers, pauses and limits."""
    try:
        from werkzeug.middleware.proxy_fix import ProxyFix
        from werkzeug.serving import run_simple

        from .dashboard import TOKEN_ENV, Dashboard, new_token
        from .dashboard.security import Quiet
    except ImportError:
        raise click.ClickException(MISSING) from None
    token = token or os.environ.get(TOKEN_ENV) or None
    made = token is None
    token = token or new_token()
    with operations(ctx) as ops:
        ops.broker.ping()
        app = Dashboard(ops, token=token, read_only=read_only, refresh=refresh,
                        app=ctx.obj.app, worker_timeout=worker_timeout)
        shown = "[::1]" if host == "::1" else host
        click.echo(f"sqlinbox dashboard of {app.database} on http://{shown}:{port}/"
                   + (f"?token={token}" if made else f" (the token of --token or "
                      f"${TOKEN_ENV})") + (" read-only" if read_only else ""), err=True)
        if host not in ("127.0.0.1", "localhost", "::1"):
            click.echo(f"warning: listening on {host}, beyond this machine: the token is "
                       "all that guards it; put TLS in front", err=True)
        served = ProxyFix(app, x_proto=1, x_host=1, x_port=1, x_prefix=1) if proxied else app
        try:
            run_simple(host, port, served, threaded=True, use_reloader=False,
                       request_handler=Quiet)
        finally:
            app.close()
