"""Nothing piles up: the reply queues of ``inspect ping`` callers and the event queue of a
monitor killed with ``kill -9`` leave the database, bindings and messages included, once
their expiry has passed. sqlinbox only: kombu's Redis transport keeps no queue expiry."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from kombu_sqlinbox.broker import sqlalchemy_url
from kombu_sqlinbox.brokers import close_all
from kombu_sqlinbox.dialects import dialect_for
from tests.remote.conftest import (
    HOST,
    REPLY_LIMIT,
    Cluster,
    at_once,
    cluster_on,
    example_app,
)

#: seconds the test's own reply queue and the monitor's event queue outlive their use
#: (``celery inspect`` run as a command keeps the example app's ten)
SHORT_EXPIRY = 2.0
PINGS = 50
#: the longest expiry, a sweep interval (5 s) and slack
GONE_LIMIT = 60.0


def transient_state(cluster: Cluster) -> dict[str, set[str]]:
    """The queues named in each routing table: the registry, the bindings, the messages."""
    engine = create_engine(sqlalchemy_url(cluster.broker_url.removeprefix("sqlinbox+")))
    quote = engine.dialect.identifier_preparer.quote
    name_text = dialect_for(engine).name_text  # MariaDB/MySQL: binary strings
    prefix = cluster.table_prefix
    try:
        with engine.connect() as conn:
            return {table: set(conn.execute(text(
                f"SELECT DISTINCT {name_text(column)} FROM {quote(prefix + table)}")).scalars())
                for table, column in (("queues", "name"), ("bindings", "queue"),
                                      ("transient", "queue"))}
    finally:
        engine.dispose()


def leftovers(cluster: Cluster, kept: dict[str, set[str]]) -> dict[str, set[str]]:
    """What the routing tables hold beyond ``kept`` (the worker's own)."""
    now = transient_state(cluster)
    return {table: names - kept[table] for table, names in now.items() if names - kept[table]}


@pytest.mark.parametrize("broker", ["postgresql", "mysql", "sqlite"])
def test_reply_and_event_queues_expire(broker: str, tmp_path: Path) -> None:
    with cluster_on(broker, tmp_path, lambda: False) as cluster:
        cluster.workers = cluster.start_workers(["a"])
        kept = transient_state(cluster)
        assert f"a@{HOST}.celery.pidbox" in kept["queues"], kept

        caller = example_app().make_app(cluster.broker_url, cluster.table_prefix)
        caller.conf.control_queue_expires = SHORT_EXPIRY
        for _ in range(PINGS):
            assert caller.control.ping(destination=[f"a@{HOST}"], timeout=REPLY_LIMIT) == [
                {f"a@{HOST}": {"ok": "pong"}}]
        ping = ("inspect", "ping", "-t", str(REPLY_LIMIT), "-d", f"a@{HOST}")
        for done in at_once([lambda: cluster.celery(*ping)] * 3):
            assert f"a@{HOST}: OK" in done.stdout
        # a caller that dies waiting for a reply that never comes leaves its reply queue
        waiting = cluster.spawn("waiting", "inspect", "ping", "-t", "60", "-d",
                                f"a@{HOST},nobody@{HOST}", PYTHONUNBUFFERED="1")
        cluster.wait(lambda: f"a@{HOST}: OK" in waiting.output(), "the first reply")
        monitor = cluster.processes.spawn(
            "monitor", [sys.executable, "-m", "tests.remote.receiver", str(SHORT_EXPIRY)],
            cluster.env)
        cluster.wait(lambda: "worker-heartbeat" in monitor.output(),
                     "the monitor to receive a heartbeat")
        during = leftovers(cluster, kept)
        assert any(name.startswith("celeryev.") for name in during["queues"]), during
        assert any(name.startswith("celeryev.") for name in during["bindings"]), during
        assert any(name.endswith(".reply.celery.pidbox") for name in during["queues"]), during

        waiting.kill()  # kill -9: their queues are left to expire
        monitor.kill()
        caller.close()
        close_all()  # nothing in this process keeps a queue alive
        cluster.wait(lambda: not leftovers(cluster, kept),
                     "the reply and event queues to be swept", timeout=GONE_LIMIT)
        assert f"a@{HOST}.celery.pidbox" in transient_state(cluster)["queues"]
