"""The Celery app the acceptance tests run as a real ``celery worker``.

Everything a test varies comes from the environment, so one module serves every
worker: the broker URL, the transport options (JSON), extra Celery settings
(JSON) and the directory where each task run leaves its files. A run writes its
files outside the broker database on purpose: the restart test takes that
database away while tasks run, and a record must not depend on it.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path
from typing import Any

from celery import Celery, Task, signals
from kombu import Queue
from sqlalchemy import text

from celery_ext.tasks import InboxTask

BROKER_ENV = "SQLINBOX_ACC_BROKER"
OPTIONS_ENV = "SQLINBOX_ACC_OPTIONS"
CONF_ENV = "SQLINBOX_ACC_CONF"
RUNS_ENV = "SQLINBOX_ACC_RUNS"
#: ``x-expires`` (seconds) of the default queue, when set
EXPIRES_ENV = "SQLINBOX_ACC_QUEUE_EXPIRES"
#: how long a held task waits for its release file before giving up
HOLD_LIMIT = 120.0


def make_app(broker_url: str, transport_options: dict[str, Any], **conf: Any) -> Celery:
    """A Celery app on the sqlinbox transport; the worker and the test side both use it."""
    import kombu_sqlinbox  # noqa: F401  (registers the sqlinbox alias)

    made = Celery("acceptance", broker=broker_url, set_as_current=False)
    expires = os.environ.get(EXPIRES_ENV)
    if expires:
        made.conf.task_queues = [Queue("celery", expires=float(expires))]
    made.conf.update({  # ``conf`` may override any of these
        "broker_transport_options": transport_options,
        "broker_connection_retry_on_startup": True,
        "task_ignore_result": True,
        "worker_redirect_stdouts": False,
        **conf,
    })
    return made


app = make_app(
    os.environ.get(BROKER_ENV, "memory://"),
    json.loads(os.environ.get(OPTIONS_ENV, "{}")),
    **json.loads(os.environ.get(CONF_ENV, "{}")),
)


def _write(path: Path, record: dict[str, Any]) -> None:
    """Write a file whole: readers only see it once it is complete."""
    partial = path.with_name(path.name + ".part")
    partial.write_text(json.dumps(record))
    partial.rename(path)


#: when this worker's warm shutdown was asked for (Celery's ``worker_shutting_down``)
_shutdown_asked: list[float] = []


@signals.worker_shutting_down.connect
def _note_shutdown_asked(**_: Any) -> None:
    _shutdown_asked.append(time.monotonic())


@signals.worker_shutdown.connect
def _note_shutdown_done(sender: Any, **_: Any) -> None:
    """Leave ``shutdown.<hostname>``: the seconds from the shutdown's request to the
    consumer stopped, the worker's own part of a warm shutdown (without the interpreter's
    start and exit, which a loaded machine stretches)."""
    if _shutdown_asked and RUNS_ENV in os.environ:
        _write(Path(os.environ[RUNS_ENV]) / f"shutdown.{sender.hostname}",
               {"seconds": time.monotonic() - _shutdown_asked[0]})


def run(self: Task, key: str, seconds: float = 0.0, hold: bool = False) -> str:
    """Leave ``<key>.<run>.start``, optionally wait for ``release/<key>``, sleep, leave
    ``<key>.<run>.done``. One start file per run is what "ran exactly once" counts; the
    run's token is the result, naming the run whose result was stored."""
    runs = Path(os.environ[RUNS_ENV])
    token = uuid.uuid4().hex
    info = self.request.delivery_info or {}
    _write(runs / f"{key}.{token}.start", {
        "key": key, "task_id": self.request.id, "pid": os.getpid(), "at": time.time(),
        "token": token, "worker": self.request.hostname,
        "redelivered": bool(info.get("redelivered")),
    })
    if hold:
        deadline = time.monotonic() + HOLD_LIMIT
        while not (runs / "release" / key).exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"task {key}: no release file after {HOLD_LIMIT}s")
            time.sleep(0.05)
    if seconds:
        time.sleep(seconds)
    _write(runs / f"{key}.{token}.done", {"key": key, "at": time.time()})
    return token


