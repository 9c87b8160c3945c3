"""The two example apps of docs/ordering.rst, run by real workers on every database.

* examples/crm: contact changes per target CRM, a FIFO group per target; a change
  the CRM refuses is retried in place, then parked in ``crm.parked`` while the
  target's later changes go on.
* examples/ledger: postings with the account as partition key on one worker with
  ``--pool prefork --concurrency 4``: each account's postings in order, accounts
  side by side.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from types import ModuleType

import pytest
from sqlalchemy import select
from sqlalchemy.engine import Engine

from tests.databases import drop_tables
from tests.docs.support import EXAMPLES, ROOT, load_example
from tests.integration.support import death
from tests.ordering.apps.common import Entry, any_overlap_across, by_group, overlaps
from tests.ordering.conftest import Ordering, wait_for_count
from tests.processes import Proc

TARGETS = ("hubspot", "salesforce", "zendesk")
VERSIONS = 30
POISON = ("hubspot", 10)
ACCOUNTS = [f"acct-{n}" for n in range(10)]
AMOUNTS = [100, -30, 50, -120, 10, -10, 40, -40, 25, -5, 5, -25]


def example(name: str, env_var: str, db_url: str, engine: Engine,
            monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """The example app ``examples/<name>/<name>_app.py`` on the database under test; its
    tables (all named ``<name>_...``) are dropped before and after."""
    drop_tables(engine, f"{name}_")
    monkeypatch.setenv(env_var, db_url)
    module = load_example(f"{name}/{name}_app.py")
    try:
        yield module
    finally:
        module.app.close()
        module.engine().dispose()
        drop_tables(engine, f"{name}_")


@pytest.fixture
def crm(db_url: str, engine: Engine, monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    yield from example("crm", "CRM_DATABASE_URL", db_url, engine, monkeypatch)


@pytest.fixture
def ledger(db_url: str, engine: Engine, monkeypatch: pytest.MonkeyPatch
           ) -> Iterator[ModuleType]:
    yield from example("ledger", "LEDGER_DATABASE_URL", db_url, engine, monkeypatch)


def example_worker(ordering: Ordering, name: str, env_var: str) -> list[Proc]:
    """One ``celery -A <name>_app worker --pool prefork --concurrency 4`` of an example."""
    env = {env_var: ordering.db_url, "PYTHONPATH": str(EXAMPLES / name)}
    return ordering.processes.workers(f"{name}_app", [name], env, "prefork", 4)


@pytest.mark.slow
def test_crm_sends_each_targets_changes_in_order_and_parks_the_poison(
        ordering: Ordering, crm: ModuleType) -> None:
    crm.create_tables()
    for version in range(VERSIONS):
        for target in TARGETS:
            email = "not-an-address" if (target, version) == POISON else f"v{version}@example.com"
            crm.record_change(target, version % 3, {"email": email, "version": version})
    workers = example_worker(ordering, "crm", "CRM_DATABASE_URL")

    def received() -> list[Entry]:
        table = crm.received
        with crm.engine().connect() as conn:
            rows = conn.execute(select(table.c.target, table.c.fields, table.c.started,
                                       table.c.finished)).all()
        return [Entry(target, json.loads(fields)["version"], 0, "done", started, finished)
                for target, fields, started, finished in rows]

    wait_for_count(lambda: len(received()), len(TARGETS) * VERSIONS - 1, "changes received",
                   workers)
    entries = received()
    for target, mine in by_group(entries).items():
        assert not overlaps(mine), f"{target}: two changes in work at once"
        expected = [v for v in range(VERSIONS) if (target, v) != POISON]
        assert [e.seq for e in mine] == expected, f"{target} received changes out of order"
    assert any_overlap_across(entries), "targets never ran side by side"

    with crm.app.connection_for_read() as conn, conn.SimpleQueue("crm.parked") as parked:
        message = parked.get(timeout=10)
        assert message.payload[0][:2] == ["hubspot", 10 % 3]
        assert message.payload[0][2]["email"] == "not-an-address"
        record = death(message)
        assert (record["queue"], record["attempts"]) == ("crm", 4)
        assert "max_attempts is 3" in record["reason"]
        message.ack()


@pytest.mark.slow
def test_ledger_applies_each_accounts_postings_in_order_on_one_prefork_worker(
        ordering: Ordering, ledger: ModuleType) -> None:
    ledger.open_accounts(ACCOUNTS)
    for posting_no, amount in enumerate(AMOUNTS):
        for account in ACCOUNTS:
            ledger.post(account, posting_no, amount)
    workers = example_worker(ordering, "ledger", "LEDGER_DATABASE_URL")

    table = ledger.entries

    def applied() -> list[tuple[str, int, int, float, float]]:
        with ledger.engine().connect() as conn:
            return [(r.account, r.posting_no, r.balance, r.started, r.finished) for r in
                    conn.execute(select(table).order_by(table.c.n))]

    wait_for_count(lambda: len(applied()), len(ACCOUNTS) * len(AMOUNTS), "postings applied",
                   workers)
    rows = applied()
    entries = [Entry(account, no, 0, "done", started, finished)
               for account, no, _, started, finished in rows]
    running = [sum(AMOUNTS[: n + 1]) for n in range(len(AMOUNTS))]
    for account, mine in by_group(entries).items():
        assert not overlaps(mine), f"{account}: two postings in work at once"
        assert [e.seq for e in mine] == list(range(len(AMOUNTS))), f"{account} out of order"
        statement = [balance for acct, _, balance, _, _ in rows if acct == account]
        assert statement == running, f"{account}: running balance {statement}"
    assert any_overlap_across(entries), "accounts never ran side by side"


@pytest.mark.slow
@pytest.mark.parametrize(("runner", "lines"), [
    ("crm/run.py", ["hubspot received, in this order:\n  contact 1: c1.v0@example.com\n"
                    "  contact 2: c2.v0@example.com\n  contact 2: c2.v1@example.com\n"
                    "  contact 1: c1.v2@example.com\n  contact 2: c2.v2@example.com\n",
                    "parked in crm.parked:\n  ('hubspot', 1, {'email': 'not-an-address', "
                    "'version': '1'}) after 4 deliveries: ",
                    "worker stopped (exit status 0)"]),
    ("ledger/run.py", ["  acct-0  #0: 100, #1: 70, #2: 120, #3: 0, #4: 10, #5: 0\n",
                       "every account's postings applied in order: True; "
                       "most accounts in work at once: ",
                       "worker stopped (exit status 0)"]),
])
def test_runner_prints_what_the_docs_show(runner: str, lines: list[str]) -> None:
    """``python examples/<app>/run.py`` on a temporary SQLite file, as docs/ordering.rst
    shows it."""
    done = subprocess.run([sys.executable, str(EXAMPLES / runner)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stdout + done.stderr
    for line in lines:
        assert line in done.stdout, done.stdout
