"""The database scheduler's schedules as a model, for Django's admin.

The table is the scheduler's (``<prefix>schedules``, the table prefix of
``CELERY_BROKER_TRANSPORT_OPTIONS``): the migrations create it from the transport's own
DDL, and the model is unmanaged. The admin reads rows through it and writes through
:class:`celery_ext.beat.Schedules`, so a schedule changed in the admin gets its next run
from the database's clock, as one changed from Python or the command line does.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.db import models

from .schema import schedules_table

#: how the ``enabled`` column (an integer in every database) reads
STATES = [(1, "enabled"), (0, "paused")]


class ScheduleName(models.CharField):  # type: ignore[type-arg]
    """A schedule's name: text, stored as the scheduler stores it (MariaDB and MySQL keep
    names as UTF-8 bytes, compared exactly whatever the collation)."""

    def from_db_value(self, value: Any, expression: Any, connection: Any) -> Any:
        return value.decode("utf-8") if isinstance(value, bytes) else value


def database_alias() -> str:
    """The schedules' database: ``SQLINBOX_SCHEDULES_DATABASE``, else ``default``."""
    return str(getattr(settings, "SQLINBOX_SCHEDULES_DATABASE", "default"))


class ScheduleManager(models.Manager["Schedule"]):
    """Rows read on the schedules' database: the admin's list and form, and the form's
    check that a new name is not taken (Django's, through the default manager)."""

    def get_queryset(self) -> models.QuerySet[Schedule]:
        return super().get_queryset().using(database_alias())


class Schedule(models.Model):
    """One periodic task of the database scheduler (times: epoch seconds, the database's)."""

    name = ScheduleName(max_length=255, primary_key=True)
    task = models.TextField()
    kind = models.CharField(max_length=255)
    spec = models.TextField()
    args = models.TextField()
    kwargs = models.TextField()
    options = models.TextField()
    misfire = models.CharField(max_length=255)
    grace = models.FloatField()
    enabled = models.IntegerField(choices=STATES)
    last_run_at = models.FloatField(null=True)
    next_run_at = models.FloatField()
    total_run_count = models.IntegerField()

    objects = ScheduleManager()

    class Meta:
        managed = False
        db_table = schedules_table()
        ordering = ["name"]
        verbose_name = "periodic task"

    def __str__(self) -> str:
        return str(self.name)
