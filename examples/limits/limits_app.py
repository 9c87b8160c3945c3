"""The concurrency limits guide's example (docs/limits.rst): reports run against each
tenant's own database, which takes two report queries at once (enterprise tenants: eight),
and the reporting replica takes six in all, however many workers run.

``LIMITS_DATABASE_URL`` names the database; ``build_report`` appends its tenant, report
number, start and finish (``time.monotonic()``, one clock per host) to the file
``LIMITS_LOG`` names, so that the runs at once can be counted. Run ``python limits_app.py``
to send six reports for each of three tenants, then ``celery -A limits_app worker``.
"""

from __future__ import annotations

import os
import sys
import time

from celery import Celery

from celery_ext.limits import LimitedTask

DATABASE_URL = os.environ.get("LIMITS_DATABASE_URL", "sqlite:///limits.db")
LOG = os.environ.get("LIMITS_LOG", "reports.log")

app = Celery("limits_app", broker="sqlinbox+" + DATABASE_URL)
# The limits: per tenant (the key), and for the whole queue
app.conf.broker_transport_options = {
    "table_prefix": os.environ.get("LIMITS_TABLE_PREFIX", "limits_"),
    "polling_interval": 0.1,
    "queues": {"celery": {"concurrency_limits": {"*": 2, "enterprise-": 8},
                          "max_in_work": 6}},
}
app.conf.worker_prefetch_multiplier = 1


@app.task(base=LimitedTask, limit_key=lambda tenant, report: tenant)
def build_report(tenant: str, report: int) -> None:
    """Build one report: at most two of a tenant at once, across every worker."""
    start = time.monotonic()
    time.sleep(0.2)  # the report's queries on the tenant's database
    with open(LOG, "a") as log:
        log.write(f"{tenant} {report} {start} {time.monotonic()}\n")


if __name__ == "__main__":
    for tenant in sys.argv[1:] or ["acme", "globex", "enterprise-initech"]:
        for report in range(6):
            build_report.delay(tenant, report)
    print("sent")
