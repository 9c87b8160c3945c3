"""``dead requeue`` puts each dead letter back as its queue writes rows: through the
queue's declared publish statement (whatever its form, its task parameters bound), as
the raw row of a queue in row mode, with the death record it had before it died again
in a dead-letter queue; and a row that committed out of id order does not make a move
pass over another."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass
from typing import Any

import pytest
from kombu import Connection
from sqlalchemy import text
from sqlalchemy.engine import Engine

from kombu_sqlinbox.broker import Broker
from kombu_sqlinbox.codec import DEATH_HEADER
from kombu_sqlinbox.operations import DeadFilter, DeadLetter, Operations
from kombu_sqlinbox.options import parse_options
from kombu_sqlinbox.rows import Held
from tests.integration.support import get_within, quoted, rows
from tests.ops.apps import audit_table, events_table
from tests.ops.conftest import Cli


def select(engine: Engine, table: str, *columns: str) -> list[tuple[Any, ...]]:
    """``columns`` of every row of ``table``, by id."""
    with engine.connect() as conn:
        return [tuple(row) for row in conn.execute(text(
            f"SELECT {', '.join(columns)} FROM {quoted(engine, table)} ORDER BY id"))]


@contextmanager
def broker(broker_url: str, prefix: str, queues: dict[str, Any]) -> Iterator[Broker]:
    """The broker of a kombu connection with these queue options."""
    options = {"table_prefix": prefix, "polling_interval": 0.05, "queues": queues}
    with closing(Connection(broker_url, transport_options=options)) as conn:
        found: Broker = conn.default_channel.broker
        yield found


def park(found: Broker, queue: str, count: int) -> None:
    """Claim ``count`` rows of ``queue`` and reject them, as a consumer does."""
    table = found.table(queue)
    claimed = found.claim(table, count)
    assert len(claimed) == count
    for row in claimed:
        found.reject(Held(table, row.id, row.attempt), row, requeue=False)


def publish_task(conn: Connection, queue: str, task_id: str) -> None:
    conn.default_channel.queue_declare(queue)
    conn.Producer().publish([[1, 2], {}, {}], routing_key=queue, serializer="json",
                            headers={"task": "ops.add", "id": task_id})


@pytest.mark.parametrize("form", ["AUDIT", "AUDIT_FREE"])
def test_a_requeue_runs_the_declared_publish_statement_with_its_task_bound(
        cli: Cli, engine: Engine, broker_url: str, table_prefix: str, form: str) -> None:
    # the default statement creates the table; the service's columns are added after
    with broker(broker_url, table_prefix, {"audit": {"table": audit_table(
            table_prefix, broker_url, None)}}) as found:
        found.table("audit")
    table = quoted(engine, f"{table_prefix}audit")
    with engine.begin() as conn:
        for column in ("task_name", "task_id"):
            conn.execute(text(f"ALTER TABLE {table} ADD COLUMN {column} VARCHAR(64)"))
    declared = audit_table(table_prefix, broker_url, "free" if form == "AUDIT_FREE"
                           else "canonical")
    queues = {"audit": {"table": declared, "dead_letter_queue": "audit.dead"}}
    options = {"table": f"tests.ops.apps:{form}", "dead_letter_queue": "audit.dead"}
    with broker(broker_url, table_prefix, queues) as found, closing(Connection(
            broker_url, transport_options={"table_prefix": table_prefix, "queues": queues})
            ) as conn:
        publish_task(conn, "audit", "t-1")
        park(found, "audit", 1)
    assert select(engine, f"{table_prefix}audit", "id") == []
    checked = cli("check", options={"queues": {"audit": options}})
    assert checked.stdout.endswith(": 0 problem(s)\n"), checked.stdout
    refused = cli("dead", "requeue", "--keep-attempts", options={"queues": {"audit": options}},
                  check=False)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert ("queue 'audit' has a declared publish statement: a requeue runs it as a publish "
            "does, and its deliveries start from 0 (leave out --keep-attempts)") in (
        refused.stderr), refused.stderr
    moved = cli("dead", "requeue", options={"queues": {"audit": options}})
    assert moved.stdout.strip() == "requeued: 1", moved.stdout
    (back,) = select(engine, f"{table_prefix}audit", "task_name", "task_id", "attempt",
                     "headers")
    assert back[:3] == ("ops.add", "t-1", 0)
    assert DEATH_HEADER not in json.loads(back[3])["headers"]


@pytest.mark.drivers
def test_a_row_mode_dead_letter_goes_back_as_the_row_it_was(
        cli: Cli, engine: Engine, broker_url: str, table_prefix: str) -> None:
    queues = {"events": {"table": events_table(table_prefix), "dead_letter_queue": "events.dead"}}
    written = [("ops.add", b'{"x": 1, "y": 2}'), ("ops.add", b"\xff\xfe not UTF-8")]
    table = f"{table_prefix}events"
    with broker(broker_url, table_prefix, queues) as found:
        found.table("events")
        with engine.begin() as conn:
            for task, payload in written:
                conn.execute(text(f"INSERT INTO {quoted(engine, table)} (task, payload) "
                                  "VALUES (:task, :payload)"), {"task": task, "payload": payload})
        park(found, "events", 2)
    options = {"queues": {"events": {"table": "tests.ops.apps:EVENTS",
                                     "dead_letter_queue": "events.dead"}}}
    listed = json.loads(cli("dead", "list", "--json", options=options).stdout)
    assert [(dead["queue"], dead["task"]) for dead in listed] == [("events", "ops.add")] * 2
    moved = cli("dead", "requeue", "--task", "ops.add", "--keep-attempts", options=options)
    assert moved.stdout.strip() == "requeued: 2", moved.stdout
    back = select(engine, table, "task", "payload", "attempt")
    assert [(task, bytes(payload), attempt) for task, payload, attempt in back] == [
        (task, payload, 1) for task, payload in written]
    with closing(Connection(broker_url, transport_options={
            "table_prefix": table_prefix, "queues": queues})) as conn:
        assert get_within(conn, "events").payload[:2] == [[], {"x": 1, "y": 2}]


def test_a_dead_letter_of_a_dead_letter_queue_keeps_where_it_first_died(
        cli: Cli, engine: Engine, broker_url: str, table_prefix: str) -> None:
    queues = {"jobs": {"dead_letter_queue": "jobs.dead"},
              "jobs.dead": {"dead_letter_queue": "jobs.dead.dead"}}
    with broker(broker_url, table_prefix, queues) as found, closing(Connection(
            broker_url, transport_options={"table_prefix": table_prefix, "queues": queues})
            ) as conn:
        publish_task(conn, "jobs", "t-1")
        park(found, "jobs", 1)
        park(found, "jobs.dead", 1)
    options = {"queues": queues}
    (dead,) = json.loads(cli("dead", "list", "--json", "-D", "jobs.dead.dead",
                             options=options).stdout)
    assert (dead["queue"], dead["origin"], dead["task_id"]) == ("jobs.dead", "jobs", "t-1")
    shown = cli("dead", "show", str(dead["id"]), "-D", "jobs.dead.dead", options=options).stdout
    assert '"previous": {\n    "queue": "jobs",' in shown, shown
    assert cli("dead", "requeue", "-D", "jobs.dead.dead", options=options).stdout == (
        "requeued: 1\n")
    (again,) = json.loads(cli("dead", "list", "--json", "-D", "jobs.dead",
                              options=options).stdout)
    assert (again["queue"], again["origin"], again["task_id"]) == ("jobs", "jobs", "t-1")
    assert cli("dead", "requeue", "-D", "jobs.dead", options=options).stdout == "requeued: 1\n"
    (back,) = rows(engine, f"{table_prefix}jobs")
    assert DEATH_HEADER not in json.loads(back["headers"])["headers"]


@dataclass(frozen=True)
class CommitOnFirstLook(DeadFilter):
    """Takes every dead letter; the first time it is asked (a move has read its page and
    not yet locked it again), commits the transaction ``held`` began."""

    held: Any = None

    def __call__(self, dead: DeadLetter, now: float) -> bool:
        if self.held.in_transaction():
            self.held.commit()
        return super().__call__(dead, now)


@pytest.mark.databases("postgresql", "mysql")  # SQLite has one writer: ids commit in order
def test_a_row_committed_out_of_id_order_makes_a_move_pass_over_none(
        engine: Engine, broker_url: str, table_prefix: str) -> None:
    queues = {"jobs": {"dead_letter_queue": "jobs.dead"}}
    with broker(broker_url, table_prefix, queues) as found, closing(Connection(
            broker_url, transport_options={"table_prefix": table_prefix, "queues": queues})
            ) as conn:
        publish_task(conn, "jobs", "t-1")
        park(found, "jobs", 1)
        dead_table = quoted(engine, found.table("jobs.dead").spec.table)
    (parked,) = rows(engine, found.table("jobs.dead").spec.table)
    copy = text(f"INSERT INTO {dead_table} (payload, headers) VALUES (:payload, :headers)")
    values = {"payload": parked["payload"], "headers": parked["headers"]}
    with engine.connect() as held, engine.connect() as other:
        held.begin()
        held.execute(copy, values)  # the lower id, committed after the higher one
        with other.begin():
            other.execute(copy, values)
        ops = Operations(broker_url, parse_options({"table_prefix": table_prefix,
                                                   "queues": queues}))
        with closing(ops):
            assert ops.requeue(CommitOnFirstLook(held=held)) == 2
            assert ops.requeue() == 1  # the row committed after the first move looked
    assert len(rows(engine, f"{table_prefix}jobs")) == 3


def test_a_letter_that_cannot_go_back_is_left_and_said_the_others_go(
        cli: Cli, engine: Engine, broker_url: str, table_prefix: str) -> None:
    # ``events`` in row mode parks rows; then its table is dropped and the queue runs in
    # envelope mode (a new table of the default layout): those rows' columns have
    # nowhere to go. A parked
    # row whose body no longer matches its record does not read back at all. Around
    # them, envelope letters of ``jobs`` in the same dead-letter queue.
    queues = {"events": {"table": events_table(table_prefix), "dead_letter_queue": "dead"},
              "jobs": {"dead_letter_queue": "dead"}}
    events = f"{table_prefix}events"
    with broker(broker_url, table_prefix, queues) as found, closing(Connection(
            broker_url, transport_options={"table_prefix": table_prefix, "queues": queues})
            ) as conn:
        publish_task(conn, "jobs", "t-1")
        park(found, "jobs", 1)
        found.table("events")
        with engine.begin() as db:
            for _ in range(2):
                db.execute(text(f"INSERT INTO {quoted(engine, events)} (task, payload) "
                                "VALUES ('ops.add', :payload)"), {"payload": b"{}"})
        park(found, "events", 2)
        publish_task(conn, "jobs", "t-2")
        park(found, "jobs", 1)
        dead_table = found.table("dead").spec.table
    ids = [row["id"] for row in rows(engine, dead_table)]
    with engine.begin() as db:  # the second parked row: its body lost a column
        db.execute(text(f"DROP TABLE {quoted(engine, events)}"))
        db.execute(text(f"UPDATE {quoted(engine, dead_table)} SET payload = :payload "
                        "WHERE id = :id"), {"payload": b'{"payload": "{}"}', "id": ids[2]})
    now = {"queues": {"jobs": {"dead_letter_queue": "dead"},
                      "events": {"dead_letter_queue": "dead"}}}
    listed = json.loads(cli("dead", "list", "--json", options=now).stdout)
    assert [dead["id"] for dead in listed] == ids
    moved = cli("dead", "requeue", "--batch", "1", options=now, check=False)
    assert moved.returncode == 1, moved.stdout + moved.stderr
    assert moved.stdout.strip() == "requeued: 2", moved.stdout + moved.stderr
    assert "Traceback" not in moved.stderr, moved.stderr
    assert f"dead letter {ids[1]} of 'dead': its row has columns task that queue " \
        "'events' does not declare" in moved.stderr, moved.stderr
    assert f"dead letter {ids[2]} of 'dead': cannot read the parked row back" in (
        moved.stderr), moved.stderr
    assert [dead["id"] for dead in json.loads(
        cli("dead", "list", "--json", options=now).stdout)] == ids[1:3]
    assert len(rows(engine, f"{table_prefix}jobs")) == 2
