"""The database scheduler where production goes wrong: a schedule no scheduler can read, a
schedule held by another scheduler, names the databases compare differently, values a
column cannot hold, a session the server ends under a running beat."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import sys
import time
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path

import pytest
from sqlalchemy import bindparam, text
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError

from bench.chaos_faults import group_ports
from celery_ext.beat import BUSY_WAIT, TICK_IDLE_LIMIT, DatabaseScheduler, Schedules
from celery_ext.schedule_times import ScheduleError
from tests.acceptance.apps import tasks
from tests.processes import Processes, wait_until

from .beat_support import make_app, sent_ids, stall

SPAWN = multiprocessing.get_context("spawn")
#: a real ``celery beat`` with the database scheduler, on the acceptance tests' app
BEAT = [sys.executable, "-m", "celery", "-A", "tests.acceptance.apps.tasks", "beat", "-S",
        "celery_ext.beat:DatabaseScheduler", "-l", "info"]


@pytest.fixture
def store(broker_url: str, table_prefix: str) -> Iterator[Schedules]:
    made = Schedules.for_app(make_app(broker_url, table_prefix))
    yield made
    made.close()


def beat_env(broker_url: str, prefix: str, tmp_path: Path) -> dict[str, str]:
    """The environment of a ``celery beat`` on this test's tables (unbuffered: its log is
    read while it runs)."""
    return {tasks.BROKER_ENV: broker_url, tasks.RUNS_ENV: str(tmp_path / "runs"),
            tasks.OPTIONS_ENV: json.dumps({"table_prefix": prefix, "polling_interval": 0.1}),
            tasks.CONF_ENV: json.dumps({"task_default_queue": "beat"}),
            "PYTHONUNBUFFERED": "1"}


def set_column(store: Schedules, name: str, column: str, value: str) -> None:
    """A schedule's row changed by hand (an operator's SQL, a newer version's kind)."""
    table = store.dialect.quote(store.sql.names[0])
    store.database.run(lambda conn: conn.execute(
        text(f"UPDATE {table} SET {column} = :value WHERE name = :name"),
        {"value": value, "name": name}))


def test_a_schedule_that_cannot_be_read_is_logged_and_the_others_still_sent(
        store: Schedules, broker_url: str, table_prefix: str, processes: Processes,
        tmp_path: Path) -> None:
    store.add("odd", "beat.odd", 0.2)
    set_column(store, "odd", "kind", "weekly")
    store.add("ping", "beat.ping", 0.3)
    beat = processes.spawn("beat", BEAT, beat_env(broker_url, table_prefix, tmp_path))
    started = time.monotonic()
    wait_until(lambda: len(store.ticks("ping")) >= 3, 60, "three ticks of ping",
               alive=[beat])
    logged = beat.output().count("schedule 'odd' cannot be read: unknown schedule kind "
                                 "'weekly'")
    ticks, seconds = len(store.ticks("ping")), time.monotonic() - started
    # logged at each tick: ping's, and one each BUSY_WAIT for it (not a spin)
    assert 1 <= logged <= ticks + seconds / BUSY_WAIT + 2, (logged, ticks, seconds)
    assert store.ticks("odd") == []


@pytest.mark.databases("postgresql", "mysql")
def test_a_scheduler_waits_while_another_holds_a_due_schedule(
        store: Schedules, broker_url: str, table_prefix: str) -> None:
    scheduler = DatabaseScheduler(make_app(broker_url, table_prefix))
    due = store.add("ping", "beat.ping", 0.2).next_run_at
    wait_until(lambda: store.now() > due, 10, "the schedule to fall due")
    table = store.dialect.quote(store.sql.names[0])
    try:
        with store.database.engine.connect() as conn, conn.begin():
            # another scheduler's tick holds the schedule
            conn.execute(text(f"SELECT name FROM {table} WHERE name = 'ping' FOR UPDATE"))
            assert scheduler.tick() == BUSY_WAIT
        scheduler.tick()
        # the held tick sent once it was free (a slow send may let the next fall due too)
        ticks = store.ticks("ping")
        assert ticks[0].due == pytest.approx(due, abs=0.001)
        assert len({tick.due for tick in ticks}) == len(ticks)
    finally:
        scheduler.close()


