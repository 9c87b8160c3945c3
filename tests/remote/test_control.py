"""``celery inspect``, ``celery control`` and events against two real workers per broker.

The tests share the module's two workers (``a`` and ``b``) and run in file order; the
last one shuts a worker down. Every command under test is the ``celery`` command line as a
user runs it, in the example app's directory, naming the workers it asks, so that it
returns as soon as they replied, with a reply timeout longer than Celery's default second
(:data:`~tests.remote.conftest.REPLY_LIMIT`: a loaded worker can answer later); the
checks that follow a command ask through the Python API.
"""

from __future__ import annotations

import contextlib
import html
import itertools
import json
import os
import socket
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from functools import partial
from typing import Any

from sqlalchemy import event

from tests.processes import START_LIMIT, Proc, wait_until
from tests.remote.conftest import HOST, REPLY_LIMIT, Cluster, at_once

A, B = f"a@{HOST}", f"b@{HOST}"
TASKS = {"monitor.add", "monitor.fail", "monitor.mark", "monitor.hold", "monitor.paced",
         "monitor.hold_limited"}
#: a worker's heartbeats come every 2 s; a monitor takes it for offline after 4 s without
HEARTBEAT_LIMIT = 4.0
#: a queue without a consumer keeps its message at least this long (many poll intervals)
UNCONSUMED_WINDOW = 2.0
#: the thread that deletes an auto-deleted reply queue's rows
RENEWAL = "sqlinbox-renewal"


def test_inspect_ping_answers_for_both_workers(cluster: Cluster) -> None:
    out = cluster.celery("inspect", "ping", "-t", str(REPLY_LIMIT), "-d", f"{A},{B}").stdout
    assert f"{A}: OK" in out and f"{B}: OK" in out, out
    assert "2 nodes online." in out, out


def test_a_ping_declares_binds_and_deletes_its_reply_queue_once(cluster: Cluster) -> None:
    """kombu declares the reply queue as it publishes and again as it consumes, and deletes
    it after the replies although the cancel of its consumer (auto-delete) did: each
    registry write of these is done once a call, the deletes by the renewal thread once
    the call returned, and the reply comes (on Redis, which keeps no registry, the
    replies alone: the control)."""
    with cluster.app.connection_for_write() as conn:
        conn.ensure_connection()
        seen: list[str] = []
        registry = f"{cluster.table_prefix}queues"
        bindings = f"{cluster.table_prefix}bindings"
        with statements_of_this_thread(cluster, conn, seen):
            for _ in range(3):
                seen.clear()
                assert cluster.app.control.ping([A], timeout=REPLY_LIMIT, connection=conn) \
                    == [{A: {"ok": "pong"}}]
                if cluster.broker == "redis":
                    continue
                returned = Counter(line.replace("`", '"') for line in seen
                                   if registry in line or bindings in line)
                assert returned == {f'INSERT INTO "{registry}"': 1,
                                    f'INSERT INTO "{bindings}"': 1}, seen
                wait_until(lambda: f'DELETE FROM "{registry}"' in
                           [line.replace("`", '"') for line in seen], 10, "the deletes")
                writes = Counter(line.replace("`", '"') for line in seen
                                 if registry in line or bindings in line)
                assert writes == {**returned, f'DELETE FROM "{registry}"': 1,
                                  f'DELETE FROM "{bindings}"': 1}, seen


@contextlib.contextmanager
def statements_of_this_thread(cluster: Cluster, conn: Any, seen: list[str]) -> Iterator[None]:
    """Each statement's first three words that this thread or the renewal thread runs on
    the broker's engine (the event receiver's thread claims on the same engine);
    nothing on Redis."""
    if cluster.broker == "redis":
        yield
        return
    engine = conn.transport.broker.engine
    thread = threading.get_ident()

    def note(connection: Any, cursor: Any, statement: str, *args: Any) -> None:
        if threading.get_ident() == thread or threading.current_thread().name == RENEWAL:
            seen.append(" ".join(statement.split()[:3]))

    event.listen(engine, "before_cursor_execute", note)
    try:
        yield
    finally:
        event.remove(engine, "before_cursor_execute", note)


