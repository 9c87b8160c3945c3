"""The Celery app the operations tests run as a real ``celery worker`` and as the app of
``celery -A tests.ops.apps sqlinbox ...``.

Everything a test varies comes from the environment: the broker URL, the table prefix
(each test's own) and the directory where each task run leaves a file.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path
from typing import Any

from celery import Celery
from celery.exceptions import Reject
from kombu import Queue

from kombu_sqlinbox.tables import TableBuilder, TableSpec

BROKER_ENV = "SQLINBOX_OPS_BROKER"
PREFIX_ENV = "SQLINBOX_OPS_PREFIX"
RUNS_ENV = "SQLINBOX_OPS_RUNS"
#: Celery's ``broker_password`` setting, where a test gives one
PASSWORD_ENV = "SQLINBOX_OPS_PASSWORD"
#: the sqlinbox result backend, where a test gives one: JSON ``{"extended": bool,
#: "create_tables": bool, "url": "sqlinbox+...", "serializer": "json"}`` (the URL
#: defaults to the broker's, the serializer to Celery's)
RESULTS_ENV = "SQLINBOX_OPS_RESULTS"
#: more queues' transport options, where a test gives some: JSON ``{queue: options}``
QUEUES_ENV = "SQLINBOX_OPS_QUEUES"


def fifo_table(prefix: str) -> TableSpec:
    """The FIFO queue's declared table: its group column makes it FIFO."""
    return (TableBuilder(f"{prefix}fifo_jobs").id().payload().headers().group("grp", fifo=True)
            .priority().available_at().locked_until().attempt().build())


def audit_table(prefix: str, broker_url: str, form: str | None = "canonical") -> TableSpec:
    """Queue ``audit``'s declared table: the default layout plus ``task_name`` and
    ``task_id``, which its publish statement fills (``form``): written as the guide
    writes it (``canonical``), or in lower case with a conflict clause (``free``), or
    none (None: the default statement, to create the table with)."""
    table = f"{prefix}audit"
    builder = (TableBuilder(table).id().payload().headers().priority().available_at()
               .locked_until().attempt())
    if form == "canonical":
        builder.publish_statement(
            f"INSERT INTO {table} (payload, headers, task_name, task_id) "
            "VALUES (:payload, :headers, :task_name, :task_id)")
    elif form == "free":
        mysql = broker_url.startswith(("sqlinbox+mysql", "sqlinbox+mariadb"))
        builder.publish_statement(
            f"insert {'ignore ' if mysql else ''}into {table} (task_id, headers, payload, "
            f"task_name) values (:task_id, :headers, :payload, :task_name)"
            + ("" if mysql else " on conflict do nothing"))
    return builder.build()


def events_table(prefix: str) -> TableSpec:
    """Queue ``events`` in row mode: rows written with SQL name their task and hold their
    keyword arguments as JSON."""
    return (TableBuilder(f"{prefix}events").id().payload().available_at().locked_until()
            .attempt().task(column="task").build())


def transport_options(prefix: str) -> dict[str, Any]:
    """``jobs`` and ``fifo`` park their dead letters in ``jobs.dead``."""
    return {
        "table_prefix": prefix,
        "polling_interval": 0.05,
        "queues": {
            "jobs": {"dead_letter_queue": "jobs.dead", "max_attempts": 5},
            "fifo": {"dead_letter_queue": "jobs.dead", "table": fifo_table(prefix)},
        },
    }


def make_app(broker_url: str, prefix: str, results: str | None = None) -> Celery:
    """The app; with ``results`` (:data:`RESULTS_ENV`'s JSON), its sqlinbox result backend."""
    import kombu_sqlinbox  # noqa: F401  (registers the sqlinbox alias)

    made = Celery("ops", broker=broker_url, set_as_current=False)
    options = transport_options(prefix)
    options["queues"].update(json.loads(os.environ.get(QUEUES_ENV) or "{}"))
    made.conf.update(
        broker_transport_options=options,
        broker_connection_retry_on_startup=True,
        task_queues=[Queue("jobs"), Queue("fifo")],
        task_default_queue="jobs",
        task_ignore_result=True,
        task_acks_late=True,
        worker_redirect_stdouts=False,
        broker_password=os.environ.get(PASSWORD_ENV),
    )
    if results:
        given = json.loads(results)
        made.conf.update(result_backend=given.get("url", broker_url),
                         result_extended=given.get("extended", False),
                         result_backend_transport_options={
                             "create_tables": given.get("create_tables", True)})
        if "serializer" in given:
            made.conf.update(result_serializer=given["serializer"],
                             result_accept_content=["json", given["serializer"]])
    made.task(name="ops.add")(add)
    made.task(name="ops.fail")(fail)
    made.task(name="ops.record")(record)
    made.task(name="ops.hold")(hold)
    return made


def add(x: int, y: int) -> int:
    return x + y


def fail() -> None:
    raise Reject("ops.fail always fails", requeue=False)


def record(key: int, poisoned: str) -> None:
    """Leave ``<key>.<run>`` in the runs directory, unless poisoned: ``always`` rejects
    every run, ``cured`` rejects until the file ``cured`` exists there. A rejected run
    leaves no file; its message goes to the dead-letter queue."""
    runs = Path(os.environ[RUNS_ENV])
    if poisoned == "always" or (poisoned == "cured" and not (runs / "cured").exists()):
        raise Reject(f"poisoned ({poisoned})", requeue=False)
    (runs / f"{key}.{uuid.uuid4().hex}").touch()


def hold(seconds: float) -> None:
    """Stay in work until the file ``release`` exists in the runs directory, at most
    ``seconds``."""
    release = Path(os.environ[RUNS_ENV]) / "release"
    deadline = time.monotonic() + seconds
    while not release.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


app = make_app(os.environ.get(BROKER_ENV, "memory://"), os.environ.get(PREFIX_ENV, "ops_"),
               os.environ.get(RESULTS_ENV))

#: the declared tables of this process's prefix, for ``--transport-options`` given as JSON
FIFO = fifo_table(os.environ.get(PREFIX_ENV, "ops_"))
AUDIT = audit_table(os.environ.get(PREFIX_ENV, "ops_"), os.environ.get(BROKER_ENV, ""))
AUDIT_FREE = audit_table(os.environ.get(PREFIX_ENV, "ops_"), os.environ.get(BROKER_ENV, ""),
                         "free")
EVENTS = events_table(os.environ.get(PREFIX_ENV, "ops_"))
