"""Transport options: every key known and typed; kombu's own keys pass."""

from __future__ import annotations

import re
from typing import Any

import pytest
from kombu import Connection
from sqlalchemy.engine import make_url

import kombu_sqlinbox
from kombu_sqlinbox import ConfigurationError, TableBuilder
from kombu_sqlinbox.database import engine_for, engine_keywords
from kombu_sqlinbox.options import KOMBU_KEYS, Rate, TransportOptions, parse_options
from kombu_sqlinbox.rates import Budget

#: importable by dotted path, as a Celery config file would name it
DECLARED = TableBuilder("declared_jobs").id().payload().attempt().locked_until().build()


def test_no_options_give_the_defaults() -> None:
    assert parse_options(None) == TransportOptions()


@pytest.mark.parametrize("raw, name", [
    ({"visiblity_timeout": 30}, "visiblity_timeout"),
    ({"pool_recycle": 3600}, "pool_recycle"),
    ({"queues": {"jobs": {"max_attempt": 3}}}, "max_attempt"),
])
def test_unknown_key_is_refused_by_name(raw: dict[str, Any], name: str) -> None:
    with pytest.raises(ConfigurationError, match=f"unknown transport option .*{name}"):
        parse_options(raw)


def test_unknown_key_fails_when_the_kombu_connection_is_made() -> None:
    conn = Connection("sqlinbox+sqlite:///unused.db", transport_options={"bogus": 1})
    with pytest.raises(ConfigurationError, match="bogus"):
        conn.transport  # noqa: B018  (building the transport parses the options)


@pytest.mark.parametrize("raw", [
    {"polling_interval": "fast"},
    {"polling_interval": -1},
    {"polling_interval": 0},
    {"polling_interval": 0.0},
    {"create_tables": "yes"},
    {"max_batch": 0},
    {"max_batch": 1.5},
    {"max_batch": True},
    {"engine_options": ["pool_size", 5]},
    {"queues": ["jobs"]},
    {"visibility_timeout": 0},
    {"visibility_timeout": "30"},
    {"max_attempts": 0},
    {"max_attempts": 2.5},
    {"max_attempts": True},
    {"claim": "optimistic"},
    {"dead_letter_queue": ""},
    {"dead_letter_queue": 7},
    {"queues": {"jobs": {"visibility_timeout": None}}},
    {"queues": {"jobs": {"table": "no_such_module:Table"}}},
    {"queues": {"jobs": {"table": 42}}},
    {"table": DECLARED},
])
def test_bad_values_are_refused(raw: dict[str, Any]) -> None:
    with pytest.raises(ConfigurationError):
        parse_options(raw)


@pytest.mark.parametrize("raw, name", [
    ({"polling_interval": 0}, "polling_interval"),
    ({"polling_interval": -0.5}, "polling_interval"),
    ({"queues": {"jobs": "oops"}}, "queues['jobs']"),
    ({"queues": {"jobs": ["max_attempts", 3]}}, "queues['jobs']"),
])
def test_bad_value_names_its_key(raw: dict[str, Any], name: str) -> None:
    with pytest.raises(ConfigurationError, match=re.escape(name)):
        parse_options(raw)


@pytest.mark.parametrize("value", ["50/x", "0/s", "-1/s", "fast", "/s", "nan/s", "inf/m",
                                   0, "0", True, "", ["50/s"]])
def test_a_bad_rate_limit_is_refused_naming_its_queue_and_what_is_expected(
        value: Any) -> None:
    with pytest.raises(ConfigurationError, match=re.escape(
            f"transport option queues['jobs'].rate_limit={value!r} (queue 'jobs'): "
            "expected a positive count per second, minute or hour, as Celery writes a "
            "rate_limit: '50/s', '10/m', '100/h', or 50 (per second)")):
        parse_options({"queues": {"jobs": {"rate_limit": value}}})


def test_a_bad_default_or_task_rate_limit_says_whose_it_is() -> None:
    with pytest.raises(ConfigurationError, match=re.escape(
            "transport option rate_limit='5/d' (every queue's default)")):
        parse_options({"rate_limit": "5/d"})
    with pytest.raises(ConfigurationError, match=re.escape(
            "transport option queues['jobs'].task_rate_limits['proj.call']='x' "
            "(queue 'jobs', task 'proj.call')")):
        parse_options({"queues": {"jobs": {"task_rate_limits": {"proj.call": "x"}}}})
    with pytest.raises(ConfigurationError, match="task name 5 is no non-empty string"):
        parse_options({"task_rate_limits": {5: "1/s"}})
    with pytest.raises(ConfigurationError, match="task_rate_limits need claim='lease'"):
        parse_options({"task_rate_limits": {"proj.call": "1/s"}, "claim": "row_lock"})


