"""A shop whose queues it shares with code that is not Celery.

* ``order_events`` is in row mode: a trigger on ``webshop_orders`` inserts a row
  ``(order_id, kind)`` for every order placed or changed, and each row runs
  ``on_order_event(order_id, kind)`` as a Celery task -- one order's events in order.
* ``jobs`` is in row mode too: any service (a cron script, ``psql``) inserts the
  name of a task and its keyword arguments as JSON; a row that is not that is
  parked in ``webshop.parked`` with its raw columns and the reason.
* ``mail`` holds plain rows: ``send_mail.delay(...)`` stores only the keyword
  arguments, with the shop's own INSERT, and the mailer service (not Celery)
  reads the table with ordinary SQL.

The tables are the shop's own (``schema/<database>.sql``). ``WEBSHOP_DATABASE_URL``
(an SQLAlchemy URL) names the database; the default is a SQLite file in the working
directory.
"""

from __future__ import annotations

import os

from celery import Celery
from sqlalchemy import Boolean, Column, Integer, MetaData, String, Table, select
from sqlalchemy.engine import Engine, make_url

import kombu_sqlinbox  # noqa: F401  (registers the sqlinbox+ broker URLs)
from celery_ext.tasks import InboxTask
from kombu_sqlinbox import TableBuilder

DATABASE_URL = os.environ.get("WEBSHOP_DATABASE_URL", "sqlite:///webshop.db")
DATABASE = make_url(DATABASE_URL).get_backend_name()

# Row mode: each row is a call of on_order_event with two of its columns as arguments;
# order_id is a FIFO group too, so one order's events run one at a time, in order.
order_events = (
    TableBuilder("webshop_order_events")
    .id()
    .group("order_id", fifo=True)
    .attempt()
    .locked_until()
    .available_at()
    .task("on_order_event", arguments=("order_id", "kind"))
    .build()
)

# Row mode: the task is named by a column, its keyword arguments are the payload's JSON.
jobs = (
    TableBuilder("webshop_jobs")
    .id()
    .payload()
    .attempt()
    .locked_until()
    .available_at()
    .task(column="task", arguments="kwargs")
    .build()
)

# The INSERT the shop's mail rows are written with, one per database: it fills the
# "source" column, which the transport knows nothing of.
MAIL_INSERT = {
    "postgresql": "INSERT INTO webshop_mail (kind, body, source, available_at) "
                  "VALUES (:task_name, :payload, 'webshop:' || :task_id, "
                  "COALESCE(to_timestamp(:available_at), now()))",
    "mysql": "INSERT INTO webshop_mail (kind, body, source, available_at) "
             "VALUES (:task_name, :payload, CONCAT('webshop:', :task_id), "
             "COALESCE(FROM_UNIXTIME(:available_at), UTC_TIMESTAMP(6)))",
    "sqlite": "INSERT INTO webshop_mail (kind, body, source, available_at) "
              "VALUES (:task_name, :payload, 'webshop:' || :task_id, "
              "COALESCE(:available_at, (julianday('now') - 2440587.5) * 86400.0))",
}

# Plain rows: the payload is the task's keyword arguments alone, no Celery envelope.
mail = (
    TableBuilder("webshop_mail")
    .id()
    .payload("body")
    .attempt()
    .locked_until()
    .available_at()
    .task(column="kind", arguments="kwargs")
    .plain()
    .publish_statement(MAIL_INSERT[DATABASE])
    .build()
)

app = Celery("webshop", broker=f"sqlinbox+{DATABASE_URL}")
app.conf.broker_connection_retry_on_startup = True
app.conf.task_ignore_result = True
app.conf.task_routes = {"send_mail": {"queue": "mail"}}
app.conf.broker_transport_options = {
    "table_prefix": "webshop_",  # the dead-letter queue's table: webshop_webshop_parked
    "polling_interval": 0.1,  # rows a trigger writes send no wake-up
    "queues": {
        "order_events": {"table": order_events, "max_attempts": 3,
                         "dead_letter_queue": "webshop.parked"},
        "jobs": {"table": jobs, "max_attempts": 3, "dead_letter_queue": "webshop.parked"},
        "mail": {"table": mail},
    },
}


@app.task(base=InboxTask, bind=True, transactional=True, name="on_order_event")
def on_order_event(self: InboxTask, order_id: int, kind: str) -> None:
    """Record the event and, for a new order, queue its confirmation mail: both commit
    with the row's completion, or none of them does."""
    self.connection.execute(handled.insert(), {
        "task": "on_order_event", "subject": f"{order_id}:{kind}",
        "task_id": self.request.id, "redelivered": self.request.delivery_info.get("redelivered")})
    if kind == "placed":
        customer = self.connection.execute(
            select(orders.c.customer).where(orders.c.id == order_id)).scalar_one()
        send_mail.delay(to=customer, template="order-placed", order_id=order_id)


@app.task(base=InboxTask, name="send_mail")
def send_mail(to: str, template: str, order_id: int) -> None:
    """Run by the mailer service, not by this shop: its rows are read with plain SQL."""
    raise NotImplementedError("the mailer service sends mail")


@app.task(base=InboxTask, bind=True, transactional=True, name="webshop.rebuild_report")
def rebuild_report(self: InboxTask, day: str) -> None:
    self.connection.execute(handled.insert(), {
        "task": "webshop.rebuild_report", "subject": day, "task_id": self.request.id,
        "redelivered": self.request.delivery_info.get("redelivered")})


# -- the shop's own data ------------------------------------------------------------------
metadata = MetaData()
orders = Table("webshop_orders", metadata, Column("id", Integer, primary_key=True),
               Column("customer", String(255)), Column("status", String(32)))
#: what the tasks did, one row per run
handled = Table(
    "webshop_handled", metadata,
    Column("n", Integer, primary_key=True, autoincrement=True),
    Column("task", String(64), nullable=False),
    Column("subject", String(255), nullable=False),
    Column("task_id", String(64), nullable=False),
    Column("redelivered", Boolean),
)


def create_tables(engine: Engine) -> None:
    """The table of what the tasks did (the others are in ``schema/``)."""
    handled.create(engine, checkfirst=True)