app.task(bind=True, name="acc.run")(run)
app.task(bind=True, name="acc.run_late", acks_late=True)(run)
#: one run every ten seconds: a worker keeps a second request reserved, waiting for a token
app.task(bind=True, name="acc.run_limited", rate_limit="6/m")(run)


# -- results (tests/acceptance/test_results.py) ---------------------------------------------
@app.task(name="acc.add")
def add(x: int, y: int) -> int:
    return x + y


#: a chord's header task acknowledged late: counted in the transaction of its result
app.task(name="acc.add_late", acks_late=True)(add.run)


@app.task(bind=True, name="acc.collect")
def collect(self: Task, values: list[Any]) -> list[Any]:
    """A chord's body: leaves a run of key ``body``, returns the values it was given."""
    run(self, "body")
    return values


@app.task(bind=True, name="acc.errback")
def errback(self: Task, task_id: str) -> str:
    """An error callback: leaves a run of key ``errback``."""
    return run(self, "errback")


@app.task(name="acc.total")
def total(values: list[int]) -> int:
    return sum(values)


@app.task(name="acc.fail")
def fail(reason: str) -> None:
    raise ValueError(reason)


@app.task(name="acc.sized")
def sized(size: int) -> str:
    """A result of ``size`` characters."""
    return "x" * size


app.task(name="acc.fail_late", acks_late=True)(fail.run)
#: late-acked successes whose result cannot be stored: too large, or not encodable
app.task(name="acc.sized_late", acks_late=True)(sized.run)


@app.task(name="acc.unencodable_late", acks_late=True)
def unencodable() -> object:
    return object()


#: a failure the worker rejects (to the dead-letter queue) instead of acknowledging
app.task(name="acc.fail_rejected", acks_late=True, acks_on_failure_or_timeout=False)(fail.run)


@app.task(name="acc.rejected", acks_late=True)
def rejected(reason: str) -> None:
    from celery.exceptions import Reject

    raise Reject(reason, requeue=False)


@app.task(bind=True, name="acc.retried", max_retries=1)
def retried(self: Task) -> int:
    """Retried once at once, then returns how many retries it took."""
    if self.request.retries == 0:
        raise self.retry(countdown=0)
    return int(self.request.retries)


#: the table :func:`marked` writes to, under the test's table prefix
MARKS = "acc_marks"


@app.task(bind=True, base=InboxTask, transactional=True, name="acc.marked")
def marked(self: InboxTask, key: str, size: int) -> str:
    """Insert ``key`` into the marks table in the task's transaction; return ``size``
    characters (too many for the result table: nothing of the task commits)."""
    prefix = json.loads(os.environ[OPTIONS_ENV])["table_prefix"]
    table = self.connection.dialect.identifier_preparer.quote(prefix + MARKS)
    self.connection.execute(text(f"INSERT INTO {table} (mark) VALUES (:key)"), {"key": key})
    return "x" * size


# -- chords grown by their header tasks (tests/acceptance/test_chords.py) -------------------
@app.task(bind=True, name="acc.adds_to_chord", acks_late=True)
def adds_to_chord(self: Task, nums: list[int], value: int, as_chord: bool = False) -> int:
    """A chord's header task adding ``add(num, value)`` for each of ``nums`` to its chord
    (``Task.add_to_chord``), or with ``as_chord`` one chord of them summed."""
    from celery import chord

    adds = [self.app.signature("acc.add_late", args=(num, value)) for num in nums]
    if as_chord:
        self.add_to_chord(chord(adds, self.app.signature("acc.total")))
    else:
        for sig in adds:
            self.add_to_chord(sig)
    return 0