def test_inspect_active_and_query_task_show_a_running_task(cluster: Cluster) -> None:
    task_id = cluster.send("hold", "active")
    running = cluster.wait_marker("active", "started", "the held task to start")
    node = running["worker"]

    active = cluster.inspect("active")
    assert [task["id"] for task in active[node]] == [task_id], active
    assert [task["name"] for task in active[node]] == ["monitor.hold"], active
    queried = cluster.inspect("query_task", task_id)
    assert queried[node][task_id][0] == "active", queried

    cluster.release("active")
    cluster.wait_marker("active", "done", "the released task to finish")


def test_inspect_registered_stats_scheduled_queues_conf(cluster: Cluster) -> None:
    registered, stats, queues, conf = at_once([
        partial(cluster.inspect, command)
        for command in ("registered", "stats", "active_queues", "conf")])
    for node in (A, B):
        assert set(registered[node]) >= TASKS, registered
        assert stats[node]["pool"]["max-concurrency"] == 2, stats
        assert stats[node]["broker"]["transport"] == cluster.transport, stats
        assert [queue["name"] for queue in queues[node]] == ["celery"], queues
        assert conf[node]["task_send_sent_event"] is True, conf

    later = cluster.send("add", 1, 2, countdown=300)
    if cluster.broker == "redis":
        # Redis hands a countdown task to a worker at once, which keeps it until it is due
        scheduled = cluster.wait(lambda: {
            node: entry for node, entries in cluster.inspect("scheduled").items()
            for entry in entries if entry["request"]["id"] == later}, "the countdown task")
        assert next(iter(scheduled.values()))["request"]["name"] == "monitor.add"
    else:
        # sqlinbox keeps it a row of the queue's table until it is due: no worker holds it;
        # ``celery sqlinbox queues`` is where a user sees it (docs/monitoring.rst)
        assert cluster.queue_size("celery") == 1
        assert cluster.inspect("scheduled") == {A: [], B: []}
        figures = json.loads(cluster.celery("sqlinbox", "queues", "--json").stdout)
        (celery,) = [entry for entry in figures if entry["queue"] == "celery"]
        assert (celery["delayed"], celery["ready"]) == (1, 0), figures
    cluster.app.control.revoke(later)  # tidying up, through the API: no reply awaited


def test_events_follow_tasks_and_heartbeats_reach_the_monitor(cluster: Cluster) -> None:
    assert cluster.events is not None
    events = cluster.events
    good = cluster.send("add", 2, 3)
    bad = cluster.send("fail", "on purpose")
    lifecycle = {"task-sent", "task-received", "task-started"}
    cluster.wait(lambda: lifecycle | {"task-succeeded"} <= events.types_of(good),
                 "the events of a task that succeeds")
    cluster.wait(lambda: lifecycle | {"task-failed"} <= events.types_of(bad),
                 "the events of a task that fails")
    [succeeded] = events.of(uuid=good, type="task-succeeded")
    assert succeeded["result"] == "5"
    [failed] = events.of(uuid=bad, type="task-failed")
    assert "on purpose" in failed["exception"]

    for node in (A, B):
        cluster.wait(lambda node=node: len(events.of(type="worker-heartbeat", hostname=node))
                     >= 3, f"three heartbeats of {node}")
        received = [event["local_received"]
                    for event in events.of(type="worker-heartbeat", hostname=node)]
        gaps = [after - before for before, after in itertools.pairwise(received)]
        assert max(gaps) < HEARTBEAT_LIMIT, (node, gaps)


