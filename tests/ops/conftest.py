"""Fixtures of the operations tests: the app, real rows in every state, the CLI run as a
user's shell runs it (in the test's process: :mod:`tests.ops.runner`)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from kombu_sqlinbox.broker import Broker
from kombu_sqlinbox.operations import Operations
from kombu_sqlinbox.options import parse_options
from kombu_sqlinbox.rows import Held
from tests.ops.apps import BROKER_ENV, PREFIX_ENV, RUNS_ENV, make_app, transport_options
from tests.ops.runner import invoke

#: the CLI's own limit: every command here finishes in seconds
CLI_LIMIT = 120.0
#: the console script the distribution installs beside this interpreter
SQLINBOX = str(Path(sys.executable).with_name("sqlinbox"))

Cli = Callable[..., subprocess.CompletedProcess[str]]
@pytest.fixture
def ops_env(broker_url: str, table_prefix: str, tmp_path: Path) -> dict[str, str]:
    runs = tmp_path / "runs"
    runs.mkdir()
    return {BROKER_ENV: broker_url, PREFIX_ENV: table_prefix, RUNS_ENV: str(runs)}


@pytest.fixture
def app(broker_url: str, table_prefix: str) -> Celery:
    return make_app(broker_url, table_prefix)


@pytest.fixture
def ops(broker_url: str, table_prefix: str, app: Celery) -> Iterator[Operations]:
    """The operations on the test's database, with the app's options and queues."""
    made = Operations(broker_url, parse_options(transport_options(table_prefix)),
                      list(app.amqp.queues))
    yield made
    made.close()


def standalone_options(prefix: str, **more: Any) -> str:
    """The app's transport options (and ``more``) as ``--transport-options`` JSON (the
    FIFO table by its import path)."""
    options = {**transport_options(prefix), **more}
    options["queues"]["fifo"]["table"] = "tests.ops.apps:FIFO"
    return json.dumps(options)


@pytest.fixture
def cli(ops_env: dict[str, str], db_url: str, table_prefix: str) -> Cli:
    """Run ``celery -A tests.ops.apps sqlinbox ARGS`` in this process (or, ``standalone``,
    the ``sqlinbox`` console script's group with ``--url`` and ``--transport-options``:
    the app's and ``more``, or ``options`` alone under this test's prefix; ``--url url``
    in place of the test's database URL) and return what it did; ``check`` (the default)
    fails the test on a non-zero exit."""

    def run(*args: str, standalone: bool = False, stdin: str | None = None,
            check: bool = True, options: dict[str, object] | None = None,
            more: dict[str, object] | None = None,
            url: str | None = None) -> subprocess.CompletedProcess[str]:
        url = url or db_url
        if options is not None:
            given = json.dumps({"table_prefix": table_prefix, **options})
            argv = ["sqlinbox", "--url", url, "--transport-options", given, *args]
        elif standalone or more:
            argv = ["sqlinbox", "--url", url, "--transport-options",
                    standalone_options(table_prefix, **(more or {})), *args]
        else:
            argv = ["celery", "-A", "tests.ops.apps", "sqlinbox", *args]
        done = invoke(argv, ops_env, stdin or "")
        if check and done.returncode != 0:
            raise AssertionError(f"{argv} exited {done.returncode}:\n{done.stdout}\n"
                                 f"{done.stderr}")
        return done

    return run


@dataclass
class Seeded:
    """What :func:`seeded` made, to check the figures against."""

    broker: Broker
    #: figures by queue: ready, delayed, in_work, blocked, blocked_groups, lapsed
    expected: dict[str, dict[str, int]]
    #: the dead letters' task names, in the order they died
    dead_tasks: list[str]


@pytest.fixture
def seeded(app: Celery) -> Iterator[Seeded]:
    """Real rows in every state, made the way a worker makes them: four dead letters in
    ``jobs.dead`` (two rejected ``ops.add``, one ``ops.fail``, one whose JSON body does
    not parse); in ``jobs`` four ready (one of them a lapsed lease: a worker that died),
    two delayed, two in work; in ``fifo`` group A's head in work with two rows behind
    it, group B's only row ready."""
    with app.connection_for_write() as conn:
        broker: Broker = conn.default_channel.broker
        jobs = broker.table("jobs")
        app.send_task("ops.add", (1, 2), queue="jobs")
        app.send_task("ops.fail", queue="jobs")
        app.send_task("ops.add", (3, 4), queue="jobs")
        with app.producer_or_acquire() as producer:
            producer.publish(b"{not json", routing_key="jobs", content_type="application/json",
                             content_encoding="utf-8", headers={"task": "ops.add", "id": "t-bad"})
        for row in broker.claim(jobs, 4):
            broker.reject(Held(jobs, row.id, row.attempt), row, requeue=False)
        for n in range(6):
            app.send_task("ops.add", (n, n), queue="jobs")
        for n in range(2):
            app.send_task("ops.add", (n, 0), queue="jobs", countdown=3600)
        assert len(broker.claim(jobs, 2)) == 2
        # a claim whose worker never extends it: lapsed at once, claimable again
        lapsed = broker.run(lambda db: broker.dialect.claim(db, jobs.spec, 1, lease=0.001))
        assert len(lapsed) == 1
        fifo = broker.table("fifo")
        for group in ("A", "A", "A", "B"):
            app.send_task("ops.add", (0, 0), queue="fifo", headers={"group_key": group})
        assert len(broker.claim(fifo, 1)) == 1  # A's head: A's others wait behind it
        yield Seeded(broker, {
            "jobs": {"ready": 4, "delayed": 2, "in_work": 2, "blocked": 0,
                     "blocked_groups": 0, "lapsed": 1},
            "fifo": {"ready": 1, "delayed": 0, "in_work": 1, "blocked": 2,
                     "blocked_groups": 1, "lapsed": 0},
            "jobs.dead": {"ready": 4, "delayed": 0, "in_work": 0, "blocked": 0,
                          "blocked_groups": 0, "lapsed": 0},
        }, ["ops.add", "ops.fail", "ops.add", "ops.add"])
