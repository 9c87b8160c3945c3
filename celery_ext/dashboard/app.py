"""The dashboard as a WSGI application: routes, who may call them, and what each does.

Reads go through :class:`~kombu_sqlinbox.operations.Operations` (the ``queues``
command's figures, its dead letters) and :mod:`kombu_sqlinbox.browsing` (keyset pages of
a queue's rows); every action is one of the operations' own, as the ``sqlinbox``
commands run them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from jinja2 import Environment, PackageLoader, select_autoescape
from sqlalchemy.exc import InterfaceError, OperationalError
from werkzeug.exceptions import HTTPException
from werkzeug.routing import Map, Rule
from werkzeug.utils import redirect, send_file
from werkzeug.wrappers import Request, Response

from kombu_sqlinbox.browsing import EXACT_UPTO
from kombu_sqlinbox.errors import ConfigurationError, reason_of
from kombu_sqlinbox.operations import Operations
from kombu_sqlinbox.urls import masked

from ..history_cli import when
from .control import Control
from .pages import LARGEST, Pages, filters_query
from .security import COOKIE, Guard, secured
from .service import Service

__all__ = ["Dashboard"]

STATIC = Path(__file__).parent / "static"
logger = logging.getLogger(__name__)


class Dashboard:
    """The WSGI application over one database's operations.

    ``token``: standalone, the token every request must carry; None when mounted in a
    web app that authenticates and names the person in the environ (see
    :data:`~.security.IDENTITY`). ``read_only`` refuses every action; ``refresh`` is how
    often (seconds) the live pages read their figures again; ``page`` how many rows a
    page shows at most; ``app`` the Celery app whose outbox, result backend and
    schedules the pages show, whose workers the workers page asks (None: those pages say
    they need it); ``worker_timeout`` how long (seconds) the workers page waits for the
    workers' answers; ``exact_upto`` how many unfinished rows a queue's table may have
    for its figures to be counted (more: the page shows the planner's estimate, marked
    "about"). :meth:`close` stops the thread receiving the workers' heartbeats."""

    def __init__(self, ops: Operations, token: str | None = None,
                 read_only: bool = False, refresh: float = 5.0,
                 secret: bytes | None = None, page: int = 50, app: Any = None,
                 worker_timeout: float = 1.0, exact_upto: int = EXACT_UPTO) -> None:
        self.ops = ops
        self.page = page
        self.exact_upto = exact_upto
        self.guard = Guard(token, secret)
        self.read_only = read_only
        self.refresh = refresh
        #: the database as pages name it: never its password, nor a secret in its query
        self.database = masked(ops.broker.engine.url.render_as_string(hide_password=False))
        self.templates = Environment(loader=PackageLoader("celery_ext.dashboard"),
                                     autoescape=select_autoescape(default=True))
        self.templates.filters["utc"] = when
        self.pages = Pages(self)
        self.service = Service(self, app)
        self.control = Control(self, app, worker_timeout)
        self.routes = Map([
            Rule("/", endpoint="queues", methods=["GET"]),
            Rule("/queues/<path:name>", endpoint="queue", methods=["GET"]),
            Rule("/dead", endpoint="dead_letters", methods=["GET"]),
            Rule(f"/dead/<path:dlq>/<int(max={LARGEST}):row_id>", endpoint="dead_letter",
                 methods=["GET"]),
            Rule("/dead/requeue", endpoint="requeue", methods=["POST"]),
            Rule("/dead/purge", endpoint="purge", methods=["POST"]),
            Rule("/outbox", endpoint="outbox", methods=["GET"]),
            Rule("/outbox/republish", endpoint="republish", methods=["POST"]),
            Rule("/failures", endpoint="failures", methods=["GET"]),
            Rule("/schedules", endpoint="schedules", methods=["GET"]),
            Rule("/schedules/pause", endpoint="pause_schedule", methods=["POST"]),
            Rule("/schedules/resume", endpoint="resume_schedule", methods=["POST"]),
            Rule("/workers", endpoint="workers", methods=["GET"]),
            Rule("/pauses", endpoint="pauses", methods=["GET"]),
            Rule("/pauses/pause", endpoint="pause_queue", methods=["POST"]),
            Rule("/pauses/resume", endpoint="resume_queue", methods=["POST"]),
            Rule("/limits", endpoint="limits", methods=["GET"]),
            Rule("/static/<any('dashboard.js', 'dashboard.css'):file>", endpoint="static",
                 methods=["GET"]),
        ])

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]
                 ) -> Iterable[bytes]:
        request = Request(environ)
        return secured(self.respond(request))(environ, start_response)

    def respond(self, request: Request) -> Response:
        """The response to ``request``: refused without the token (or the host's
        identity), a POST without its CSRF token or from elsewhere, or any action in
        read-only mode."""
        adapter = self.routes.bind_to_environ(request.environ)
        try:
            endpoint, values = adapter.match()
            if endpoint == "static":
                return send_file(STATIC / values["file"], request.environ, max_age=0)
            given = request.args.get("token")
            if given is not None and self.guard.token_matches(given):
                return self.signed_in(request)
            identity = self.guard.identity(request)
            if identity is None:
                return self.refused(request, 401, "This dashboard needs its token: open the "
                                    "address printed when it started (…/?token=…).")
            if request.method == "POST":
                why = ("the dashboard is read-only" if self.read_only
                       else self.guard.post_refusal(request, identity))
                if why is not None:
                    return self.refused(request, 403, f"Refused: {why}.")
            handler = next(getattr(part, endpoint) for part in (
                self.pages, self.service, self.control) if hasattr(part, endpoint))
            response: Response = handler(request, identity, **values)
            return response
        except HTTPException as exc:
            return self.refused(request, exc.code or 500, exc.description or exc.name)
        except ConfigurationError as exc:
            return self.refused(request, 400, str(exc))
        except (OperationalError, InterfaceError) as exc:
            return self.refused(request, 503, f"The database {self.database} failed: "
                                f"{reason_of(exc)}")
        except Exception as exc:  # a plain page: its text (values, URLs) only in the log
            logger.exception("sqlinbox dashboard: %s %s failed", request.method, request.path)
            return self.refused(request, 500, f"The page {request.path} failed "
                                f"({type(exc).__name__}); the dashboard's log has the "
                                "details.")

    def close(self) -> None:
        """Stop the workers' heartbeats' receiver (the operations are the caller's)."""
        self.control.close()

    def who(self, identity: str) -> str:
        """Who acts, as a pause records it: the host's name for the person (mounted), else
        the dashboard (its token names nobody)."""
        return "dashboard" if self.guard.token is not None else f"{identity} (dashboard)"

    def signed_in(self, request: Request) -> Response:
        """The token traded for the session cookie, and the address without it."""
        rest = [(key, value) for key, value in request.args.items(multi=True)
                if key != "token"]
        target = request.base_url + ("?" + urlencode(rest) if rest else "")
        response = redirect(target, 303)
        response.set_cookie(COOKIE, self.guard.session_value(), httponly=True,
                            samesite="Strict", secure=request.scheme == "https",
                            path=request.script_root or "/")
        return response

    def render(self, request: Request, template: str, identity: str | None,
               status: int = 200, live: bool = False, **values: Any) -> Response:
        """A page: its template with what every page shows."""
        root = request.script_root
        html = self.templates.get_template(template).render(
            root=root, database=self.database, read_only=self.read_only,
            csrf=None if identity is None else self.guard.csrf(identity),
            refresh=self.refresh if live else None, now=time.time(), request=request,
            done=self.guard.unsealed(request, identity), **values)
        return Response(html, status, mimetype="text/html")

    def told(self, request: Request, identity: str, page: str, done: str,
             **query: str) -> Response:
        """Back (after an action) to ``page`` of the query ``query``, saying what was
        ``done`` (any text: each value is encoded) to ``identity`` alone: the message
        goes with its seal (:meth:`~.security.Guard.seal`), and a page shows none
        without it, so no link made elsewhere makes a page say anything."""
        said = {**query, "done": done, "seal": self.guard.seal(identity, done)}
        return redirect(f"{request.script_root}/{page}?{filters_query(said)}", 303)

    def refused(self, request: Request, status: int, why: str) -> Response:
        """A refusal; to a stranger (neither the token nor the host's identity) it does
        not name the database."""
        return self.render(request, "refused.html", None, status, why=why,
                           stranger=self.guard.identity(request) is None)

