"""The schedule computation: Celery's schedules stored as a kind and a JSON spec and read
back, their next occurrence from a given time (not this host's clock), and a tick's
decision under each misfire policy."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from celery.schedules import crontab, schedule, solar

from celery_ext.schedule_times import (
    ScheduleError,
    check_misfire,
    decide,
    decode,
    encode,
    next_after,
    parse,
)

NINE = datetime(2026, 1, 5, 9, 0, 30, tzinfo=timezone.utc).timestamp()


def test_schedules_survive_storing_as_json() -> None:
    assert decode(*encode(12.5)) == schedule(timedelta(seconds=12.5))
    assert decode(*encode(crontab(minute={0, 30}, hour="3"))) == crontab(minute="0,30", hour=3)
    assert decode(*encode(solar("sunrise", 52.0, 4.0))) == solar("sunrise", 52.0, 4.0)
    with pytest.raises(ScheduleError, match="positive"):
        encode(0)
    for endless in (float("inf"), float("nan")):
        with pytest.raises(ScheduleError, match="an interval must be a number of seconds"):
            encode(endless)
    with pytest.raises(ScheduleError, match="unknown schedule kind"):
        decode("lunar", "{}")


def test_the_next_occurrence_is_computed_from_the_time_given() -> None:
    assert next_after(schedule(10.0), NINE) == NINE + 10
    quarter = datetime(2026, 1, 5, 9, 15, tzinfo=timezone.utc).timestamp()
    assert next_after(crontab(minute="*/15"), NINE) == quarter
    sunrise = next_after(solar("sunrise", 52.0, 4.0), NINE)
    assert datetime.fromtimestamp(sunrise, timezone.utc).date().day == 6


@pytest.mark.parametrize("misfire, late, sends", [
    ("skip", 0.5, True), ("skip", 5.0, False), ("catch_up", 5.0, True),
    ("catch_up", 0.5, True)])
def test_a_tick_sends_the_latest_occurrence_on_time_or_by_its_policy(
        misfire: str, late: float, sends: bool) -> None:
    # due at NINE, every 10 s, reached ``late`` seconds after the third occurrence
    decision = decide(schedule(10.0), NINE, NINE + 20 + late, misfire, grace=1.0)
    assert decision.send is sends
    assert decision.next_run_at == NINE + 30


def test_a_crontab_missed_for_long_runs_its_latest_occurrence_within_the_grace() -> None:
    hourly = crontab(minute=0)
    month_ago = NINE - 30 * 86_400 - 30  # an occurrence, 720 hours back
    assert decide(hourly, month_ago, NINE, "skip", grace=60.0).send is True  # 09:00, 30 s late
    assert decide(hourly, month_ago, NINE, "skip", grace=10.0).send is False
    # past the walk's bound (43,200 minutes) every occurrence counts as missed
    decision = decide(crontab(), month_ago, NINE, "skip", grace=60.0)
    assert decision.send is False
    assert decision.next_run_at == NINE + 30
    assert decide(crontab(), month_ago, NINE, "catch_up", grace=60.0).send is True


def test_schedules_as_the_command_line_gives_them() -> None:
    assert parse("every:5") == schedule(5.0)
    assert parse("crontab:0 3") == crontab(minute=0, hour=3)
    assert parse("solar:sunset:52:4") == solar("sunset", 52.0, 4.0)
    with pytest.raises(ScheduleError, match="every:SECONDS"):
        parse("hourly")
    with pytest.raises(ScheduleError, match="misfire"):
        check_misfire("later", 1.0)
    with pytest.raises(ScheduleError, match="grace"):
        check_misfire("skip", -1.0)
