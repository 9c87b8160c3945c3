"""A ledger: each account's postings applied in the order they were made, accounts in parallel.

Postings carry their account as the partition key. Within one worker, rows of
one key run one after another in claim order whatever the pool's concurrency,
while other accounts use the other pool processes. Each entry records the
balance after it, so an account's entries read as its statement, in order;
and since one account's postings never run at the same time, the update of its
balance never waits on another posting of the same account.

Partition keys order the rows *within one worker*. With several workers, give
the queue ``"claim": "advisory"`` (PostgreSQL, MySQL/MariaDB) so each account
is in work in one process at a time, or make the account a FIFO group.

``LEDGER_DATABASE_URL`` (an SQLAlchemy URL) names the database; the default is a
SQLite file in the working directory. ``python run.py`` beside this file runs it.
"""

from __future__ import annotations

import os
import time

from celery import Celery
from sqlalchemy import (
    Column,
    Double,
    Integer,
    MetaData,
    String,
    Table,
    create_engine,
    select,
    update,
)
from sqlalchemy.engine import Engine

import kombu_sqlinbox  # noqa: F401  (registers the sqlinbox+ broker URLs)
from celery_ext.tasks import InboxTask
from kombu_sqlinbox import TableBuilder

DATABASE_URL = os.environ.get("LEDGER_DATABASE_URL", "sqlite:///ledger.db")
#: the round trip to the clearing system each posting waits for
CLEARING_SECONDS = 0.02

# The queue table: the account is the partition key.
postings = (
    TableBuilder("ledger_postings")
    .id()
    .payload()
    .headers()
    .partition_key("account")
    .attempt()
    .locked_until()
    .available_at()
    .build()
)

app = Celery("ledger", broker=f"sqlinbox+{DATABASE_URL}")
app.conf.broker_connection_retry_on_startup = True
app.conf.task_default_queue = "postings"
app.conf.task_ignore_result = True
app.conf.broker_transport_options = {
    "table_prefix": "ledger_",
    "queues": {"postings": {"table": postings}},
}


def post(account: str, posting_no: int, amount: int) -> None:
    """Queue a posting; the postings of one account are applied in this order."""
    apply_posting.apply_async((account, posting_no, amount), headers={"partition_key": account})


# InboxTask acknowledges late: the account's next posting waits until this one is done.
@app.task(base=InboxTask)
def apply_posting(account: str, posting_no: int, amount: int) -> int:
    """Apply one posting; the entry records the balance after it (the account's statement)."""
    started = time.time()
    time.sleep(CLEARING_SECONDS)  # the clearing system confirms the posting
    with engine().begin() as conn:
        conn.execute(update(accounts).where(accounts.c.account == account)
                     .values(balance=accounts.c.balance + amount))
        balance: int = conn.execute(
            select(accounts.c.balance).where(accounts.c.account == account)).scalar_one()
        conn.execute(entries.insert(), {
            "account": account, "posting_no": posting_no, "amount": amount,
            "balance": balance, "started": started, "finished": time.time()})
    return balance


# -- the ledger's own tables -----------------------------------------------------------------
metadata = MetaData()
accounts = Table(
    "ledger_accounts", metadata,
    Column("account", String(64), primary_key=True),
    Column("balance", Integer, nullable=False),
)
entries = Table(
    "ledger_entries", metadata,
    Column("n", Integer, primary_key=True, autoincrement=True),
    Column("account", String(64), nullable=False),
    Column("posting_no", Integer, nullable=False),
    Column("amount", Integer, nullable=False),
    Column("balance", Integer, nullable=False),
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


def open_accounts(names: list[str]) -> None:
    """Create the ledger's tables and the accounts, with a balance of 0."""
    metadata.create_all(engine())
    with engine().begin() as conn:
        conn.execute(accounts.insert(), [{"account": name, "balance": 0} for name in names])