def test_revoked_task_never_runs_and_consumers_come_and_go(cluster: Cluster) -> None:
    """A task revoked while it waits in a queue nobody consumes is dropped when a worker
    starts consuming that queue (``add_consumer``), while a later one runs; after
    ``cancel_consumer`` the queue's next message stays put until another worker takes it."""
    events = cluster.events
    assert events is not None
    queue = f"{cluster.table_prefix}extra"
    revoked = cluster.send("mark", "revoked", queue=queue)
    out = cluster.control("revoke", revoked)
    assert out.count(f"tasks {{'{revoked}'}} flagged as revoked") == 2, out

    out = cluster.control("add_consumer", queue, destination=[A])
    assert f"add consumer {queue}" in out, out
    cluster.wait(lambda: "task-revoked" in events.types_of(revoked),
                 "the revoked task to be dropped")
    cluster.send("mark", "after-revoke", queue=queue)
    assert cluster.wait_marker("after-revoke", "ran", "a later task")["worker"] == A
    assert cluster.marker("revoked", "ran") is None, "a revoked task ran"

    out = cluster.control("cancel_consumer", queue, destination=[A])
    assert f"no longer consuming from {queue}" in out, out
    assert queue not in [q["name"] for q in cluster.ask("active_queues")[A]]
    cluster.send("mark", "after-cancel", queue=queue)
    deadline = time.monotonic() + UNCONSUMED_WINDOW
    while time.monotonic() < deadline:
        assert cluster.marker("after-cancel", "ran") is None, "ran after cancel_consumer"
        time.sleep(0.1)
    cluster.control("add_consumer", queue, destination=[B])
    assert cluster.wait_marker("after-cancel", "ran", "the waiting task")["worker"] == B
    cluster.app.control.cancel_consumer(queue, destination=[B])


def test_terminate_ends_a_running_task(cluster: Cluster) -> None:
    """``celery control terminate`` is ``revoke(terminate=True)``: the pool process
    running the task is killed and replaced."""
    task_id = cluster.send("hold", "terminated")
    running = cluster.wait_marker("terminated", "started", "the held task to start")
    out = cluster.control("terminate", "TERM", task_id)
    assert f"terminate: {task_id}" in out, out
    cluster.wait(lambda: not pid_exists(running["pid"]), "the pool process to end")
    assert cluster.marker("terminated", "done") is None
    assert task_id not in [task["id"] for task in cluster.ask("active")[running["worker"]]]


def test_rate_limit_spaces_runs(cluster: Cluster) -> None:
    """Five runs at two a second take at least a second on the worker that got three."""
    out = cluster.control("rate_limit", "monitor.paced", "2/s")
    assert out.count("new rate limit set successfully") == 2, out
    keys = [f"paced{n}" for n in range(5)]
    for key in keys:
        cluster.send("paced", key)
    runs = [cluster.wait_marker(key, "ran", f"{key} to run") for key in keys]
    for node in (A, B):
        times = sorted(run["at"] for run in runs if run["worker"] == node)
        if len(times) >= 3:
            assert times[-1] - times[0] >= 0.9, (node, times)
    assert max(sum(run["worker"] == node for run in runs) for node in (A, B)) >= 3


def test_time_limit_reaches_both_workers(cluster: Cluster) -> None:
    """The new limits land on the task in each worker (``inspect registered`` shows its
    attributes). Celery's prefork pool goes on using the limits it read at start-up, on
    every broker, so the test does not wait for one to fire."""
    out = cluster.control("time_limit", "monitor.hold_limited", "1", "30")
    assert out.count("time limits set successfully") == 2, out
    registered = cluster.inspect("registered", "soft_time_limit", "time_limit")
    for node in (A, B):
        assert "monitor.hold_limited [soft_time_limit=1.0 time_limit=30.0]" in registered[node]


def test_pool_grow_adds_a_process(cluster: Cluster) -> None:
    out = cluster.control("pool_grow", "1", destination=[A])
    assert "pool will grow" in out, out
    cluster.wait(lambda: len(cluster.ask("stats")[A]["pool"]["processes"]) == 3,
                 "a third pool process")
    cluster.app.control.pool_shrink(1, destination=[A])


