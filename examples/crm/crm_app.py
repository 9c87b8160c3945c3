"""Contact changes sent to each CRM one at a time, in the order they happened.

Every change to a contact is queued for each target CRM. The queue's table has
a FIFO group per target system: the changes for one target go out strictly one
after another -- across every worker process and host -- while the other
targets run beside them. A change the CRM refuses is retried in place, so the
changes behind it wait instead of overtaking it; after three deliveries it is
parked in the queue ``crm.parked`` and the target's next change goes out.

``CRM_DATABASE_URL`` (an SQLAlchemy URL) names the database; the default is a
SQLite file in the working directory. Run ``python run.py`` beside this file
for a demonstration.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from celery import Celery
from sqlalchemy import Column, Double, Integer, MetaData, String, Table, Text, create_engine
from sqlalchemy.engine import Engine

import kombu_sqlinbox  # noqa: F401  (registers the sqlinbox+ broker URLs)
from celery_ext.tasks import InboxTask
from kombu_sqlinbox import TableBuilder

DATABASE_URL = os.environ.get("CRM_DATABASE_URL", "sqlite:///crm.db")
#: how long a refused change waits before its next attempt
RETRY_SECONDS = 0.5

# The queue table: a FIFO group per target system (the "target" column).
outbound_changes = (
    TableBuilder("crm_outbound")
    .id()
    .payload()
    .headers()
    .group("target", fifo=True)
    .attempt()
    .locked_until()
    .available_at()
    .build()
)

app = Celery("crm", broker=f"sqlinbox+{DATABASE_URL}")
app.conf.broker_connection_retry_on_startup = True
app.conf.task_default_queue = "crm"
app.conf.task_ignore_result = True
app.conf.broker_transport_options = {
    "table_prefix": "crm_",  # tables the transport names itself: crm_crm_parked_...
    "queues": {
        "crm": {
            "table": outbound_changes,
            "max_attempts": 3,  # the fourth delivery parks the change instead
            "dead_letter_queue": "crm.parked",
        },
    },
}


def record_change(target: str, contact_id: int, fields: dict[str, Any]) -> None:
    """Queue one contact change for one target; a target receives its changes in this order."""
    push_change.apply_async((target, contact_id, fields), headers={"group_key": target})


class Refused(Exception):
    """The CRM refused a change (an HTTP 4xx or 5xx in real life)."""


@app.task(base=InboxTask, bind=True)
def push_change(self: InboxTask, target: str, contact_id: int, fields: dict[str, Any]) -> None:
    try:
        FakeCRM(target).update_contact(contact_id, fields)
    except Refused as exc:
        # Same row, same place at the head of the target's group; the attempt counts.
        raise self.retry_after(RETRY_SECONDS, reason=str(exc)) from exc


# -- a stand-in for the CRMs' HTTP APIs: it writes what it receives to a table -------------
received = Table(
    "crm_received", MetaData(),
    Column("n", Integer, primary_key=True, autoincrement=True),
    Column("target", String(64), nullable=False),
    Column("contact_id", Integer, nullable=False),
    Column("fields", Text, nullable=False),
    Column("started", Double, nullable=False),
    Column("finished", Double, nullable=False),
)
_engine: tuple[int, Engine] | None = None


def engine() -> Engine:
    """This process's engine (a prefork pool process opens its own)."""
    global _engine
    if _engine is None or _engine[0] != os.getpid():
        _engine = (os.getpid(), create_engine(DATABASE_URL))
    return _engine[1]


def create_tables() -> None:
    received.create(engine(), checkfirst=True)


class FakeCRM:
    """Takes about 10 ms per call; refuses an email address without an ``@``."""

    def __init__(self, target: str) -> None:
        self.target = target

    def update_contact(self, contact_id: int, fields: dict[str, Any]) -> None:
        started = time.time()
        if "@" not in fields.get("email", "@"):
            raise Refused(f"{self.target}: invalid email {fields['email']!r}")
        time.sleep(0.01)
        with engine().begin() as conn:
            conn.execute(received.insert(), {
                "target": self.target, "contact_id": contact_id, "fields": json.dumps(fields),
                "started": started, "finished": time.time()})
