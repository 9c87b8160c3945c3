"""Table declarations: both forms agree, bad declarations fail at once."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from kombu.utils.json import dumps

from kombu_sqlinbox import (
    Column,
    ConfigurationError,
    InboxTable,
    Role,
    TableBuilder,
    TableSpec,
    default_table,
)
from kombu_sqlinbox.tables import ColumnSpec, as_spec, table_name_for_queue


class EmailJobs(InboxTable, table="email_jobs", schema="crm"):
    job_id = Column(Role.ID, generated=True)
    body = Column(Role.PAYLOAD)
    meta = Column(Role.HEADERS)
    customer = Column(Role.GROUP, fifo=True)
    shard = Column(Role.PARTITION_KEY)
    tries = Column(Role.ATTEMPT)
    lease = Column(Role.LOCKED_UNTIL)
    due = Column(Role.AVAILABLE_AT, name="due_at")
    urgency = Column("priority")
    done = Column(Role.PROCESSED_AT)


BUILT = (
    TableBuilder("email_jobs", schema="crm")
    .id("job_id")
    .payload("body")
    .headers("meta")
    .group("customer", fifo=True)
    .partition_key("shard")
    .attempt("tries")
    .locked_until("lease")
    .available_at("due_at")
    .priority("urgency")
    .processed_at("done")
)


def test_declarative_class_and_builder_give_equal_specs() -> None:
    assert EmailJobs.__spec__ == BUILT.build()
    assert hash(EmailJobs.__spec__) == hash(BUILT.build())


def test_every_form_is_accepted_as_a_declaration() -> None:
    spec = BUILT.build()
    assert as_spec(EmailJobs) == as_spec(BUILT) == as_spec(spec) == spec


def test_declared_names_and_flags_are_kept() -> None:
    spec = EmailJobs.__spec__
    assert spec.name_of(Role.AVAILABLE_AT) == "due_at"
    assert spec.name_of(Role.PRIORITY) == "urgency"
    assert spec.column(Role.GROUP) == ColumnSpec("customer", Role.GROUP, fifo=True)
    assert spec.column(Role.ID) == ColumnSpec("job_id", Role.ID, generated=True)


def test_default_layout_is_a_declaration_like_any_other() -> None:
    built = (TableBuilder("sqlinbox_jobs").id().payload().headers().priority().available_at()
             .locked_until().attempt().build())
    # marked as the transport's own layout (whose index names its statements may use)
    assert not built.own
    assert default_table("sqlinbox_jobs") == replace(built, own=True)


@pytest.mark.parametrize("name", [
    'x"; DROP TABLE t; --', "1starts_with_digit", "has space", "dash-ed", "naïve", "",
    "a" * 64, "semi;colon", "back`tick", "jobs\n", "jobs\n; DROP TABLE t", "quo'te",
    'dou"ble', "tab\there", "jobs\r", "\uff4a\uff4f\uff42\uff53", "jobs\u00a0", "日本",
])
def test_invalid_identifiers_are_refused(name: str) -> None:
    with pytest.raises(ConfigurationError, match="not a valid identifier"):
        TableBuilder(name).id().payload().build()
    with pytest.raises(ConfigurationError, match="not a valid identifier"):
        TableBuilder("jobs").id().payload(name).build()
    with pytest.raises(ConfigurationError, match="not a valid identifier"):
        TableBuilder("jobs", schema=name).id().payload().build()


def test_longest_valid_identifier_is_accepted() -> None:
    assert TableBuilder("a" * 63).id().payload().build().table == "a" * 63


@pytest.mark.parametrize("builder, role", [
    (TableBuilder("jobs").payload().attempt(), "id"),
    (TableBuilder("jobs").id().headers(), "payload"),
])
def test_missing_required_role_is_refused(builder: TableBuilder, role: str) -> None:
    with pytest.raises(ConfigurationError, match=f"role {role}"):
        builder.build()


def test_missing_required_role_is_refused_in_the_declarative_form() -> None:
    with pytest.raises(ConfigurationError, match="role payload"):
        class NoPayload(InboxTable, table="no_payload"):
            id = Column(Role.ID)


def test_a_role_declared_twice_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="declared twice"):
        TableBuilder("jobs").id().payload("a").payload("b").build()


def test_one_column_with_two_roles_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="two roles"):
        TableBuilder("jobs").id().payload("x").headers("x").build()


def test_flags_only_fit_their_roles() -> None:
    with pytest.raises(ConfigurationError, match="only the id role"):
        ColumnSpec("payload", Role.PAYLOAD, generated=True)
    with pytest.raises(ConfigurationError, match="only the group role"):
        ColumnSpec("payload", Role.PAYLOAD, fifo=True)


def test_unknown_role_is_refused() -> None:
    with pytest.raises(ValueError):
        Column("not_a_role")


def test_as_spec_refuses_what_is_not_a_declaration() -> None:
    with pytest.raises(ConfigurationError, match="not a table declaration"):
        as_spec("email_jobs")  # type: ignore[arg-type]


def test_table_name_for_queue_is_stable() -> None:
    """Existing tables keep their queue: the mapping never changes between releases."""
    assert table_name_for_queue("celery") == "sqlinbox_celery"
    assert table_name_for_queue("celery", "app_") == "app_celery"
    assert table_name_for_queue("a.b@c") == "sqlinbox_a_b_c_00653d0e14"
    assert table_name_for_queue("celery.dead") == "sqlinbox_celery_dead_756e3887fd"
    hostile = 'x"; DROP TABLE t; --'
    assert table_name_for_queue(hostile) == "sqlinbox_x___drop_table_t_____8a1251f6e6"


@pytest.mark.parametrize("names", [
    ["a.b", "a_b", "a-b", "a@b", "a b", "a:b", "A_B", "A.B", "a.b."],
    ["q" * 200, "q" * 201, "q" * 200 + ".", "q" * 255],
    ["очередь", "ОЧЕРЕДЬ", "队列", "キュー"],
])
def test_table_names_for_queues_are_distinct_and_valid(names: list[str]) -> None:
    tables = [table_name_for_queue(name) for name in names]
    assert len(set(tables)) == len(names)
    for table in tables:
        assert TableSpec(table, (ColumnSpec("id", Role.ID), ColumnSpec("p", Role.PAYLOAD)))


@pytest.mark.parametrize("queue", ["", "q" * 256, "nul\x00byte"])
def test_unusable_queue_names_are_refused(queue: str) -> None:
    with pytest.raises(ConfigurationError, match="queue name"):
        table_name_for_queue(queue)


def test_kombus_json_writes_a_declared_table_as_its_name() -> None:
    """A worker's ``stats`` reply holds the transport options, declared tables too."""
    options = {"queues": {"emails": {"table": as_spec(EmailJobs)}}}
    assert json.loads(dumps(options)) == {"queues": {"emails": {"table": "email_jobs"}}}