@pytest.mark.parametrize("value, count, per", [
    ("50/s", 50, 1), (" 10/m", 10, 60), ("100 / h", 100, 3600), ("0.5/s", 0.5, 1),
    (50, 50, 1), ("50", 50, 1), (0.5, 0.5, 1), ("50/", 50, 1)])
def test_a_rate_limit_as_celery_writes_it(value: Any, count: float, per: float) -> None:
    """Celery's forms (:func:`celery.utils.time.rate`): a bare count is per second."""
    limit = parse_options({"rate_limit": value}).defaults.rate_limit
    assert limit is not None and (limit.count, limit.per) == (count, per)


def test_task_rate_limits_are_pairs_by_task_name() -> None:
    options = parse_options({"queues": {"jobs": {"task_rate_limits": {
        "proj.b": "10/s", "proj.a": 5, "proj.none": None}}}})
    assert [(task, rate.per_second) for task, rate in
            options.queues["jobs"].task_rate_limits] == [("proj.a", 5.0), ("proj.b", 10.0)]


@pytest.mark.parametrize("rate, width, tokens, shards", [
    (Rate(50, 1, "50/s"), 0.2, 10, 5), (Rate(10, 60, "10/m"), 6.0, 1, 1),
    (Rate(1000, 1, "1000/s"), 0.2, 200, 8), (Rate(4, 1, "4/s"), 0.25, 1, 1)])
def test_a_rate_is_cut_into_short_windows_of_whole_tokens(
        rate: Rate, width: float, tokens: int, shards: int) -> None:
    budget = Budget.of(rate)
    assert (round(budget.width, 9), budget.tokens, budget.shards) == (width, tokens, shards)
    assert sum(budget.share(shard) for shard in range(shards)) == tokens


def test_kombu_retry_keys_are_accepted() -> None:
    raw = dict.fromkeys(KOMBU_KEYS, 3)
    assert {"max_retries", "interval_start", "interval_step", "interval_max"} <= KOMBU_KEYS
    assert parse_options(raw) == TransportOptions()


def test_queue_settings_start_from_the_global_ones() -> None:
    options = parse_options({
        "visibility_timeout": 60, "max_attempts": 5,
        "queues": {"jobs": {"dead_letter_queue": "jobs.dead"}},
    })
    jobs = options.for_queue("jobs")
    assert (jobs.visibility_timeout, jobs.max_attempts, jobs.dead_letter_queue) == (
        60.0, 5, "jobs.dead")
    other = options.for_queue("other")
    assert (other.visibility_timeout, other.max_attempts, other.dead_letter_queue) == (
        60.0, 5, None)


@pytest.mark.parametrize("table", [
    DECLARED, TableBuilder("declared_jobs").id().payload().attempt().locked_until(),
    f"{__name__}:DECLARED", f"{__name__}.DECLARED",
])
def test_a_queue_table_may_be_given_in_any_form(table: Any) -> None:
    options = parse_options({"queues": {"jobs": {"table": table}}})
    assert options.for_queue("jobs").table == DECLARED


def test_importing_the_package_registers_the_alias() -> None:
    from kombu.transport import TRANSPORT_ALIASES

    assert kombu_sqlinbox.__version__
    assert TRANSPORT_ALIASES["sqlinbox"] == "kombu_sqlinbox.transport:Transport"


@pytest.mark.parametrize("url", [
    "sqlinbox+sqlite://",
    "sqlinbox+sqlite:///:memory:",
    "sqlinbox+sqlite:///file::memory:?cache=shared&uri=true",
    "sqlinbox+sqlite:///file:jobs?mode=memory&cache=shared&uri=true",
])
def test_an_in_memory_sqlite_database_is_refused_at_start_up(url: str) -> None:
    """Every pooled connection (and every process) would see a database of its own."""
    conn = Connection(url)
    try:
        with pytest.raises(ConfigurationError, match=r"in memory.*use a file"):
            conn.connect()
    finally:
        conn.release()


@pytest.mark.parametrize("raw, name, meant", [
    ({"visiblity_timeout": 30}, "'visiblity_timeout'", "visibility_timeout"),
    ({"queues": {"celery": {"max_atempts": 3}}}, "\"queues['celery'].max_atempts\"",
     "max_attempts"),
    ({"polling_intervall": 1}, "'polling_intervall'", "polling_interval"),
    ({"VISIBILITY_TIMEOUT": 30}, "'VISIBILITY_TIMEOUT'", "visibility_timeout"),
    ({"queues": {"celery": {"Max_Attempts": 3}}}, "\"queues['celery'].Max_Attempts\"",
     "max_attempts"),
])
def test_a_misspelled_key_names_the_closest_option(raw: dict[str, Any], name: str,
                                                   meant: str) -> None:
    with pytest.raises(ConfigurationError) as raised:
        parse_options(raw)
    assert str(raised.value) == f"unknown transport option {name}; did you mean {meant!r}?"


