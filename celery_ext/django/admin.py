"""The database scheduler's schedules in Django's admin: listed with their timing, state,
last and next run; added, changed, paused, resumed and removed.

Rows are read through the unmanaged :class:`~celery_ext.django.models.Schedule` and written
through :class:`celery_ext.beat.Schedules` on the database of
``SQLINBOX_SCHEDULES_DATABASE`` (the ``default`` alias unless set), so the admin keeps
the scheduler's rules: a timing as ``sqlinbox schedules add`` takes it, the next run
computed by the database's clock, a change of timing only moving the next run.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from typing import Any

from celery import current_app
from django import forms
from django.conf import settings
from django.contrib import admin, messages
from django.db import connections, transaction
from django.db.models import QuerySet, TextField
from django.db.models.functions import Cast
from django.http import HttpRequest, HttpResponse

from kombu_sqlinbox.database import open_database
from kombu_sqlinbox.options import parse_options

from ..beat import Schedules
from ..django_db import broker_url, sqlalchemy_connection
from ..ops_render import timing_text
from ..schedule_times import DEFAULT_GRACE, MISFIRE, ScheduleError, parse
from .models import Schedule, database_alias

_lock = threading.Lock()
_stores: dict[str, Schedules] = {}


def schedules() -> Schedules:
    """The schedules of the admin's database (one engine per process)."""
    alias = database_alias()
    with _lock:
        if alias not in _stores:
            options = parse_options(getattr(settings, "CELERY_BROKER_TRANSPORT_OPTIONS", None))
            _stores[alias] = Schedules(open_database(broker_url(alias), options),
                                       options.table_prefix, current_app)
        return _stores[alias]


@contextmanager
def changing() -> Iterator[Schedules]:
    """The schedules, changed in the admin's own transaction on Django's connection (which
    commits them with the admin's log entry; a write on a connection of its own would
    wait for that transaction's lock, or on SQLite find its snapshot stale)."""
    conn = sqlalchemy_connection(connections[database_alias()])
    try:
        yield schedules().bound(conn)
    finally:
        conn.close()


@contextmanager
def writing_first(request: HttpRequest) -> Iterator[None]:
    """A form posted on SQLite: its transaction takes the write lock before the admin
    reads the schedule. One that read first could not write once a scheduler's tick
    committed meanwhile (its snapshot stale: "database is locked" at once, no wait);
    one that waits for the lock first reads after the tick."""
    alias = database_alias()
    if request.method != "POST" or connections[alias].vendor != "sqlite":
        yield
        return
    table = schedules().dialect.quote(schedules().sql.names[0])
    with transaction.atomic(using=alias):
        with connections[alias].cursor() as cursor:  # writes nothing; locks
            cursor.execute(f"UPDATE {table} SET name = name WHERE 0 = 1")
        yield


def _json(value: str, kind: type, what: str) -> Any:
    try:
        loaded = json.loads(value or ("[]" if kind is list else "{}"))
    except ValueError as exc:
        raise forms.ValidationError(f"not JSON: {exc}") from None
    if not isinstance(loaded, kind):
        raise forms.ValidationError(f"{what}: a JSON {kind.__name__} is needed")
    return loaded


def _timing(kind: str, spec: str) -> str:
    """A row's timing as ``schedules add`` takes it; one the scheduler cannot read (JSON
    edited by hand, a kind it does not know) as stored, so that the list and the form to
    fix it still show."""
    try:
        return timing_text(kind, spec)
    except (ValueError, TypeError, AttributeError, KeyError):
        return f"unreadable: {kind} {spec}"


def _options(stored: str) -> dict[str, Any]:
    """A row's options (none when they are not a JSON object: a fix replaces them)."""
    try:
        loaded = json.loads(stored)
    except ValueError:
        return {}
    return loaded if isinstance(loaded, dict) else {}


