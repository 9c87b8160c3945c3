"""Wake-ups and advisory key locks: what a dialect declaring ``wakeups`` or ``key_locks``
implements (the base has neither), and where processes on one host meet without the
server."""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Sequence
from typing import Any

from sqlalchemy import Connection

from ..tables import TableSpec
from .core import DialectCore

logger = logging.getLogger(__name__)


def no_wakeups(directory: str, why: object) -> None:
    """Warn that the same-host signal cannot use ``directory`` (a dialect's
    :meth:`Dialect.signal_directory` refused it, or a consumer could not bind there), so
    that a consumer polling where it was expected to be woken says why."""
    logger.warning("sqlinbox: no same-host wake-ups through %s (%s); consumers poll",
                   directory, why)


class WakeupFamily(DialectCore):
    """Waking idle consumers, and session-level locks on keys."""

    def channel(self, spec: TableSpec) -> str:
        raise NotImplementedError

    def wake(self, conn: Connection, spec: TableSpec) -> None:
        """Wake the table's idle consumers in other processes when ``conn`` commits."""

    def listen(self, dbapi_connection: Any, channels: Iterable[str],
               connecting: bool = True, dropped: Iterable[str] = ()) -> None:
        """LISTEN on ``channels`` and UNLISTEN ``dropped``; ``connecting``: the
        connection's first, as it is made."""
        raise NotImplementedError

    def keeps_notifications(self, dbapi_connection: Any) -> bool:
        """Whether notifications that arrive on a LISTEN connection while it runs a
        statement are still there for :meth:`take_notifications` (else the connection
        must only wait)."""
        return False

    def signal_directory(self) -> str | None:
        """Where processes of this database on one host meet for wake-ups without the
        server (a directory; None: the database has no such place, or the one it has is
        unusable, which :func:`no_wakeups` says)."""
        return None

    def take_notifications(self, dbapi_connection: Any) -> Collection[str]:
        """Read what arrived on a LISTEN connection: the channels notified (empty: none)."""
        raise NotImplementedError

    def try_key_locks(self, conn: Connection, space: int, keys: Sequence[str]) -> list[bool]:
        """Try a session-level lock per key without waiting; True where taken."""
        raise NotImplementedError

    def release_key_locks(self, conn: Connection, space: int, keys: Sequence[str]) -> None:
        raise NotImplementedError
