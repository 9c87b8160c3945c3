"""The unique tasks guide's example (docs/unique.rst): a task sent again while it waits or
runs is not queued twice; the send returns the task already there.

``UNIQUE_DATABASE_URL`` names the database; ``sync_contact`` appends its contact id and
task id to the file ``UNIQUE_LOG`` names, so that each run can be counted. Run
``python unique_app.py 7`` to send the sync of contact 7 three times (it prints the task
id each send returned), then ``celery -A unique_app worker`` to run it.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from celery import Celery

from celery_ext.unique import UniqueTask

DATABASE_URL = os.environ.get("UNIQUE_DATABASE_URL", "sqlite:///unique.db")
LOG = os.environ.get("UNIQUE_LOG", "syncs.log")

app = Celery("unique_app", broker="sqlinbox+" + DATABASE_URL)
app.conf.broker_transport_options = {"table_prefix": "unique_", "polling_interval": 0.1}


@app.task(bind=True, base=UniqueTask, unique="active",
          unique_key=lambda contact_id: f"contact-{contact_id}")
def sync_contact(self: Any, contact_id: int) -> None:
    """Push one contact to the CRM: at most one sync per contact waits or runs."""
    with open(LOG, "a") as log:
        log.write(f"{contact_id} {self.request.id}\n")


@app.task(base=UniqueTask, unique="waiting")
def rebuild_search_index() -> None:
    """Rebuild the index: one rebuild waits at most; one sent while another runs is queued
    (it will see the changes the running one missed)."""


if __name__ == "__main__":
    contact = int(sys.argv[1])
    for _ in range(3):
        print(sync_contact.delay(contact).id)