class ScheduleForm(forms.ModelForm):  # type: ignore[type-arg]
    """A schedule as ``sqlinbox schedules add`` takes it."""

    when = forms.CharField(help_text="every:SECONDS, crontab:'M H DOW DOM MOY' or "
                           "solar:EVENT:LAT:LON")
    arguments = forms.CharField(required=False, initial="[]", help_text="a JSON list")
    keyword_arguments = forms.CharField(required=False, initial="{}",
                                        help_text="a JSON object")
    queue = forms.CharField(required=False, help_text="the task's route when empty")
    misfire = forms.ChoiceField(choices=[(each, each) for each in MISFIRE], initial="skip",
                                help_text="missed ticks: skip them, or run one catch-up")
    grace = forms.FloatField(min_value=0, initial=DEFAULT_GRACE,
                             help_text="seconds an occurrence may run late under skip")
    enabled = forms.TypedChoiceField(choices=Schedule._meta.get_field("enabled").choices,
                                     coerce=int, initial=1)

    class Meta:
        model = Schedule
        fields = ["name", "task", "misfire", "grace", "enabled"]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        stored = self.instance
        if stored.pk and stored.spec:
            self.initial.update(
                when=_timing(stored.kind, stored.spec), arguments=stored.args,
                keyword_arguments=stored.kwargs,
                queue=_options(stored.options).get("queue") or "")

    def clean_when(self) -> Any:
        try:
            return parse(self.cleaned_data["when"], current_app)
        except ScheduleError as exc:
            raise forms.ValidationError(str(exc)) from None

    def clean_arguments(self) -> Any:
        return _json(self.cleaned_data["arguments"], list, "arguments")

    def clean_keyword_arguments(self) -> Any:
        return _json(self.cleaned_data["keyword_arguments"], dict, "keyword arguments")


def _moment(seconds: float | None) -> datetime | None:
    return None if seconds is None else datetime.fromtimestamp(seconds, tz=timezone.utc)


@admin.register(Schedule)
class ScheduleAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    form = ScheduleForm
    list_display = ("name", "task", "timing", "enabled", "misfire", "last_run", "next_run",
                    "total_run_count")
    list_filter = ("enabled", "kind")
    #: the name as text: MariaDB and MySQL keep it as bytes, which LIKE compares case by case
    search_fields = ("name_text", "task")
    actions = ["pause", "resume"]

    def changeform_view(self, request: HttpRequest, *args: Any, **kwargs: Any
                        ) -> HttpResponse:
        with writing_first(request):
            return super().changeform_view(request, *args, **kwargs)

    def delete_view(self, request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        with writing_first(request):
            return super().delete_view(request, *args, **kwargs)

    def get_search_results(self, request: HttpRequest, queryset: QuerySet[Schedule],
                           search_term: str) -> tuple[QuerySet[Schedule], bool]:
        named = queryset.annotate(name_text=Cast("name", TextField()))
        found: tuple[QuerySet[Schedule], bool] = super().get_search_results(
            request, named, search_term)
        return found

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> tuple[str, ...]:
        return ("name",) if obj is not None else ()

    @admin.display(description="schedule")
    def timing(self, obj: Schedule) -> str:
        return _timing(obj.kind, obj.spec)

    @admin.display(description="last run", ordering="last_run_at")
    def last_run(self, obj: Schedule) -> datetime | None:
        return _moment(obj.last_run_at)

    @admin.display(description="next run", ordering="next_run_at")
    def next_run(self, obj: Schedule) -> datetime | None:
        return _moment(obj.next_run_at)

    def save_model(self, request: HttpRequest, obj: Schedule, form: Any, change: bool) -> None:
        """Through the scheduler's API: its next run by the database's clock; on a change,
        the options the admin does not show (from ``beat_schedule``, say) kept."""
        data = form.cleaned_data
        options = _options(obj.options) if change else {}
        options.pop("queue", None)
        if data["queue"]:
            options["queue"] = data["queue"]
        with changing() as store:
            store.add(obj.name, data["task"], data["when"], data["arguments"],
                      data["keyword_arguments"], options, data["misfire"], data["grace"],
                      enabled=bool(data["enabled"]), replace=change)
            if change:  # a replaced definition keeps its flag
                (store.resume if data["enabled"] else store.pause)(obj.name)

    def delete_model(self, request: HttpRequest, obj: Schedule) -> None:
        with changing() as store:
            store.remove(obj.name)

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[Schedule]) -> None:
        with changing() as store:
            for name in queryset.values_list("name", flat=True):
                store.remove(name)

    @admin.action(description="Pause the selected schedules")
    def pause(self, request: HttpRequest, queryset: QuerySet[Schedule]) -> None:
        self._switch(request, queryset, "pause")

    @admin.action(description="Resume the selected schedules")
    def resume(self, request: HttpRequest, queryset: QuerySet[Schedule]) -> None:
        self._switch(request, queryset, "resume")

    def _switch(self, request: HttpRequest, queryset: QuerySet[Schedule], verb: str) -> None:
        with changing() as store:
            done = sum(getattr(store, verb)(name)
                       for name in queryset.values_list("name", flat=True))
        self.message_user(request, f"{done} schedule(s) {verb}d.", messages.SUCCESS)
