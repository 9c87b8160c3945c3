"""Run the CRM example: queue contact changes for two CRMs, one of them poison, and watch
a real worker send them.

    python examples/crm/run.py

Uses a temporary SQLite file unless ``CRM_DATABASE_URL`` names a database. Starts
``celery -A crm_app worker --pool prefork --concurrency 4``, waits until every
change has reached its CRM or been parked, prints what each CRM received in order
and what was parked, stops the worker and exits.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

from kombu import Connection
from sqlalchemy import select

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]
from demo.run import start_worker, stop_worker, wait_until  # noqa: E402

DEADLINE = 60.0
TARGETS = ("hubspot", "salesforce")


def changes() -> list[tuple[str, int, dict[str, str]]]:
    """Three changes to each of two contacts, for each target; one bad address for hubspot."""
    made = []
    for version in range(3):
        for contact_id in (1, 2):
            for target in TARGETS:
                email = f"c{contact_id}.v{version}@example.com"
                if (target, contact_id, version) == ("hubspot", 1, 1):
                    email = "not-an-address"
                made.append((target, contact_id, {"email": email, "version": str(version)}))
    return made


def main() -> int:
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="sqlinbox-crm-") as directory:
        os.environ.setdefault("CRM_DATABASE_URL", f"sqlite:///{directory}/crm.db")
        import crm_app

        crm_app.create_tables()
        sent = changes()
        for target, contact_id, fields in sent:
            crm_app.record_change(target, contact_id, fields)
        print(f"queued {len(sent)} contact changes in table crm_outbound")

        with Path(directory, "worker.log").open("w+b") as log:
            worker = start_worker("crm_app", HERE, {}, log,
                                  pool=("--pool", "prefork", "--concurrency", "4"))
            try:
                with crm_app.app.connection_for_read() as conn:
                    channel = conn.default_channel

                    def accounted() -> bool:
                        parked = int(channel.queue_declare("crm.parked").message_count)
                        return len(received(crm_app)) + parked == len(sent)

                    wait_until(accounted, started + DEADLINE, worker)
                    report(crm_app, conn)
            except (RuntimeError, TimeoutError) as exc:
                stop_worker(worker)
                log.seek(0)
                print(f"failed: {exc}\n{log.read().decode(errors='replace')}", file=sys.stderr)
                return 1
            status = int(stop_worker(worker))
    print(f"\nworker stopped (exit status {status}) after {time.monotonic() - started:.1f} s")
    return status


def received(crm_app: ModuleType) -> list[tuple[str, int, str]]:
    """What the fake CRMs received: (target, contact, email), in the order they got it."""
    table = crm_app.received
    with crm_app.engine().connect() as conn:
        rows = conn.execute(select(table.c.target, table.c.contact_id, table.c.fields)
                            .order_by(table.c.started)).all()
    return [(target, contact, json.loads(fields)["email"]) for target, contact, fields in rows]


def report(crm_app: ModuleType, conn: Connection) -> None:
    for target in TARGETS:
        print(f"\n{target} received, in this order:")
        for _, contact_id, email in (row for row in received(crm_app) if row[0] == target):
            print(f"  contact {contact_id}: {email}")
    print("\nparked in crm.parked:")
    with conn.SimpleQueue("crm.parked") as parked:
        while parked.qsize():
            message = parked.get(timeout=5)
            death = message.headers["x-sqlinbox-death"]
            print(f"  {message.headers['argsrepr']} after {death['attempts']} deliveries: "
                  f"{death['reason']}")
            message.ack()


if __name__ == "__main__":
    sys.exit(main())
