from __future__ import annotations

from django.apps import AppConfig


class SqlinboxConfig(AppConfig):
    """Holds the migrations that create the inbox's and the outbox's tables."""

    name = "celery_ext.django"
    label = "sqlinbox"
    verbose_name = "kombu-sqlinbox"
