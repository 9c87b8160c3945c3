"""The time every statement compares with: the database's, unless a test pinned it.

Statements read "now" from one expression, :attr:`Dialect.now
<kombu_sqlinbox.dialects.Dialect.now>`. A :class:`Clock` installed for a database
(:func:`install`, before the dialects of the database are made) turns that expression into
``COALESCE(<the bound :sqlinbox_now>, <the database's now>)``: while the clock is
pinned, the bound value is the pinned time and countdowns, leases, ``retry_after``
and outbox grace periods fall due when the test advances it; unpinned, the bound
value is NULL and the database's clock runs. A database with no clock installed
(every production process) gets the plain expression, and pays nothing.

The clock is this process's: a worker in another process reads the database's own time.
"""

from __future__ import annotations

import threading
import time
from typing import Any

#: the name of the bound parameter that carries a pinned time (epoch seconds)
PARAMETER = "sqlinbox_now"

_CLOCKS: dict[tuple[Any, ...], Clock] = {}
_LOCK = threading.Lock()


class Clock:
    """A time that stands still until advanced (pinned), or the database's (unpinned)."""

    def __init__(self) -> None:
        self.pinned: float | None = None

    def pin(self, at: float | None = None) -> float:
        """Stop time at ``at`` (epoch seconds; this process's current time by default)."""
        self.pinned = time.time() if at is None else float(at)
        return self.pinned

    def advance(self, seconds: float) -> float:
        """Move a pinned time forward (pinning it now first if it is not pinned)."""
        start = self.pin() if self.pinned is None else self.pinned
        self.pinned = start + seconds
        return self.pinned

    def release(self) -> None:
        """Back to the database's clock."""
        self.pinned = None

    def value(self) -> float | None:
        """The bound value of :data:`PARAMETER`: the pinned time, or NULL."""
        return self.pinned


#: the port a URL naming none reaches (the servers' default)
DEFAULT_PORTS = {"postgresql": 5432, "mysql": 3306, "mariadb": 3306}


def key_of(url: Any) -> tuple[Any, ...]:
    """Which database a URL (an SQLAlchemy URL) reaches, drivers and credentials aside;
    a port left out is the server's default (``db/app`` and ``db:5432/app`` are one)."""
    backend = url.get_backend_name()
    return (backend, url.host, url.port or DEFAULT_PORTS.get(backend), url.database)


def install(url: Any) -> Clock:
    """The clock of the database at ``url`` (an SQLAlchemy URL), installed for the dialects
    made from now on in this process; installed once, the same clock every time after
    (a dialect already made keeps reading it)."""
    key = key_of(url)
    with _LOCK:
        found = _CLOCKS.get(key)
        if found is None:
            found = _CLOCKS[key] = Clock()
        return found


def uninstall(url: Any) -> None:
    """Dialects made from now on read the database's time again (those made before keep
    the clock, released)."""
    with _LOCK:
        found = _CLOCKS.pop(key_of(url), None)
    if found is not None:
        found.release()


def clock_for(url: Any) -> Clock | None:
    """The clock installed for the database at ``url``, if any."""
    return _CLOCKS.get(key_of(url)) if _CLOCKS else None
