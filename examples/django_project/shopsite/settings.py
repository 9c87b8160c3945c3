"""Settings of the shop site: its database is also its Celery broker and outbox.

``SHOP_DATABASE`` picks the database: ``sqlite:///path`` (the default: shop.sqlite3 here),
``postgresql://user@host:port/name`` or ``mysql://user@host:port/name``.
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import unquote, urlsplit

import celery_ext.django

BASE_DIR = Path(__file__).resolve().parent.parent
SECRET_KEY = "only-for-the-example"
USE_TZ = True
INSTALLED_APPS = ["celery_ext.django", "orders",
                  # the admin, where the database scheduler's schedules are managed
                  "django.contrib.admin", "django.contrib.auth", "django.contrib.contenttypes",
                  "django.contrib.sessions", "django.contrib.messages"]
MIDDLEWARE = ["django.contrib.sessions.middleware.SessionMiddleware",
              "django.middleware.csrf.CsrfViewMiddleware",
              "django.contrib.auth.middleware.AuthenticationMiddleware",
              "django.contrib.messages.middleware.MessageMiddleware"]
ROOT_URLCONF = "shopsite.urls"
TEMPLATES = [{"BACKEND": "django.template.backends.django.DjangoTemplates", "APP_DIRS": True,
              "OPTIONS": {"context_processors": [
                  "django.template.context_processors.request",
                  "django.contrib.auth.context_processors.auth",
                  "django.contrib.messages.context_processors.messages"]}}]
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"


def database(url: str) -> dict[str, object]:
    parts = urlsplit(url)
    if parts.scheme == "sqlite":
        return {"ENGINE": "django.db.backends.sqlite3", "NAME": parts.path[1:]}
    if parts.scheme == "mysql":
        try:
            import MySQLdb  # noqa: F401  (mysqlclient)
        except ImportError:  # the usual stand-in
            import pymysql

            pymysql.install_as_MySQLdb()
    return {"ENGINE": f"django.db.backends.{parts.scheme}", "NAME": parts.path[1:],
            # percent-encoded in the URL (a password with @ or /): Django takes it decoded
            "USER": unquote(parts.username or ""), "PASSWORD": unquote(parts.password or ""),
            "HOST": parts.hostname or "", "PORT": str(parts.port or "")}


# settings-start
DATABASES = {"default": database(
    os.environ.get("SHOP_DATABASE", f"sqlite:///{BASE_DIR / 'shop.sqlite3'}"))}

# the broker is the site's own database; the mail outbox's records live there too
CELERY_BROKER_URL = celery_ext.django.broker_url(DATABASES["default"])
# the mail service's broker (kombu's in-process memory transport unless set), with the
# outbox in the site's database
MAIL_BROKER_URL = os.environ.get("MAIL_BROKER_URL", "memory://")
MAIL_OUTBOX_URL = CELERY_BROKER_URL.removeprefix("sqlinbox+")
MAIL_TASK_IGNORE_RESULT = True
# the migrations create every table the inbox needs (below), so the transport creates none
CELERY_BROKER_TRANSPORT_OPTIONS = {"visibility_timeout": 60, "create_tables": False}
CELERY_TASK_IGNORE_RESULT = True
# the tables the celery_ext.django migrations create
SQLINBOX_QUEUES = ["celery"]
SQLINBOX_OUTBOX_TABLE = "shop_outbox"
# settings-end