@pytest.mark.parametrize("raw, message", [
    ({"queues": {"celery": {"polling_interval": 1}}},
     "unknown transport option \"queues['celery'].polling_interval\"; 'polling_interval' "
     "is set for the whole transport, not per queue"),
    ({"celery": {"max_attempts": 3}},
     "unknown transport option 'celery'; a queue's options go under "
     "queues={'celery': {...}}"),
])
def test_a_key_in_the_wrong_place_says_where_it_goes(raw: dict[str, Any],
                                                     message: str) -> None:
    with pytest.raises(ConfigurationError) as raised:
        parse_options(raw)
    assert str(raised.value) == message


@pytest.mark.parametrize("settings", [0, "", [], False])
def test_a_queue_given_no_dict_of_options_is_refused(settings: Any) -> None:
    with pytest.raises(ConfigurationError, match=r"expected a dict of queue options"):
        parse_options({"queues": {"celery": settings}})


def test_a_key_like_no_option_names_none() -> None:
    with pytest.raises(ConfigurationError) as raised:
        parse_options({"zzzz": 1})
    assert str(raised.value) == "unknown transport option 'zzzz'"


URLS = ("postgresql://app@127.0.0.1/test", "mysql+pymysql://app@127.0.0.1/test",
        "sqlite:///unused.db")


@pytest.mark.parametrize("url", URLS)
@pytest.mark.parametrize("raw, meant", [
    ({"pool_pre_pingg": True}, "pool_pre_ping"),  # the pool's, under its create_engine name
    ({"timeout": 5}, "pool_timeout"),
    ({"connect_argss": {}}, "connect_args"),  # create_engine's own
    ({"hide_parameter": True}, "hide_parameters"),  # the Engine's
])
def test_a_misspelled_engine_option_names_the_closest_create_engine_keyword(
        url: str, raw: dict[str, Any], meant: str) -> None:
    (key,) = raw
    with pytest.raises(ConfigurationError, match=re.escape(
            f"unknown transport option \"engine_options[{key!r}]\"; did you mean {meant!r}?")):
        engine_for(url, **raw)


def test_the_keywords_offered_are_the_dialects_own() -> None:
    with pytest.raises(ConfigurationError, match="did you mean 'use_native_hstore'"):
        engine_for(URLS[0], use_native_hstor=False)
    assert "use_native_hstore" in engine_keywords(make_url(URLS[0]))
    assert "use_native_hstore" not in engine_keywords(make_url(URLS[2]))


@pytest.mark.parametrize("url", URLS)
def test_connect_args_reach_the_driver_unchecked(url: str) -> None:
    """What the driver takes is the driver's to judge, when it connects."""
    engine, _ = engine_for(url, connect_args={"any_driver_setting": 1}, pool_pre_ping=True)
    engine.dispose()


@pytest.mark.parametrize(("options", "kind"), [
    ({"execution_options": 5}, TypeError),  # not a keyword it lacks: a value it cannot use
    ({"poolclass": "NullPool"}, AttributeError),
])
def test_a_value_create_engine_cannot_use_is_a_configuration_error(
        options: dict[str, object], kind: type[Exception]) -> None:
    """The user's mistake, said as the engine options' (SQLAlchemy's error behind it)."""
    with pytest.raises(ConfigurationError, match=r"^transport option engine_options: "
                       rf"create_engine\(\) refused it \({kind.__name__}: ") as raised:
        engine_for(URLS[2], **options)
    assert isinstance(raised.value.__cause__, kind)


@pytest.mark.parametrize(("queue", "error"), [
    ({"max_in_work": 2, "claim": "row_lock"}, "need claim='lease'"),
    ({"concurrency_limits": {"*": 0}}, r"\['\*'\]=0: expected an integer >= 1"),
    ({"concurrency_limits": {"": 2}}, "key prefix '' is no non-empty string"),
    ({"concurrency_limits": [("*", 2)]}, "expected a dict of key prefix -> limit"),
    ({"max_in_work": 0}, "max_in_work=0: expected an integer >= 1"),
])
def test_a_concurrency_limit_that_cannot_hold_is_refused(queue: dict[str, Any],
                                                         error: str) -> None:
    with pytest.raises(ConfigurationError, match=error):
        parse_options({"queues": {"jobs": queue}})


def test_a_key_takes_the_limit_of_its_longest_prefix() -> None:
    from kombu_sqlinbox.limits import limit_of
    options = parse_options({"concurrency_limits": {"*": 2, "t-": 3, "t-vip-": 9}}).defaults
    assert [limit_of(options, key) for key in ("x", "t-1", "t-vip-1")] == [2, 3, 9]
    assert limit_of(parse_options({"concurrency_limits": {"t-": 3}}).defaults, "x") is None
