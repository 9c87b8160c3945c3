"""The sqlinbox dashboard mounted in a Flask site and in a FastAPI (Starlette) site, under
``/ops/dashboard``, behind the site's own sign-in.

Each site signs people in its own way (here a stand-in: ``/login?user=...`` keeps the name
in the site's signed session cookie); the dashboard is told who is signed in through the
WSGI environ, and refuses every request without one. Its CSRF tokens are keyed by the
site's secret key, so every process of the site accepts them.

Run one (``pip install flask`` or ``pip install fastapi a2wsgi itsdangerous uvicorn``)::

    MOUNTS_BROKER_URL=sqlinbox+postgresql://app@db/app flask --app sites:flask_site run
    MOUNTS_BROKER_URL=sqlinbox+postgresql://app@db/app uvicorn --factory sites:fastapi_site
"""

import hashlib
import os
from collections.abc import Callable, Iterable
from typing import Any

from celery import Celery

import kombu_sqlinbox  # noqa: F401  (registers the sqlinbox+ broker URLs)
from celery_ext.dashboard import IDENTITY, Dashboard
from celery_ext.ops_context import app_operations

SECRET_KEY = os.environ.get("SITE_SECRET_KEY", "change-me")
MOUNT = "/ops/dashboard"


def celery_app() -> Celery:
    """The site's Celery app: its broker is the site's database."""
    made = Celery("shop", broker=os.environ["MOUNTS_BROKER_URL"], set_as_current=False)
    made.conf.broker_transport_options = {
        "table_prefix": os.environ.get("MOUNTS_PREFIX", "sqlinbox_"),
        "queues": {"orders": {"concurrency_limits": {"tenant-": 2}}}}
    made.conf.task_default_queue = "orders"
    return made


def dashboard(app: Celery) -> Dashboard:
    """The dashboard of ``app``'s broker database; its CSRF tokens keyed by the site's
    secret key."""
    key = hashlib.sha256(f"sqlinbox-dashboard:{SECRET_KEY}".encode()).digest()
    return Dashboard(app_operations(app), secret=key, app=app)


WSGI = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


def behind(signed_in: Callable[[dict[str, Any]], str | None], served: Dashboard) -> WSGI:
    """``served`` told who the site signed in (``signed_in`` reads it off the request);
    nobody: the dashboard refuses the request."""

    def mounted(environ: dict[str, Any], start_response: Callable[..., Any]
                ) -> Iterable[bytes]:
        user = signed_in(environ)
        if user:
            environ[IDENTITY] = user
        return served(environ, start_response)

    return mounted


# -- Flask: DispatcherMiddleware mounts the dashboard beside the site ----------------------
def flask_site() -> Any:
    from flask import Flask, request, session
    from werkzeug.middleware.dispatcher import DispatcherMiddleware

    site = Flask(__name__)
    site.secret_key = SECRET_KEY

    @site.post("/login")  # a stand-in for the site's own sign-in
    def login() -> str:
        session["user"] = request.args["user"]
        return "signed in"

    def signed_in(environ: dict[str, Any]) -> str | None:
        with site.request_context(environ):  # the site's session, from its cookie
            return session.get("user")

    site.wsgi_app = DispatcherMiddleware(  # type: ignore[method-assign]
        site.wsgi_app, {MOUNT: behind(signed_in, dashboard(celery_app()))})
    return site


# -- FastAPI or Starlette: a2wsgi's WSGIMiddleware mounts it ---------------------------------
def fastapi_site() -> Any:
    from a2wsgi import WSGIMiddleware
    from fastapi import FastAPI, Request
    from starlette.middleware.sessions import SessionMiddleware

    site = FastAPI()
    site.add_middleware(SessionMiddleware, secret_key=SECRET_KEY)

    @site.post("/login")  # a stand-in for the site's own sign-in
    def login(request: Request, user: str) -> str:
        request.session["user"] = user
        return "signed in"

    def signed_in(environ: dict[str, Any]) -> str | None:
        # the session SessionMiddleware read for the mount too, in the ASGI scope
        return environ["asgi.scope"].get("session", {}).get("user")

    site.mount(MOUNT, WSGIMiddleware(behind(signed_in, dashboard(celery_app()))))
    return site
