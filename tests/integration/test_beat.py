"""The database scheduler on every database: each tick sent exactly once however many
scheduler processes race, a scheduler killed mid-tick sends all or nothing, misfire
policies, pause and resume, and Celery's ``beat_schedule`` loaded into the table."""

from __future__ import annotations

import multiprocessing
import os
import signal
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from celery.schedules import crontab
from sqlalchemy import event

from celery_ext.beat import TICK_RETENTION, DatabaseScheduler, Schedules
from celery_ext.schedule_times import ScheduleError
from kombu_sqlinbox import clock
from kombu_sqlinbox.errors import ConfigurationError
from kombu_sqlinbox.urls import sqlalchemy_url
from tests.processes import wait_until
from tests.tcp_proxy import Proxy

from .beat_support import make_app, race, sent_ids, stall

SPAWN = multiprocessing.get_context("spawn")


@pytest.fixture
def store(broker_url: str, table_prefix: str) -> Iterator[Schedules]:
    made = Schedules.for_app(make_app(broker_url, table_prefix))
    yield made
    made.close()


@pytest.fixture
def pinned(db_url: str, broker_url: str, table_prefix: str) -> Iterator[
        tuple[Schedules, clock.Clock]]:
    """Schedules whose database time this test moves (the dialects made after the clock
    is installed read it)."""
    url = sqlalchemy_url(db_url)
    made_clock = clock.install(url)
    made_clock.pin()
    made = Schedules.for_app(make_app(broker_url, table_prefix))
    yield made, made_clock
    made.close()
    clock.uninstall(url)


def test_racing_schedulers_send_each_tick_once(store: Schedules, broker_url: str,
                                               table_prefix: str, tmp_path: Path) -> None:
    # the queue's tables made before the race: several processes making them at once on
    # PostgreSQL fail their first tick (beat logs it and ticks again; race() would exit)
    assert sent_ids(broker_url, table_prefix) == []
    readies, go = [SPAWN.Event() for _ in range(3)], SPAWN.Event()
    # 4 s of racing: a 0.2 s schedule falls due about 20 times, 4 at the least even when a
    # loaded machine starves the schedulers for a second at a time (2 s gave 3 in CI)
    procs = [SPAWN.Process(target=race, args=(broker_url, table_prefix, ready, go, 4.0,
                                              str(tmp_path / f"sent{n}")))
             for n, ready in enumerate(readies)]
    for proc in procs:
        proc.start()
    for ready in readies:
        assert ready.wait(60)
    store.add("fast", "beat.fast", 0.2)
    store.add("slow", "beat.slow", 0.5, misfire="catch_up")
    go.set()
    for proc in procs:
        proc.join(60)
        assert proc.exitcode == 0
    ticks = {name: store.ticks(name) for name in ("fast", "slow")}
    ids = sent_ids(broker_url, table_prefix)
    # one task per tick, each tick's own, and each process's count adds up to them
    assert sorted(ids) == sorted(str(t.task_id) for each in ticks.values() for t in each)
    assert len(ids) == len(set(ids))
    assert sum(int((tmp_path / f"sent{n}").read_text()) for n in range(3)) == len(ids)
    # ticks on the schedule's grid, each once (a scheduler late by a whole interval
    # sends one tick for the occurrences due, not one each)
    for name, every, least in (("fast", 0.2, 4), ("slow", 0.5, 2)):
        dues = [t.due for t in ticks[name]]
        assert len(dues) >= least, (name, dues)
        steps = [(b - a) / every for a, b in pairwise(dues)]
        assert all(step > 0.5 and abs(step - round(step)) < 1e-6 for step in steps), dues
        found = store.get(name)
        assert found is not None and found.total_run_count == len(dues)


def test_a_scheduler_killed_mid_tick_sent_nothing_and_the_tick_runs_once(
        store: Schedules, broker_url: str, table_prefix: str, tmp_path: Path) -> None:
    due = store.add("nightly", "beat.nightly", 1.0).next_run_at
    flag = tmp_path / "flag"
    proc = SPAWN.Process(target=stall, args=(broker_url, table_prefix, str(flag)))
    proc.start()
    wait_until(flag.exists, 60, "the scheduler to hold its tick's rows")
    os.kill(int(flag.read_text()), signal.SIGKILL)
    proc.join(10)
    assert store.ticks("nightly") == []
    assert sent_ids(broker_url, table_prefix) == []
    assert store.run_due() == ["nightly"]
    assert len(sent_ids(broker_url, table_prefix)) == 1
    assert [t.due for t in store.ticks("nightly")] == [due]


