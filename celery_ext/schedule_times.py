"""When a stored schedule runs: Celery's schedule objects (interval, crontab, solar) kept
as a kind and a JSON spec, and the decision a tick makes from the time it fell due and
the database's now. Pure: no database, no clock of this host.

A schedule is stored by its definition, not pickled: the row reads in SQL and survives an
upgrade of Celery or of Python.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

from celery.schedules import BaseSchedule, ParseException, crontab, schedule, solar

#: what a tick does with occurrences no scheduler reached in time: skip them (the latest
#: runs if it is at most ``grace`` seconds late), or run one catch-up for them all
MISFIRE = ("skip", "catch_up")
#: how late (seconds) an occurrence may run under ``skip``, unless a schedule says
DEFAULT_GRACE = 60.0
#: occurrences walked to find the latest one due; a longer gap counts as missed
MAX_STEPS = 10_000
#: crontab's fields, in Celery's order
CRON_FIELDS = ("minute", "hour", "day_of_week", "day_of_month", "month_of_year")
#: the longest schedule name (characters): the name is a key every database holds whole
NAME_LIMIT = 255


class ScheduleError(ValueError):
    """A schedule that cannot be stored or read back."""


def _cron_field(value: Any) -> str:
    """A crontab field as text crontab parses again (``{0, 30}`` as ``0,30``)."""
    if isinstance(value, (set, frozenset, list, tuple, range)):
        return ",".join(str(part) for part in sorted(value))
    return str(value)


def encode(given: BaseSchedule | timedelta | float) -> tuple[str, str]:
    """``(kind, spec)`` of a schedule as Celery's ``beat_schedule`` takes it (a number of
    seconds or a timedelta is an interval)."""
    if isinstance(given, (int, float, timedelta)):
        try:
            given = schedule(given)
        except (OverflowError, ValueError):  # infinite, NaN
            raise ScheduleError(f"an interval must be a number of seconds, not {given!r}"
                                ) from None
    if isinstance(given, crontab):
        fields = {name: _cron_field(getattr(given, f"_orig_{name}")) for name in CRON_FIELDS}
        return "crontab", json.dumps(fields)
    if isinstance(given, solar):
        return "solar", json.dumps({"event": given.event, "lat": given.lat, "lon": given.lon})
    if type(given) is schedule:
        seconds = given.run_every.total_seconds()
        if seconds <= 0:
            raise ScheduleError(f"an interval must be positive, not {seconds} seconds")
        return "interval", json.dumps({"every": seconds})
    raise ScheduleError(f"cannot store {given!r}: an interval, a crontab or a solar "
                        "schedule is needed")


def decode(kind: str, spec: str, app: Any = None) -> BaseSchedule:
    """The Celery schedule of a stored ``(kind, spec)`` (crontabs in ``app``'s timezone)."""
    fields = json.loads(spec)
    if kind == "interval":
        return schedule(timedelta(seconds=fields["every"]), app=app)
    if kind == "crontab":
        return crontab(**fields, app=app)
    if kind == "solar":
        return solar(fields["event"], fields["lat"], fields["lon"], app=app)
    raise ScheduleError(f"unknown schedule kind {kind!r}")


def parse(text: str, app: Any = None) -> BaseSchedule:
    """A schedule as the command line gives it: ``every:SECONDS``, ``crontab:M H DOW DOM
    MOY`` (fields omitted from the end are ``*``), ``solar:EVENT:LAT:LON``."""
    kind, _, rest = text.partition(":")
    if kind == "crontab" and len(rest.split()) > len(CRON_FIELDS):
        raise ScheduleError(f"{text!r}: a crontab has at most {len(CRON_FIELDS)} fields "
                            "(M H DOW DOM MOY)")
    try:
        if kind == "every":
            return schedule(timedelta(seconds=float(rest)), app=app)
        if kind == "crontab":
            return crontab(*rest.split(), app=app)  # fields left out are *
        if kind == "solar":
            event, lat, lon = rest.split(":")
            return solar(event, float(lat), float(lon), app=app)
    except (ValueError, TypeError, OverflowError, ParseException) as exc:
        raise ScheduleError(f"{text!r}: {exc}") from None
    raise ScheduleError(f"{text!r}: give every:SECONDS, crontab:'M H DOW DOM MOY' or "
                        "solar:EVENT:LAT:LON")


def _at(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, timezone.utc)


def next_after(given: BaseSchedule, moment: float) -> float:
    """The schedule's first occurrence after ``moment`` (epoch seconds): an interval's
    ``every`` later, a crontab's or solar event's next one. Celery's own computation,
    its "now" set to ``moment`` rather than this host's clock."""
    if type(given) is schedule:
        return moment + float(given.run_every.total_seconds())
    at = _at(moment)
    given.nowfun = lambda: at
    return moment + max(float(given.remaining_estimate(at).total_seconds()), 1e-6)


@dataclass(frozen=True)
class Decision:
    """What a tick does with a schedule due: send its task or not, and when it runs next
    (the first occurrence after now)."""

    send: bool
    next_run_at: float


def latest_due(given: BaseSchedule, due: float, now: float) -> float | None:
    """The schedule's latest occurrence at or before ``now``, walking from ``due`` (None
    past :data:`MAX_STEPS` occurrences)."""
    if type(given) is schedule:
        every = float(given.run_every.total_seconds())
        return due + math.floor((now - due) / every) * every
    latest = due
    for _ in range(MAX_STEPS):
        following = next_after(given, latest)
        if following > now:
            return latest
        latest = following
    return None


def decide(given: BaseSchedule, due: float, now: float, misfire: str, grace: float) -> Decision:
    """A tick at ``now`` of a schedule due at ``due`` (at most ``now``): the latest
    occurrence due runs if it is at most ``grace`` seconds late; occurrences before it were
    missed: skipped, or under ``catch_up`` folded into the one run (which then happens
    however late). Either way one task at most, and the schedule moves past ``now``."""
    latest = latest_due(given, due, now)
    following = next_after(given, now if latest is None else latest)
    on_time = latest is not None and now - latest <= grace
    return Decision(send=on_time or misfire == "catch_up", next_run_at=following)


def first_run(given: BaseSchedule, now: float) -> float:
    """When a schedule added at ``now`` first runs: an interval ``every`` from now (as
    Celery's beat does), a crontab or solar event at its next occurrence."""
    return next_after(given, now)


def check_name(name: str) -> None:
    """Refuse a name a table cannot hold as given (MySQL would cut it, PostgreSQL refuse
    it as a driver error)."""
    if not 0 < len(name) <= NAME_LIMIT or "\0" in name:
        shown = repr(name) if len(name) <= 40 else f"{name[:40]!r}... ({len(name)} characters)"
        raise ScheduleError(f"a schedule's name is 1 to {NAME_LIMIT} characters, none of "
                            f"them NUL, not {shown}")


def check_misfire(misfire: str, grace: float) -> None:
    if misfire not in MISFIRE:
        raise ScheduleError(f"misfire must be one of {', '.join(MISFIRE)}, not {misfire!r}")
    if not 0 <= grace < math.inf:
        raise ScheduleError(f"the misfire grace must be 0 seconds or more (and finite), "
                            f"not {grace}")


