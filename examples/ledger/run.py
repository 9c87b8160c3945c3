"""Run the ledger example: interleaved postings of ten accounts on one worker with four
pool processes.

    python examples/ledger/run.py

Uses a temporary SQLite file unless ``LEDGER_DATABASE_URL`` names a database.
Starts ``celery -A ledger_app worker --pool prefork --concurrency 4``, waits until
every posting is applied, prints each account's statement (in the order applied)
and how many accounts were in work at once, stops the worker and exits.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

from sqlalchemy import select

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]
from demo.run import start_worker, stop_worker, wait_until  # noqa: E402

DEADLINE = 60.0
ACCOUNTS = [f"acct-{n}" for n in range(10)]
AMOUNTS = (100, -30, 50, -120, 10, -10)  # in this order every balance stays >= 0


def most_at_once(intervals: list[tuple[float, float]]) -> int:
    """The largest number of intervals that were open at one instant."""
    edges = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    running = best = 0
    for _, step in edges:
        running += step
        best = max(best, running)
    return best


def main() -> int:
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="sqlinbox-ledger-") as directory:
        os.environ.setdefault("LEDGER_DATABASE_URL", f"sqlite:///{directory}/ledger.db")
        import ledger_app
        from ledger_app import entries

        ledger_app.open_accounts(ACCOUNTS)
        for posting_no, amount in enumerate(AMOUNTS):
            for account in ACCOUNTS:  # interleaved: one posting of each account in turn
                ledger_app.post(account, posting_no, amount)
        total = len(AMOUNTS) * len(ACCOUNTS)
        print(f"queued {total} postings of {len(ACCOUNTS)} accounts in table ledger_postings")

        def applied() -> list[tuple[str, int, int, float, float]]:
            """(account, posting, balance after, started, finished), in the order applied."""
            with ledger_app.engine().connect() as conn:
                return [(r.account, r.posting_no, r.balance, r.started, r.finished)
                        for r in conn.execute(select(entries).order_by(entries.c.n))]

        with Path(directory, "worker.log").open("w+b") as log:
            worker = start_worker("ledger_app", HERE, {}, log,
                                  pool=("--pool", "prefork", "--concurrency", "4"))
            try:
                wait_until(lambda: len(applied()) == total, started + DEADLINE, worker)
            except (RuntimeError, TimeoutError) as exc:
                stop_worker(worker)
                log.seek(0)
                print(f"failed: {exc}\n{log.read().decode(errors='replace')}", file=sys.stderr)
                return 1
            status = int(stop_worker(worker))
        rows = applied()
    for account in ACCOUNTS[:3]:
        statement = ", ".join(f"#{no}: {balance}" for acct, no, balance, _, _ in rows
                              if acct == account)
        print(f"  {account}  {statement}")
    print(f"  ... and {len(ACCOUNTS) - 3} more accounts")
    in_order = all([no for acct, no, *_ in rows if acct == account] == list(range(len(AMOUNTS)))
                   for account in ACCOUNTS)
    print(f"every account's postings applied in order: {in_order}; "
          f"most accounts in work at once: {most_at_once([(s, f) for *_, s, f in rows])}")
    print(f"worker stopped (exit status {status}) after {time.monotonic() - started:.1f} s")
    return status or (0 if in_order else 1)


if __name__ == "__main__":
    sys.exit(main())