def test_a_tick_already_claimed_is_not_sent_again_and_the_schedule_moves_on(
        store: Schedules, broker_url: str, table_prefix: str) -> None:
    due = store.add("ping", "beat.ping", 0.2).next_run_at
    # another scheduler's claim of the tick, committed
    store.database.run(lambda conn: conn.execute(
        store.sql.claim, {"name": "ping", "due": due, "task_id": "theirs"}))
    wait_until(lambda: store.now() > due, 10, "the schedule to fall due")
    assert store.run_due() == []
    assert sent_ids(broker_url, table_prefix) == []
    found = store.get("ping")
    assert found is not None and found.next_run_at > due and found.total_run_count == 0
    assert [(t.due, t.task_id) for t in store.ticks("ping")] == [(due, "theirs")]


def test_a_task_that_cannot_be_sent_is_logged_and_its_tick_skipped(
        store: Schedules, broker_url: str, table_prefix: str,
        caplog: pytest.LogCaptureFixture) -> None:
    broken = store.add("broken", "beat.broken", 0.2, options={"serializer": "nope"})
    store.add("good", "beat.good", 0.2)
    wait_until(lambda: store.now() > broken.next_run_at + 0.2, 10, "both to fall due")
    assert store.run_due() == ["good"]
    assert "schedule broken: its task beat.broken could not be sent" in caplog.text
    assert len(sent_ids(broker_url, table_prefix)) == 1
    after = store.get("broken")
    assert after is not None and after.next_run_at > broken.next_run_at
    assert after.total_run_count == 0 and store.ticks("broken") == []


def test_old_ticks_are_pruned_and_arguments_json_cannot_hold_are_refused(
        pinned: tuple[Schedules, clock.Clock]) -> None:
    store, moment = pinned
    store.add("ping", "beat.ping", 10.0)
    moment.advance(10.0)
    assert store.run_due() == ["ping"]
    moment.advance(TICK_RETENTION - 1)
    assert store.prune() == 0 and len(store.ticks("ping")) == 1
    moment.advance(2.0)
    assert store.prune() == 1 and store.ticks("ping") == []
    with pytest.raises(ScheduleError, match="'odd': its arguments and options are stored"):
        store.add("odd", "beat.odd", 10.0, kwargs={"when": object()})
    assert store.get("odd") is None


@pytest.mark.parametrize("misfire, sent", [("skip", []), ("catch_up", ["late"])])
def test_a_missed_tick_follows_its_misfire_policy(
        pinned: tuple[Schedules, clock.Clock], broker_url: str, table_prefix: str,
        misfire: str, sent: list[str]) -> None:
    store, moment = pinned
    start = moment.value()
    assert start is not None
    store.add("late", "beat.late", 10.0, misfire=misfire, grace=1.0)
    moment.advance(35.0)  # due at +10, +20, +30: the last 5 s late
    assert store.run_due() == sent
    found = store.get("late")
    assert found is not None and found.next_run_at == pytest.approx(start + 40.0, abs=1e-3)
    assert found.total_run_count == len(sent)
    assert store.run_due() == []
    moment.advance(5.5)  # +40 half a second late: on time
    assert store.run_due() == ["late"]
    assert len(sent_ids(broker_url, table_prefix)) == len(sent) + 1
    found = store.get("late")
    assert found is not None and found.last_run_at == pytest.approx(start + 40.5, abs=1e-3)


def test_a_paused_schedule_sends_nothing_until_resumed(
        pinned: tuple[Schedules, clock.Clock], broker_url: str, table_prefix: str) -> None:
    store, moment = pinned
    store.add("report", "beat.report", crontab(minute="*"), misfire="catch_up")
    assert store.pause("report")
    moment.advance(180.0)
    assert store.run_due() == []
    found = store.get("report")
    assert found is not None and not found.enabled
    assert store.resume("report")
    assert store.run_due() == ["report"]  # the ticks missed while paused: one catch-up
    assert len(sent_ids(broker_url, table_prefix)) == 1
    assert not store.pause("nobody") and not store.resume("nobody")
    assert store.remove("report") and store.get("report") is None
    assert store.ticks("report") == []


