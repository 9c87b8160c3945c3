"""The database scheduler's tables (its schedules and the ticks they sent) of the table
prefix of ``CELERY_BROKER_TRANSPORT_OPTIONS``, and the admin's unmanaged model of the
schedules."""

from __future__ import annotations

from django.db import migrations, models

from celery_ext.django.models import STATES, ScheduleName
from celery_ext.django.schema import (
    create_schedule_tables,
    drop_schedule_tables,
    schedules_table,
)


class Migration(migrations.Migration):
    dependencies = [("sqlinbox", "0002_routing_tables")]
    operations = [
        migrations.RunPython(create_schedule_tables, drop_schedule_tables),
        migrations.CreateModel(
            name="Schedule",
            fields=[
                ("name", ScheduleName(max_length=255, primary_key=True, serialize=False)),
                ("task", models.TextField()),
                ("kind", models.CharField(max_length=255)),
                ("spec", models.TextField()),
                ("args", models.TextField()),
                ("kwargs", models.TextField()),
                ("options", models.TextField()),
                ("misfire", models.CharField(max_length=255)),
                ("grace", models.FloatField()),
                ("enabled", models.IntegerField(choices=STATES)),
                ("last_run_at", models.FloatField(null=True)),
                ("next_run_at", models.FloatField()),
                ("total_run_count", models.IntegerField()),
            ],
            options={"managed": False, "db_table": schedules_table(), "ordering": ["name"],
                     "verbose_name": "periodic task"},
        ),
    ]
