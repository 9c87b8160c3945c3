"""The dashboard mounted in a Django site, behind the admin's staff login::

    from celery_ext.django.dashboard import dashboard_view
    from proj.celery import app

    urlpatterns = [re_path(r"^ops/dashboard(?P<rest>/.*)?$", dashboard_view(app)), ...]

Signed-out people are sent to the admin's login page, and signed-in ones who are not
staff refused by it; the dashboard's CSRF tokens are bound to the staff member and keyed
by the site's ``SECRET_KEY`` (the same in every process of the site).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from io import BytesIO
from typing import Any, cast

from django.conf import settings
from django.contrib.admin.views.decorators import staff_member_required
from django.http import HttpRequest, HttpResponse
from django.views.decorators.csrf import csrf_exempt

from ..dashboard import IDENTITY, Dashboard
from ..ops_context import app_operations

__all__ = ["dashboard_view"]


def dashboard_view(app: Any, **options: Any) -> Callable[..., HttpResponse]:
    """A Django view serving the dashboard of ``app``'s broker database under the path
    its URL pattern matched (the part after it in the ``rest`` keyword); ``options`` are
    :class:`~celery_ext.dashboard.Dashboard`'s (``read_only``, ``refresh``, ``page``).
    The database is opened at the first request."""
    made: list[Dashboard] = []

    def view(request: HttpRequest, rest: str | None = None) -> HttpResponse:
        if not made:
            key = hashlib.sha256(f"sqlinbox-dashboard:{settings.SECRET_KEY}".encode())
            made.append(Dashboard(app_operations(app), secret=key.digest(), app=app,
                                  **options))
        rest = rest or "/"
        environ = dict(request.META)
        body = request.body
        environ.update({
            IDENTITY: f"{request.user.pk}:{request.user.get_username()}",
            # the site's address as Django knows it (behind a proxy: SECURE_PROXY_SSL_HEADER,
            # USE_X_FORWARDED_HOST), which the forms' origin is compared with
            "wsgi.url_scheme": request.scheme, "HTTP_HOST": request.get_host(),
            "SCRIPT_NAME": request.path[: len(request.path) - len(rest)],
            "PATH_INFO": rest, "wsgi.input": BytesIO(body), "CONTENT_LENGTH": str(len(body)),
        })
        started: list[Any] = []

        def start_response(status: str, headers: list[tuple[str, str]],
                           exc_info: Any = None) -> Callable[[bytes], object]:
            started[:] = [status, headers]
            return lambda data: None

        content = b"".join(made[0](environ, start_response))
        response = HttpResponse(content, status=int(started[0].split()[0]))
        for name, value in started[1]:
            response[name] = value
        return response

    # every POST is checked by the dashboard's own CSRF token
    return cast(Callable[..., HttpResponse], csrf_exempt(staff_member_required(view)))