@pytest.mark.drivers
def test_names_differing_in_case_or_trailing_spaces_are_different_schedules(
        store: Schedules) -> None:
    for name, every in (("ping", 30.0), ("Ping", 60.0), ("ping ", 90.0)):
        store.add(name, "beat.ping", every)
    assert {(each.name, each.spec) for each in store.all()} == {
        ("ping", '{"every": 30.0}'), ("Ping", '{"every": 60.0}'), ("ping ", '{"every": 90.0}')}
    assert not store.pause("PING") and store.pause("Ping")
    assert [each.name for each in store.all() if not each.enabled] == ["Ping"]


@pytest.mark.drivers
def test_a_name_a_table_cannot_hold_is_refused_and_the_longest_kept_whole(
        store: Schedules) -> None:
    for name in ("x" * 256, "a\0b", ""):
        with pytest.raises(ScheduleError, match="a schedule's name is 1 to 255 characters"):
            store.add(name, "beat.x", 30.0)
    longest = "\N{GRINNING FACE}" * 255  # 1020 bytes of UTF-8
    assert store.add(longest, "beat.x", 30.0).name == longest
    assert [each.name for each in store.all()] == [longest]


@pytest.mark.drivers
def test_arguments_of_any_size_are_stored_whole(store: Schedules) -> None:
    blob = "x" * 100_000
    assert store.add("big", "beat.big", 30.0, kwargs={"blob": blob}).kwargs == {"blob": blob}


#: a server's sessions from these client ports, and how to end one
SESSIONS = {"postgresql": ("SELECT pid FROM pg_stat_activity WHERE client_port IN :ports",
                           "SELECT pg_terminate_backend({})"),
            "mysql": ("SELECT id FROM information_schema.processlist WHERE "
                      "SUBSTRING_INDEX(host, ':', -1) IN :ports", "KILL {}")}


@pytest.mark.databases("postgresql", "mysql")  # SQLite has no session to end
def test_a_running_beat_whose_sessions_the_server_ends_sends_on_once(
        store: Schedules, broker_url: str, table_prefix: str, processes: Processes,
        tmp_path: Path, engine: Engine, database: str) -> None:
    store.add("ping", "beat.ping", 0.3)
    beat = processes.spawn("beat", BEAT, beat_env(broker_url, table_prefix, tmp_path))
    wait_until(lambda: len(store.ticks("ping")) >= 3, 60, "three ticks", alive=[beat])
    find, end = SESSIONS[database]
    for _ in range(3):  # as a server restart would, between and during ticks
        ports = [str(port) for port in group_ports(beat.popen.pid)]
        with engine.connect() as conn:
            ended = conn.execute(text(find).bindparams(bindparam("ports", expanding=True)),
                                 {"ports": ports}).scalars().all()
            assert ended, "the beat's sessions"
            for session in ended:
                with contextlib.suppress(DBAPIError):  # ended on its own meanwhile
                    conn.execute(text(end.format(int(session))))
        before = len(store.ticks("ping"))
        wait_until(lambda at=before: len(store.ticks("ping")) >= at + 3, 60, "three more ticks",
                   alive=[beat])
    beat.kill()
    dues = [tick.due for tick in store.ticks("ping")]
    steps = [(b - a) / 0.3 for a, b in pairwise(dues)]
    assert all(step > 0.5 and abs(step - round(step)) < 1e-6 for step in steps), dues
    assert sorted(sent_ids(broker_url, table_prefix)) == sorted(
        str(tick.task_id) for tick in store.ticks("ping"))


@pytest.mark.databases("postgresql", "mysql")  # SQLite: one writer, its lock the file's
def test_a_scheduler_frozen_mid_tick_does_not_hold_its_schedules_for_ever(
        store: Schedules, broker_url: str, table_prefix: str, tmp_path: Path) -> None:
    due = store.add("nightly", "beat.nightly", 1.0).next_run_at
    flag = tmp_path / "flag"
    frozen = SPAWN.Process(target=stall, args=(broker_url, table_prefix, str(flag)))
    frozen.start()
    try:
        wait_until(flag.exists, 60, "the scheduler to stop inside its tick")
        # the server ends the frozen scheduler's session: its tick is sent by another
        sent = wait_until(store.run_due, TICK_IDLE_LIMIT + 30, "another scheduler's tick",
                          interval=0.5)
        assert sent == ["nightly"]
        assert [tick.due for tick in store.ticks("nightly")] == [due]
        assert len(sent_ids(broker_url, table_prefix)) == 1
    finally:
        frozen.kill()
        frozen.join(10)
