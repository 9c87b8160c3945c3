"""The dialect: :class:`Dialect`, composed of its statement families.

Each family lives in a module of its own, and a database's dialect overrides, family by
family, only what differs there:

* :mod:`.core`: the capabilities a dialect declares, identifiers, the database's time (and
  a test's clock bound into it);
* :mod:`.driver`: statements run as the driver's own SQL, engines, sessions, error codes;
* :mod:`.selection`: a claim's row selection (ready rows, claim order, FIFO heads, the
  claim floor);
* :mod:`.publish`: the publish statement, for one row and for many;
* :mod:`.schema`: a queue table's DDL, its checks and its claim's plan;
* :mod:`.unique`: unique keys: their column and index, the publish that writes nothing
  when its key is taken;
* :mod:`.queue`: the hot path, a table's compiled statements and the claims and
  settlements a consumer runs;
* :mod:`.operations`: the operations commands' figures and dead-letter moves;
* :mod:`.routing`: bindings, the queue registry, transient queues;
* :mod:`.pausing`: the paused queues;
* :mod:`.limits`: concurrency limits' slots and the claim of a queue with limits;
* :mod:`.rates`: the rate-limited queues' budget;
* :mod:`.outbox`: the transactional outbox's statements;
* :mod:`.results`: the result tables' statements (Celery's result backend);
* :mod:`.schedules`: the schedule tables' statements (the beat scheduler);
* :mod:`.wakeups`: wake-ups and advisory key locks.

A service adds a database by subclassing :class:`Dialect` and registering it
(:func:`kombu_sqlinbox.dialects.register`); what it must supply is listed in the docs'
"Plugging in another database".
"""

from __future__ import annotations

from ..rows import ClaimedRow
from .core import Capabilities
from .driver import DriverSql, json_text, plain_payload
from .limits import LimitedClaim, LimitFamily, LimitStatements
from .operations import OperationsFamily
from .outbox import OutboxFamily
from .pausing import PauseFamily, PauseStatements
from .publish import RowsInsert
from .queue import CANDIDATES, FLOOR_MARGIN, QueueFamily, Statements, Tokens
from .rates import RateFamily, RateStatements
from .results import ResultFamily, ResultStatements
from .routing import RoutingFamily, RoutingStatements
from .schedules import ScheduleFamily, ScheduleStatements
from .selection import FLOOR_REFRESH, FLOOR_STEP
from .throughput import ThroughputFamily, ThroughputStatements
from .unique import UniqueFamily, UniqueStatements
from .wakeups import WakeupFamily, no_wakeups

__all__ = [
    "CANDIDATES", "FLOOR_MARGIN", "FLOOR_REFRESH", "FLOOR_STEP", "Capabilities", "ClaimedRow",
    "Dialect", "DriverSql", "LimitStatements", "LimitedClaim", "PauseStatements",
    "RateStatements", "ResultStatements", "RoutingStatements", "RowsInsert",
    "ScheduleStatements", "Statements", "ThroughputStatements", "Tokens", "UniqueStatements",
    "json_text", "no_wakeups", "plain_payload",
]


class Dialect(LimitFamily, QueueFamily, UniqueFamily, OperationsFamily, PauseFamily, RateFamily,
              ThroughputFamily, RoutingFamily, OutboxFamily, ResultFamily, ScheduleFamily,
              WakeupFamily):
    """Base of the per-database dialects. Subclasses supply the SQL text."""
