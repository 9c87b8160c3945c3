"""The Celery app the outbox tests run as a real ``celery worker`` (and send with).

Everything a test varies comes from the environment: the broker, the outbox
database and table, the queue, the directory where task runs leave files, and the
grace period of the republish at worker start ("off" for none).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import uuid
from pathlib import Path
from typing import Any

from celery import Celery, Task
from sqlalchemy import create_engine, text

import celery_ext
from celery_ext import Outbox
from celery_ext.declaration import Declaration
from celery_ext.outbox import HEADER
from celery_ext.tasks import InboxTask

BROKER_ENV = "OUTBOX_TEST_BROKER"
DB_ENV = "OUTBOX_TEST_DB"
TABLE_ENV = "OUTBOX_TEST_TABLE"
QUEUE_ENV = "OUTBOX_TEST_QUEUE"
RUNS_ENV = "OUTBOX_TEST_RUNS"
GRACE_ENV = "OUTBOX_TEST_START_GRACE"
#: how long a held task waits for its release file
HOLD_LIMIT = 60.0


def effects_table(table: str) -> str:
    """The table where transactional consumers write their effect (one row per run)."""
    return f"{table}_effects"


def make_app(broker: str, db: str | None, table: str, queue: str, start_grace: str = "off",
             declaration: Declaration | None = None, **options: Any) -> tuple[Celery, Outbox]:
    """The app and its outbox on ``table`` (or on ``declaration``, a service's own table)."""
    import kombu_sqlinbox  # noqa: F401  (registers the sqlinbox alias)

    app = Celery("outbox_tests", broker=broker, set_as_current=False)
    app.conf.update(
        task_default_queue=queue,
        task_ignore_result=True,
        broker_connection_retry_on_startup=True,
        broker_transport_options={"polling_interval": 0.1, "table_prefix": f"{table}_q_"},
        worker_prefetch_multiplier=1,
        worker_redirect_stdouts=False,
    )
    republish = start_grace != "off"
    outbox = celery_ext.install(
        app, db, table=declaration or table, republish_on_start=republish,
        grace=float(start_grace) if republish else 300.0, **options)

    def record_of(task: Task) -> dict[str, Any]:
        """What the outbox table holds for this delivery's record, read before any work."""
        engine = outbox.engine
        quoted = engine.dialect.identifier_preparer.quote(table)
        with engine.connect() as conn:
            row = conn.execute(text(f"SELECT task_id, processed_at FROM {quoted} WHERE id = :id"),
                               {"id": task.request.outbox_id}).first()
        return {"found": row is not None, "task_id": row[0] if row else None,
                "processed": bool(row and row[1] is not None)}

    @app.task(bind=True, name="ob.check", shared=False)
    def check(self: Task, key: str) -> None:
        """Leave ``<key>.<run>.run`` saying whether the record existed when it was consumed."""
        leave(key, "run", {"task_id": self.request.id, "outbox_id": self.request.outbox_id,
                           "record": record_of(self)})

    @app.task(bind=True, name="ob.credit", shared=False, acks_late=True)
    def credit(self: Task, key: str, hold: bool = False) -> None:
        """A transactional consumer: its effect row and its record's mark commit together."""
        with outbox.transaction() as conn:
            conn.execute(text(f"INSERT INTO {effects_table(table)} (k) VALUES (:k)"), {"k": key})
            leave(key, "start", {"pid": os.getpid()})
            if hold:
                wait_for_release(key)

    @app.task(bind=True, name="ob.lock", shared=False)
    def lock(self: Task, db_url: str, bound: bool = False) -> None:
        """Take SQLite's write lock in a transaction of this task, then send a tracked task
        (through that transaction when ``bound``); leave what happened. The producer's
        connection is opened and the queue declared first: on sqlinbox+sqlite both take
        the write lock (the connection's ping and the queue_declare)."""
        engine = create_engine(db_url)
        try:
            with app.producer_or_acquire() as producer, engine.begin() as conn:
                producer.maybe_declare(app.amqp.queues[queue])
                conn.execute(text(f"INSERT INTO {effects_table(table)} (k) VALUES ('lock')"))
                began = time.monotonic()
                try:
                    with celery_ext.bind(conn) if bound else contextlib.nullcontext():
                        check.apply_async(("from-lock",), producer=producer)
                    outcome = "sent"
                except celery_ext.RecordFailed as exc:
                    outcome = f"{type(exc).__name__}: {exc}"
                leave("lock", "outcome", {"outcome": outcome, "bound": bound,
                                          "seconds": time.monotonic() - began})
        finally:
            engine.dispose()

    @app.task(bind=True, name="ob.note", shared=False, acks_late=True)
    def note(self: Task, key: str) -> None:
        """Leave ``<key>.<run>.run``; reads nothing, so only the outbox touches its record."""
        leave(key, "run", {"task_id": self.request.id, "outbox_id": self.request.get(HEADER)})

    @app.task(bind=True, base=InboxTask, transactional=True, name="ob.tx_send", shared=False)
    def tx_send(self: InboxTask, key: str, queue: str | None = None) -> None:
        """A transactional task (sqlinbox broker): its effect, then a tracked send onto
        ``queue`` (whose table may not exist yet), both in the delivery's transaction."""
        self.connection.execute(
            text(f"INSERT INTO {effects_table(table)} (k) VALUES (:k)"), {"k": key})
        note.apply_async((key,), queue=queue)

    app.finalize()  # the tasks below come after finalize, as those of a late import do

    @app.task(bind=True, name="ob.late", shared=False)
    def late(self: Task, key: str) -> None:
        leave(key, "run", {"task_id": self.request.id})

    return app, outbox


def leave(key: str, kind: str, record: dict[str, Any]) -> None:
    """Write ``<key>.<uuid>.<kind>`` whole (readers only ever see complete files)."""
    runs = Path(os.environ[RUNS_ENV])
    path = runs / f"{key}.{uuid.uuid4().hex}.{kind}"
    partial = path.with_name(path.name + ".part")
    partial.write_text(json.dumps({"key": key, "at": time.time(), **record}))
    partial.rename(path)


def wait_for_release(key: str) -> None:
    release = Path(os.environ[RUNS_ENV]) / f"{key}.release"
    deadline = time.monotonic() + HOLD_LIMIT
    while not release.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{key}: no release file after {HOLD_LIMIT}s")
        time.sleep(0.05)


app, outbox = make_app(
    os.environ.get(BROKER_ENV, "memory://"), os.environ.get(DB_ENV) or None,
    os.environ.get(TABLE_ENV, "celery_outbox"), os.environ.get(QUEUE_ENV, "celery"),
    os.environ.get(GRACE_ENV, "off"))
