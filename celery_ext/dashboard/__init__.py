"""A dashboard in the browser: the queues' figures live, a queue's ready rows and blocked
FIFO groups, the dead letters to look at, requeue and purge.

A small server-rendered WSGI application (Werkzeug and Jinja2: ``pip install
kombu-sqlinbox[dashboard]``), run alone by ``celery -A proj sqlinbox dashboard`` or
mounted in a web app (:func:`celery_ext.django.dashboard_view`, or any WSGI host with the
person's identity in the environ).
"""

from __future__ import annotations

from .app import Dashboard
from .security import IDENTITY, TOKEN_ENV, new_token

__all__ = ["IDENTITY", "TOKEN_ENV", "Dashboard", "new_token"]
