"""Run the refund service once and account for every refund.

    python examples/refunds/run.py [--pool prefork|threads|solo]

Starts the fake card processor, takes four refund requests through the web
front end (one cancelled: its transaction rolls back), sends one refund message
a second time, then runs a real ``celery worker`` on the ``refunds`` and
``mail`` queues until every receipt is out. The card processor's first answer
for one order comes too late. The account shows one refund row, one receipt and
one payment per order, and nothing for the cancelled one; the exit status is 0
when it adds up.

The database is a temporary SQLite file, or ``REFUNDS_DATABASE_URL`` (order ids
are new on every run, so an existing database is only added to).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from card_processor import FakeCardProcessor  # noqa: E402  (beside this file)

DEADLINE = 60.0  # seconds for the whole run, worker start-up included


def main(pool: str) -> int:
    with tempfile.TemporaryDirectory(prefix="sqlinbox-refunds-") as directory:
        os.environ.setdefault("REFUNDS_DATABASE_URL", f"sqlite:///{directory}/refunds.db")
        os.environ.update(REFUNDS_CARD_TIMEOUT="1", REFUNDS_RETRY_SECONDS="0.5",
                          REFUNDS_MAIL_DIR=f"{directory}/mail")
        card = FakeCardProcessor(late_by=2.0)
        os.environ["REFUNDS_CARD_URL"] = card.url
        try:
            return run(pool, Path(directory), card)
        finally:
            card.close()


def run(pool: str, directory: Path, card: FakeCardProcessor) -> int:
    """The service's part: imported once the environment names the card processor."""
    import refunds_app
    from refunds_app import receipts, refund, refund_requests, refunds
    from sqlalchemy import func, select
    from sqlalchemy.orm import Session
    from web import request_refund

    from kombu_sqlinbox.tables import table_name_for_queue

    started = time.monotonic()
    tag = uuid.uuid4().hex[:4]
    orders = {f"{tag}-1001": 1250, f"{tag}-1002": 990, f"{tag}-1003": 7000}
    cancelled, late, twice = f"{tag}-1004", f"{tag}-1002", f"{tag}-1001"
    refunds_app.create_tables()
    engine = refunds_app.engine()

    print(f"refund service on {engine.url.render_as_string()}")
    card.time_out_once(late)
    for order_id, amount in orders.items():
        with Session(engine) as session:  # what a web view does, one request each
            request_refund(session, order_id, amount)
            session.commit()
    with Session(engine) as session:
        request_refund(session, cancelled, 500)
        session.rollback()  # the customer cancelled before the request finished
    refund.delay(twice, orders[twice])  # the same message again, as a re-send makes it
    print(f"requested {len(orders)} refunds, cancelled {cancelled}, sent {twice} twice; "
          f"the card processor's first answer for {late} comes late")

    def count(table: Any, *where: Any) -> int:
        with engine.connect() as conn:
            return int(conn.execute(select(func.count()).select_from(table)
                                    .where(*where)).scalar_one())

    def queued() -> int:
        with engine.connect() as conn:
            return sum(int(conn.exec_driver_sql(
                f"SELECT COUNT(*) FROM {table_name_for_queue(queue, 'sqlinbox_')}").scalar_one())
                for queue in ("refunds", "mail"))

    log_path = directory / "worker.log"
    with log_path.open("wb") as log:
        worker = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "refunds_app", "worker", "-P", pool,
             "-Q", "refunds,mail", "--without-gossip", "--without-mingle",
             "--without-heartbeat", "-l", "INFO"],
            cwd=HERE, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        while count(receipts) < len(orders) or queued():
            if worker.poll() is not None or time.monotonic() - started > DEADLINE:
                print(log_path.read_text(errors="replace")[-3000:])
                print("the refunds did not settle in time")
                return 1
            time.sleep(0.2)
    finally:
        worker.terminate()
        status = worker.wait(30)
    log_text = log_path.read_text(errors="replace")

    with engine.connect() as conn:
        rows = conn.execute(select(refunds.c.order_id, refunds.c.amount_cents,
                                   refunds.c.card_reference)
                            .where(refunds.c.order_id.in_([*orders, cancelled]))
                            .order_by(refunds.c.order_id)).all()
    paid = card.refunded()
    print("\nrefunds (one row per order, with the card processor's reference):")
    for order_id, amount, reference in rows:
        print(f"  {order_id}  {amount / 100:7.2f}  {reference}  "
              f"(card calls: {card.calls[order_id]}, paid: {f'refund-{order_id}' in paid})")
    sent = sorted(p.stem.removeprefix("receipt-") for p in (directory / "mail").glob("*.eml"))
    print(f"receipts recorded: {count(receipts, receipts.c.order_id.in_(orders))}, "
          f"mailed: {', '.join(sent)}")
    requested = count(refund_requests, refund_requests.c.order_id == cancelled)
    print(f"cancelled {cancelled}: {requested} request rows, {card.calls[cancelled]} card calls")
    dropped = "violated a unique key" in log_text
    print(f"second message for {twice}: {'dropped' if dropped else 'NOT dropped'}")
    print(f"worker stopped (exit status {status})")

    good = (
        [(r[0], r[2]) for r in rows] == [(o, paid[f"refund-{o}"]) for o in sorted(orders)]
        and count(receipts, receipts.c.order_id.in_(orders)) == len(orders)
        and sent == sorted(orders) and card.calls[late] == 2 and card.calls[cancelled] == 0
        and requested == 0
        and dropped and status == 0
    )
    print("\nexactly once: " + ("yes" if good else "NO"))
    return 0 if good else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pool", default="prefork", choices=("prefork", "threads", "solo"))
    sys.exit(main(parser.parse_args().pool))
