"""The app of the Operations guide: a queue ``emails`` that parks poison messages in
``emails.dead`` after three deliveries, on a database whose tables a migration creates
(``create_tables`` off). The URL and table prefix come from the environment."""

from __future__ import annotations

import os

from celery import Celery

import kombu_sqlinbox  # noqa: F401  (registers the sqlinbox+ broker URLs)

URL = os.environ.get("OPS_EXAMPLE_URL", "sqlite:///ops-example.db")
PREFIX = os.environ.get("OPS_EXAMPLE_PREFIX", "sqlinbox_")

app = Celery("proj", broker=f"sqlinbox+{URL}")
app.conf.task_default_queue = "emails"
app.conf.task_acks_late = True
app.conf.broker_transport_options = {
    "table_prefix": PREFIX,
    "create_tables": False,
    "queues": {"emails": {"dead_letter_queue": "emails.dead", "max_attempts": 3}},
}


@app.task(name="proj.send_email")
def send_email(to: str) -> None:
    print(f"sending to {to}")


@app.task(name="proj.render_invoice", acks_late=True)
def render_invoice(invoice: int) -> None:
    """A poison task for the runbook: invoice 13 always fails hard (its worker dies)."""
    if invoice == 13:
        os._exit(1)