def test_celery_events_dump_shows_heartbeats_and_a_task(cluster: Cluster) -> None:
    dump = cluster.spawn("events", "events", "--dump")
    try:
        # on start it asks the workers for a heartbeat: once both came, it consumes
        cluster.wait(lambda: all(f"{node} [" in line and "heartbeat" in line
                                 for node in (A, B) for line in [dump.output()]),
                     "both workers' heartbeats in celery events --dump")
        task_id = cluster.send("add", 4, 5)
        for kind in ("task sent", "task received", "task started", "task succeeded"):
            cluster.wait(lambda kind=kind: any(
                kind in line and f"monitor.add({task_id})" in line
                for line in dump.output().splitlines()), f"'{kind}' in the dump")
    finally:
        dump.kill()


def test_flower_lists_workers_and_tasks(cluster: Cluster) -> None:
    port = free_port()
    flower = cluster.spawn("flower", "flower", f"--port={port}", "--address=127.0.0.1",
                           FLOWER_UNAUTHENTICATED_API="true")
    base = f"http://127.0.0.1:{port}/api"
    try:
        def both() -> Any:
            workers = get_json(f"{base}/workers?refresh=1", flower)
            return workers if workers and {A, B} <= set(workers) else None

        workers = cluster.wait(both, "Flower to list both workers", timeout=60)
        assert all(workers[node]["registered"] for node in (A, B)), workers
        task_id = cluster.send("add", 20, 22)

        def succeeded() -> Any:
            task = (get_json(f"{base}/tasks", flower) or {}).get(task_id)
            return task if task and task["state"] == "SUCCESS" else None

        task = cluster.wait(succeeded, "Flower to show the task succeeded")
        assert task["name"] == "monitor.add" and task["result"] == "42", task
        assert task["worker"] in (A, B), task
        if cluster.broker != "redis":
            # Flower reads queue depth from RabbitMQ's or Redis' own API only: its Broker
            # tab and queue lengths refuse the broker, and the guide says what shows them
            for page in ("broker", "api/queues/length"):
                refused = http_error(f"http://127.0.0.1:{port}/{page}")
                said = html.unescape(refused.read().decode())
                assert refused.code == 404 and "'sqlinbox' broker is not supported" in said, (
                    page, refused.code, said)
            depth = cluster.celery("sqlinbox", "queues").stdout
            assert depth.startswith("queue ") and "\ncelery " in depth, depth
    finally:
        flower.kill()


def http_error(url: str) -> urllib.error.HTTPError:
    """The error status ``url`` answers with (the test fails on a success)."""
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            raise AssertionError(f"{url} answered {response.status}: {response.read()!r}")
    except urllib.error.HTTPError as refused:
        return refused


def test_beat_answers_ping(cluster: Cluster) -> None:
    beat = cluster.spawn("beat", "beat", "-s", str(cluster.tmp / "beat-schedule"), "-l", "info")
    try:
        wait_until(lambda: "beat pidbox: Connected to" in beat.output(), START_LIMIT,
                   "beat's remote-control thread to connect", alive=[beat])
        out = cluster.celery("inspect", "ping", "-t", str(REPLY_LIMIT),
                             "-d", f"celerybeat@{HOST}").stdout
        assert f"celerybeat@{HOST}: OK" in out and "1 node online." in out, out
    finally:
        assert beat.stop() == 0, beat.tail()


def test_shutdown_ends_a_worker(cluster: Cluster) -> None:
    # a worker shutting down sends no reply: the command says no node replied
    cluster.celery("control", "shutdown", "-d", B, check=False)
    worker_b = cluster.workers[1]
    assert worker_b.wait(30) == 0, worker_b.tail()
    assert cluster.app.control.ping([A], timeout=REPLY_LIMIT) == [{A: {"ok": "pong"}}]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def get_json(url: str, server: Proc) -> Any:
    """The JSON ``url`` answers with, or None while the server does not answer yet (it
    must still be running)."""
    assert server.popen.poll() is None, server.tail()
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return json.loads(response.read())
    except (ConnectionError, urllib.error.URLError):
        return None


def pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
