"""One queue table, declared twice: as a class and with the builder. Both give equal specs.

The table belongs to the service (its migrations create it); the declaration
tells the transport which column plays which role.
"""

from __future__ import annotations

from kombu_sqlinbox import Column, InboxTable, Role, TableBuilder


class EmailJobs(InboxTable, table="email_jobs"):
    job_id = Column(Role.ID, generated=True)
    body = Column(Role.PAYLOAD)
    envelope = Column(Role.HEADERS)
    tries = Column(Role.ATTEMPT)
    lease_until = Column(Role.LOCKED_UNTIL)
    not_before = Column(Role.AVAILABLE_AT)


email_jobs = (
    TableBuilder("email_jobs")
    .id("job_id", generated=True)
    .payload("body")
    .headers("envelope")
    .attempt("tries")
    .locked_until("lease_until")
    .available_at("not_before")
    .build()
)

# Celery: app.conf.broker_transport_options = TRANSPORT_OPTIONS
TRANSPORT_OPTIONS = {
    "create_tables": False,  # migrations own the schema; the transport only checks it
    "queues": {
        "emails": {"table": EmailJobs},  # or email_jobs, or "tables:EmailJobs"
    },
}
