"""The site's Celery apps: its tasks go through the inbox in its own database; its mails
go through a mail service's broker (RabbitMQ, Redis...) behind the outbox."""

from __future__ import annotations

import os

from celery import Celery

import celery_ext
import kombu_sqlinbox  # noqa: F401  (registers the sqlinbox+ broker URLs)

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "shopsite.settings")

# the inbox: configured from the Django settings (CELERY_*)
app = Celery("shopsite")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()

# the mail service's broker (MAIL_* settings); each send is recorded in the site's
# database first, in the caller's transaction, and goes out when it commits
mail = Celery("mail", set_as_current=False)
mail.config_from_object("django.conf:settings", namespace="MAIL")
outbox = celery_ext.install(mail, table="shop_outbox", create_table=False)
