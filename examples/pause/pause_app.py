"""The pausing guide's example (docs/pause.rst): a queue of e-mails that an operator
pauses while the mail server is down, and resumes once it is back.

``PAUSE_DATABASE_URL`` names the database; ``send_email`` appends its number to the file
``PAUSE_LOG`` names, so that each run can be counted.
"""

from __future__ import annotations

import os

from celery import Celery

from kombu_sqlinbox.operations import Operations
from kombu_sqlinbox.options import parse_options

DATABASE_URL = os.environ.get("PAUSE_DATABASE_URL", "sqlite:///pause.db")
LOG = os.environ.get("PAUSE_LOG", "sent.log")

app = Celery("pause_app", broker="sqlinbox+" + DATABASE_URL)
app.conf.broker_transport_options = {"table_prefix": "pause_", "polling_interval": 0.1}
app.conf.task_default_queue = "emails"


@app.task
def send_email(number: int) -> None:
    with open(LOG, "a") as log:
        log.write(f"{number}\n")


def operations() -> Operations:
    """The operations on the app's database, as ``celery -A pause_app sqlinbox`` has them."""
    return Operations(app.conf.broker_url, parse_options(app.conf.broker_transport_options),
                      ["emails"])


def resume_when_the_mail_server_answers() -> None:
    """What a health check runs once the mail server is back."""
    ops = operations()
    try:
        for paused in ops.paused():
            if paused.queue == "emails":
                ops.resume("emails")
    finally:
        ops.close()
