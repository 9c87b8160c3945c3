"""Pausing and resuming queues, as :class:`~.operations.Operations` offers it: the names
checked against the queues it knows, before anything is written."""

from __future__ import annotations

from difflib import get_close_matches

from .broker import Broker
from .errors import ConfigurationError
from .pausing import Paused
from .tables import HASHED_TABLE, TableSpec, check_name

__all__ = ["Paused", "QueuePausing"]


def unknown_queue(queue: str, known: list[str], what: str) -> ConfigurationError:
    """The error for a queue name that is not among ``known`` (the closest one named:
    a typo, or another case, is the usual cause)."""
    close = get_close_matches(queue, known, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else (
        f" (these are: {', '.join(known[:20])})" if known else " (there are none)")
    return ConfigurationError(f"{queue!r} is not {what}{hint}")


class QueuePausing:
    """Pause and resume queues for every worker of the database (:mod:`.pausing`)."""

    broker: Broker

    def queues(self) -> list[tuple[str, TableSpec]]:
        raise NotImplementedError

    def pause(self, queue: str, reason: str | None = None, by: str | None = None,
              force: bool = False) -> tuple[Paused, bool]:
        """Pause ``queue``: claims of it stop within one wake-up of every consumer (within
        ``pause_check_interval`` where none comes); what is in work finishes, publishes go
        on and their rows wait. ``by`` defaults to ``user@host``. Returns the pause kept
        and whether this call made it (False: it was paused already, and keeps its first
        record). A queue none of :meth:`queues` names is refused unless ``force`` (a
        queue not declared yet); a transient queue (remote control, replies, events)
        always."""
        check_name(queue)
        if self.broker.routes.is_transient(queue):
            raise ConfigurationError(
                f"{queue!r} is a transient queue (remote control, replies, events): it "
                "cannot be paused")
        listed = dict(self.queues())
        table = listed[queue].table if queue in listed else ""
        if (queue in (table, table.removeprefix(self.broker.options.table_prefix))
                and HASHED_TABLE.search(table)):
            raise ConfigurationError(
                f"{queue!r} is the name of table {table!r}, whose queue has another name "
                "(folded and hashed into it): no worker consumes a queue of that name. "
                "Pause its queue's own name (as the worker's -Q gives it, with --force "
                "where this app does not know it)")
        if not force:
            known = list(listed)
            if queue not in known:
                raise unknown_queue(queue, known, "a queue of this app or database (pass "
                                    "force=True, --force, to pause one not declared yet)")
        return self.broker.pauses.pause(queue, reason, by)

    def resume(self, queue: str) -> bool:
        """Resume ``queue``: its consumers are woken and claim again. False when it was not
        paused."""
        check_name(queue)
        return self.broker.pauses.resume(queue)

    def paused(self) -> list[Paused]:
        """Every paused queue, by name."""
        return self.broker.pauses.records()
