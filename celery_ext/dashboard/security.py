"""Who may see the dashboard and act through it.

Standalone, a request must carry the token: once as ``?token=`` (traded for an
HttpOnly, SameSite=Strict cookie holding a digest of it, and a redirect that drops it
from the address bar), or as ``Authorization: Bearer``. Mounted in a web app, the host
authenticates and names the person in the WSGI environ (:data:`IDENTITY`); without one
every request is refused. Every action is a POST carrying a CSRF token bound to that
identity, from a page of the same origin.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import secrets
from typing import Any
from urllib.parse import urlsplit

from werkzeug.serving import WSGIRequestHandler
from werkzeug.wrappers import Request, Response

__all__ = ["COOKIE", "HEADERS", "IDENTITY", "TOKEN_ENV", "Guard", "Quiet", "new_token"]

#: where the host web app puts who is signed in (any text naming them)
IDENTITY = "sqlinbox.dashboard.identity"
#: the environment variable ``celery sqlinbox dashboard`` takes its token from
TOKEN_ENV = "SQLINBOX_DASHBOARD_TOKEN"
COOKIE = "sqlinbox_dashboard"
#: on every response: nothing runs but our own script, nothing frames the pages, nothing
#: is cached, the address goes to no other site (``same-origin``: ``no-referrer`` would
#: make browsers send ``Origin: null`` with the dashboard's own forms, which are refused)
HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
        "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"),
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}


def new_token() -> str:
    return secrets.token_urlsafe(24)


def _digest(key: bytes, purpose: str, value: str) -> str:
    return hmac.new(key, f"{purpose}:{value}".encode(), hashlib.sha256).hexdigest()


def same(given: str, expected: str) -> bool:
    """Whether ``given`` is ``expected``, in a time that does not tell how much of it is
    (as bytes: a cookie or form field of any text is simply not it)."""
    return hmac.compare_digest(given.encode("utf-8", "surrogatepass"), expected.encode())


class Guard:
    """The token (None: mounted, the host's identity instead) and the key CSRF tokens
    are made with (random per process unless given: a host running several processes
    gives one, e.g. derived from its own secret key)."""

    def __init__(self, token: str | None, secret: bytes | None = None) -> None:
        self.token = token
        self.secret = secret or secrets.token_bytes(32)

    def identity(self, request: Request) -> str | None:
        """Who asks: the host's identity, or (standalone) the token's, from the cookie or
        the Authorization header; None: refused."""
        if self.token is None:
            found = request.environ.get(IDENTITY)
            return str(found) if found else None
        expected = self.session_value()
        given = request.cookies.get(COOKIE, "")
        bearer = request.headers.get("Authorization", "")
        if same(given, expected) or (
                bearer.startswith("Bearer ") and self.token_matches(bearer[7:])):
            return expected
        return None

    def token_matches(self, given: str) -> bool:
        return self.token is not None and same(given, self.token)

    def session_value(self) -> str:
        """The cookie's value: a digest of the token, never the token itself."""
        return _digest(self.secret, "session", str(self.token))

    def csrf(self, identity: str) -> str:
        return _digest(self.secret, "csrf", identity)

    def seal(self, identity: str, said: str) -> str:
        """The seal an action's redirect gives its message ``said`` for ``identity``: only
        this dashboard's key makes it, so a link made elsewhere says nothing."""
        return _digest(self.secret, "said", json.dumps([identity, said]))

    def unsealed(self, request: Request, identity: str | None) -> str | None:
        """The message (``?done=``) of the address, if its seal (``?seal=``) is the one this
        dashboard gave it for ``identity``; else None (a crafted or altered link, or
        another person's)."""
        said = request.args.get("done")
        if said is None or identity is None:
            return None
        return said if same(request.args.get("seal", ""), self.seal(identity, said)) else None

    def post_refusal(self, request: Request, identity: str) -> str | None:
        """Why a POST is refused (None: it is not): a CSRF token that is not this
        identity's, or an Origin (or Referer) other than the dashboard's own."""
        if not same(request.form.get("csrf", ""), self.csrf(identity)):
            return "the form's CSRF token is missing or wrong: reload the page"
        origin = request.headers.get("Origin") or request.headers.get("Referer")
        if origin:
            parts = urlsplit(origin)
            if f"{parts.scheme}://{parts.netloc}" != request.host_url.rstrip("/"):
                return f"the request came from another origin ({parts.netloc})"
        elif request.headers.get("Sec-Fetch-Site", "same-origin") not in (
                "same-origin", "none"):
            return "the request came from another site"
        return None


#: a token in an address, as a log line may hold one
_TOKEN_IN_ADDRESS = re.compile(r"(token=)[^&\s\"']*")


class Quiet(WSGIRequestHandler):
    """The standalone server's request handler: its log lines (the request's, an
    error's) show an address's token as ``***``."""

    def log(self, type: str, message: str, *args: Any) -> None:
        super().log(type, message, *(_TOKEN_IN_ADDRESS.sub(r"\1***", str(each))
                                     for each in args))


def secured(response: Response) -> Response:
    """``response`` with the security headers."""
    response.headers.update(HEADERS)
    return response