def test_beat_schedule_is_loaded_keeping_the_enabled_flag_and_last_run(
        broker_url: str, table_prefix: str, store: Schedules) -> None:
    app = make_app(broker_url, table_prefix)
    app.conf.beat_schedule = {
        "ping": {"task": "beat.ping", "schedule": 30.0, "args": (1,)},
        "report": {"task": "beat.report", "schedule": crontab(minute=0, hour=3),
                   "misfire": "catch_up", "misfire_grace": 5},
    }
    DatabaseScheduler(app).close()
    loaded = {each.name: each for each in store.all()}
    assert loaded["ping"].args == [1] and loaded["ping"].enabled
    assert (loaded["report"].misfire, loaded["report"].grace) == ("catch_up", 5.0)
    store.pause("ping")
    ping_next = loaded["ping"].next_run_at
    app.conf.beat_schedule["ping"] = {"task": "beat.ping", "schedule": 30.0, "args": (2,)}
    app.conf.beat_schedule["report"] = {"task": "beat.report",
                                        "schedule": crontab(minute=30, hour=4)}
    scheduler = DatabaseScheduler(app)
    assert set(scheduler.schedule) == {"ping", "report"}
    scheduler.close()
    again = {each.name: each for each in store.all()}
    assert again["ping"].args == [2] and not again["ping"].enabled
    assert again["ping"].next_run_at == ping_next  # timing unchanged: next run kept
    assert again["report"].spec != loaded["report"].spec
    assert again["report"].misfire == "skip"


def test_a_scheduler_whose_broker_is_not_sqlinbox_refuses_to_start() -> None:
    app = Celery("elsewhere", broker="redis://127.0.0.1:6379/0", set_as_current=False)
    with pytest.raises(ConfigurationError, match="needs the sqlinbox transport as the broker"):
        DatabaseScheduler(app)


@pytest.mark.parametrize("database", ["postgresql", "mysql"], indirect=True)
def test_beat_survives_a_database_it_cannot_reach_and_a_lost_commit_reply(
        db_url: str, table_prefix: str, proxy: Proxy, store: Schedules,
        broker_url: str, caplog: pytest.LogCaptureFixture) -> None:
    app = make_app("sqlinbox+" + proxy.url(db_url), table_prefix)
    scheduler = DatabaseScheduler(app)
    due = store.add("ping", "beat.ping", 2.0).next_run_at
    try:
        with proxy.refuse():
            wait_until(lambda: store.now() > due, 10, "the schedule to fall due")
            assert scheduler.tick() == scheduler.max_interval
        assert "Scheduler: the database failed" in caplog.text
        assert store.ticks("ping") == []
        scheduler.tick()  # the tick then, on a database back (and the next, if a loaded
        # machine took more than the schedule's 2 s to get there)
        recovered = [t.due for t in store.ticks("ping")]
        assert recovered and len(recovered) == len(set(recovered)), recovered
        # a tick commits, its answer is lost: beat carries on, and never sends it twice
        following = store.get("ping")
        assert following is not None
        wait_until(lambda: store.now() > following.next_run_at, 10, "the next tick")
        proxy.cut_after_commit()
        scheduler.tick()  # raised inside and logged, or retried and found it done
        assert proxy.commits_cut == 1
        assert [t.due for t in store.ticks("ping")] == [*recovered, following.next_run_at]
        later = store.get("ping")
        assert later is not None
        wait_until(lambda: store.now() > later.next_run_at, 10, "the tick after")
        scheduler.tick()
        ticks = store.ticks("ping")
        assert [t.due for t in ticks] == [*recovered, following.next_run_at,
                                          later.next_run_at]
        assert sorted(sent_ids(broker_url, table_prefix)) == sorted(
            str(t.task_id) for t in ticks)
    finally:
        scheduler.close()


def test_a_schedule_falling_due_during_a_tick_is_sent_by_it_not_a_second_later(
        pinned: tuple[Schedules, clock.Clock], broker_url: str, table_prefix: str) -> None:
    store, moment = pinned
    scheduler = DatabaseScheduler(make_app(broker_url, table_prefix))
    assert scheduler.store is not None
    try:
        store.add("first", "beat.first", 10.0)
        moment.advance(0.004)  # due 4 ms after it: the tick reads the time before
        store.add("second", "beat.second", 10.0)
        moment.advance(10.0 - 0.002)
        moved = []

        def fall_due(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
            if "SET next_run_at" in statement and not moved:  # as the tick sends first
                moved.append(moment.advance(0.01))

        event.listen(scheduler.store.database.engine, "after_cursor_execute", fall_due)
        scheduler.tick()
        assert [len(store.ticks(name)) for name in ("first", "second")] == [1, 1]
    finally:
        scheduler.close()
