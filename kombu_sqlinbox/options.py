"""Transport options: every key is known, typed and checked before anything connects.

kombu's ``sqla`` transport passes unknown options straight to ``create_engine``;
here a misspelt key fails at start-up with its name, because a silently ignored
``max_attempts`` is a queue that never parks its poison messages.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from difflib import get_close_matches
from importlib import import_module
from typing import Any

from .errors import ConfigurationError
from .tables import InboxTable, TableBuilder, TableSpec, as_spec

#: keys kombu's Connection reads itself for its retry policy, and those of
#: ``Connection.ensure()``, which ``Producer.publish(retry=True, retry_policy=...)`` copies
#: into the connection's transport options (Celery's ``task_publish_retry_policy``):
#: accepted, not ours
KOMBU_KEYS = frozenset(
    {"max_retries", "interval_start", "interval_step", "interval_max", "connect_retries_timeout",
     "retry_errors", "errback", "on_revive"}
)
CLAIM_FORMS = ("lease", "row_lock", "advisory")
#: a rate limit's units: seconds per unit
RATE_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}


@dataclass(frozen=True)
class Rate:
    """A queue's rate limit: at most ``count`` claims per ``per`` seconds, across every
    worker (:mod:`.rates`)."""

    count: float
    per: float
    text: str

    @property
    def per_second(self) -> float:
        return self.count / self.per


def parse_rate(key: str, value: Any, whose: str = "") -> Rate | None:
    """A rate as Celery writes a task's ``rate_limit`` (:func:`celery.utils.time.rate`):
    ``"50/s"``, ``"10/m"``, ``"100/h"``, or a bare count per second (``50``, ``"50"``,
    ``"50/"``); None stays None (no limit). Anything else, zero included (Celery's "no
    limit", which a limit here would be read as "none may run"), is refused naming
    ``key`` and ``whose`` limit it is."""
    if value is None:
        return None
    written = str(value) if isinstance(value, (int, float)) and not isinstance(
        value, bool) else value.strip() if isinstance(value, str) else ""
    count, _, unit = written.partition("/")
    unit = unit.strip() or "s"
    try:
        number = float(count)
    except ValueError:
        number = 0.0
    if unit not in RATE_UNITS or not 0 < number < float("inf"):
        raise ConfigurationError(
            f"transport option {key}={value!r}{f' ({whose})' if whose else ''}: expected a "
            "positive count per second, minute or hour, as Celery writes a rate_limit: "
            "'50/s', '10/m', '100/h', or 50 (per second); None for no limit")
    return Rate(number, RATE_UNITS[unit], f"{count.strip()}/{unit}")


def _task_rates(key: str, value: Any, whose: str) -> tuple[tuple[str, Rate], ...]:
    """``{task name: rate}`` checked, as pairs (a task whose rate is None has none)."""
    if not isinstance(value, Mapping):
        raise ConfigurationError(
            f"transport option {key}={value!r} ({whose}): expected a dict of task name -> "
            "rate, such as {'proj.tasks.call_api': '10/s'}")
    pairs = []
    for task, rate in value.items():
        if not isinstance(task, str) or not task or len(task) > 255 or "\x00" in task:
            raise ConfigurationError(
                f"transport option {key} ({whose}): task name {task!r} is no non-empty "
                "string of at most 255 characters without NUL")
        parsed = parse_rate(f"{key}[{task!r}]", rate, f"{whose}, task {task!r}")
        if parsed is not None:
            pairs.append((task, parsed))
    return tuple(sorted(pairs, key=lambda pair: pair[0]))


ISOLATION_LEVELS = ("READ COMMITTED", "REPEATABLE READ", "SERIALIZABLE")


@dataclass(frozen=True)
class QueueOptions:
    """Settings of one queue; every field may be set globally or per queue."""

    table: TableSpec | None = None
    max_attempts: int | None = None
    dead_letter_queue: str | None = None
    claim: str = "lease"
    visibility_timeout: float = 30.0
    isolation_level: str | None = None
    sqlite_begin: str = "IMMEDIATE"
    #: False: the queue's publishes commit without waiting for the disk (PostgreSQL)
    synchronous_commit: bool = True
    #: (key prefix, limit) pairs, the longest prefix first: at most that many rows of a
    #: ``limit_key`` in work at once (prefix ``"*"``: any key); see :mod:`.limits`
    concurrency_limits: tuple[tuple[str, int], ...] = ()
    #: at most this many rows of the queue in work at once, across every worker
    max_in_work: int | None = None
    #: at most this many claims per second/minute/hour across every worker (:mod:`.rates`)
    rate_limit: Rate | None = None
    #: (task name, rate) pairs: at most that many claims of the task's messages in the
    #: queue, across every worker (:mod:`.task_rates`)
    task_rate_limits: tuple[tuple[str, Rate], ...] = ()


@dataclass(frozen=True)
class TransportOptions:
    """All transport options, parsed; see the configuration reference in the docs."""

    polling_interval: float = 0.2
    #: an idle consumer's first wait after a delivery; each empty round waits
    #: ``polling_backoff`` times longer, up to ``polling_interval``
    polling_interval_min: float = 0.005
    polling_backoff: float = 1.25
    create_tables: bool = True
    table_prefix: str = "sqlinbox_"
    engine_options: Mapping[str, Any] = field(default_factory=dict)
    max_batch: int = 100
    notify: bool = True
    #: seconds between two sweeps of expired queues and messages by one process
    sweep_interval: float = 5.0
    #: at most this many expired queues (and as many expired messages) per sweep
    sweep_batch: int = 500
    #: seconds after which a consumer reads the paused queues again (after a claim that
    #: took rows, or while it holds the queue paused), unless a wake-up said they changed
    #: first: how long a missed wake-up may delay a pause or a resume
    pause_check_interval: float = 1.0
    #: seconds an auto-delete or exclusive queue without ``x-expires`` outlives its last
    #: consumer (one that crashed cannot delete it)
    idle_queue_expires: float = 600.0
    #: declare the transport asynchronous: Celery consumes from its event loop
    event_loop: bool = False
    #: count the rows each queue settles per minute (:mod:`.throughput`)
    count_throughput: bool = True
    defaults: QueueOptions = QueueOptions()
    queues: Mapping[str, QueueOptions] = field(default_factory=dict)

    def for_queue(self, queue: str) -> QueueOptions:
        return self.queues.get(queue, self.defaults)


#: the options set for the whole transport only
TRANSPORT_KEYS = frozenset(option.name for option in fields(TransportOptions)) - {"defaults"}


def _number(key: str, value: Any, minimum: float, integer: bool = False,
            above: bool = False) -> Any:
    """``value`` checked: a number (an integer) >= ``minimum``, or > it when ``above``."""
    kind = int if integer else (int, float)
    low = isinstance(value, (int, float)) and (value <= minimum if above else value < minimum)
    if isinstance(value, bool) or not isinstance(value, kind) or low:
        wanted = "an integer" if integer else "a number"
        raise ConfigurationError(
            f"transport option {key}={value!r}: expected {wanted} {'>' if above else '>='} "
            f"{minimum}")
    return value


def _flag(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigurationError(f"transport option {key}={value!r}: expected True/False")
    return value


def _declaration(key: str, value: Any) -> TableSpec:
    if isinstance(value, str):
        module, _, name = value.partition(":")
        if not name:
            module, _, name = value.rpartition(".")
        try:
            value = getattr(import_module(module), name)
        except (ImportError, AttributeError) as exc:
            raise ConfigurationError(f"transport option {key}={value!r}: {exc}") from None
    if isinstance(value, (TableSpec, TableBuilder)) or (
        isinstance(value, type) and issubclass(value, InboxTable)
    ):
        return as_spec(value)
    raise ConfigurationError(
        f"transport option {key}: expected a table declaration, got {value!r}"
    )


#: the options of one queue, which also stand at the top as every queue's default
QUEUE_KEYS = frozenset({"max_attempts", "dead_letter_queue", "claim", "visibility_timeout",
                        "isolation_level", "sqlite_begin", "synchronous_commit",
                        "concurrency_limits", "max_in_work", "rate_limit",
                        "task_rate_limits"})
#: the longest key prefix a concurrency limit names (a key is at most as long)
MAX_LIMIT_KEY = 255


def _limits(key: str, value: Any) -> tuple[tuple[str, int], ...]:
    """``{key prefix: limit}`` checked, as pairs with the longest prefix first (the one
    a key takes its limit from); ``"*"`` stands for any key."""
    if not isinstance(value, Mapping):
        raise ConfigurationError(
            f"transport option {key}={value!r}: expected a dict of key prefix -> limit "
            "('*': any key)")
    pairs = []
    for prefix, limit in value.items():
        if not isinstance(prefix, str) or not prefix or len(prefix) > MAX_LIMIT_KEY:
            raise ConfigurationError(
                f"transport option {key}: key prefix {prefix!r} is no non-empty string of at "
                f"most {MAX_LIMIT_KEY} characters")
        pairs.append((prefix, _number(f"{key}[{prefix!r}]", limit, 1, integer=True)))
    return tuple(sorted(pairs, key=lambda pair: (pair[0] == "*", -len(pair[0]))))


def unknown_option(name: str, key: str, known: Iterable[str],
                   otherwise: str = "") -> ConfigurationError:
    """The error for a key no option has, naming the closest one, whatever its case: a
    typo is the usual cause, and the message should end the search for it. With no close
    one, ``otherwise`` says where the key belongs."""
    spelled = {name.lower(): name for name in known}
    close = get_close_matches(key.lower(), sorted(spelled), n=1)
    hint = f"; did you mean {spelled[close[0]]!r}?" if close else otherwise
    return ConfigurationError(f"unknown transport option {name!r}{hint}")


def _queue_options(prefix: str, raw: Mapping[str, Any], base: QueueOptions,
                   whose: str = "every queue's default") -> QueueOptions:
    if not isinstance(raw, Mapping):
        raise ConfigurationError(
            f"transport option {prefix.rstrip('.')}: expected a dict of queue options, "
            f"got {raw!r}")
    changes: dict[str, Any] = {}
    for key, value in raw.items():
        name = f"{prefix}{key}"
        if key not in QUEUE_KEYS and key != "table":
            wide = key in TRANSPORT_KEYS
            raise unknown_option(name, key, (*QUEUE_KEYS, "table"), (
                f"; {key!r} is set for the whole transport, not per queue" if wide else ""))
        if key == "table":
            changes[key] = _declaration(name, value)
        elif key == "max_attempts":
            changes[key] = None if value is None else _number(name, value, 1, integer=True)
        elif key == "visibility_timeout":
            changes[key] = float(_number(name, value, 1))
        elif key == "claim":
            if value not in CLAIM_FORMS:
                raise ConfigurationError(
                    f"transport option {name}={value!r}: expected one of {', '.join(CLAIM_FORMS)}"
                )
            changes[key] = value
        elif key == "isolation_level":
            if value is not None and value not in ISOLATION_LEVELS:
                raise ConfigurationError(
                    f"transport option {name}={value!r}: expected one of "
                    f"{', '.join(ISOLATION_LEVELS)}")
            changes[key] = value
        elif key == "sqlite_begin":
            if str(value).upper() not in ("DEFERRED", "IMMEDIATE"):
                raise ConfigurationError(
                    f"transport option {name}={value!r}: expected 'deferred' or 'immediate'")
            changes[key] = str(value).upper()
        elif key == "synchronous_commit":
            changes[key] = _flag(name, value)
        elif key == "concurrency_limits":
            changes[key] = _limits(name, value)
        elif key == "max_in_work":
            changes[key] = None if value is None else _number(name, value, 1, integer=True)
        elif key == "rate_limit":
            changes[key] = parse_rate(name, value, whose)
        elif key == "task_rate_limits":
            changes[key] = _task_rates(name, value, whose)
        elif key == "dead_letter_queue":
            if value is not None and (not isinstance(value, str) or not value):
                raise ConfigurationError(
                    f"transport option {name}={value!r}: expected a queue name")
            changes[key] = value
    made = replace(base, **changes)
    if (made.concurrency_limits or made.max_in_work is not None
            or made.task_rate_limits) and made.claim != "lease":
        raise ConfigurationError(
            f"transport option {prefix.rstrip('.') or 'claim'}: concurrency_limits, "
            f"max_in_work and task_rate_limits need claim='lease' (not {made.claim!r})")
    return made


def parse_options(raw: Mapping[str, Any] | None) -> TransportOptions:
    """Check and convert ``transport_options``; raise naming the first bad key."""
    raw = dict(raw or {})
    defaults = _queue_options("", {k: raw.pop(k) for k in list(raw) if k in QUEUE_KEYS},
                              QueueOptions())
    if "table" in raw:
        raise ConfigurationError("transport option 'table' belongs under queues={name: {...}}")
    result: dict[str, Any] = {"defaults": defaults}
    for key, value in raw.items():
        if key in KOMBU_KEYS:
            continue
        if key == "polling_interval":
            # zero would claim in a busy loop whenever the queues are empty
            result[key] = float(_number(key, value, 0, above=True))
        elif key in ("create_tables", "notify", "event_loop", "count_throughput"):
            result[key] = _flag(key, value)
        elif key == "polling_interval_min":
            result[key] = float(_number(key, value, 0, above=True))
        elif key == "polling_backoff":
            result[key] = float(_number(key, value, 1))
        elif key == "table_prefix":
            result[key] = str(value)
        elif key in ("max_batch", "sweep_batch"):
            result[key] = _number(key, value, 1, integer=True)
        elif key in ("sweep_interval", "idle_queue_expires", "pause_check_interval"):
            result[key] = float(_number(key, value, 0, above=True))
        elif key == "engine_options":
            if not isinstance(value, Mapping):
                raise ConfigurationError(f"transport option {key}: expected a dict")
            result[key] = dict(value)
        elif key == "queues":
            if not isinstance(value, Mapping):
                raise ConfigurationError(f"transport option {key}: expected a dict of queues")
            result[key] = {
                str(name): _queue_options(f"queues[{name!r}].",
                                          {} if settings is None else settings, defaults,
                                          f"queue {str(name)!r}")
                for name, settings in value.items()
            }
        else:
            raise unknown_option(key, key, (*TRANSPORT_KEYS, *QUEUE_KEYS, *KOMBU_KEYS), (
                f"; a queue's options go under queues={{{key!r}: {{...}}}}"
                if isinstance(value, Mapping) else ""))
    return TransportOptions(**result)

