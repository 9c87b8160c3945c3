"""The dashboard's pages and actions: each a method taking the request and who asks."""

from __future__ import annotations

import json
import time
from typing import Any, Protocol
from urllib.parse import urlencode

from werkzeug.datastructures import MultiDict
from werkzeug.exceptions import BadRequest, NotFound
from werkzeug.wrappers import Request, Response

from kombu_sqlinbox.browsing import blocked_groups, estimated_figures, ready_page
from kombu_sqlinbox.codec import DEATH_HEADER, DELIVERY_PROPERTIES
from kombu_sqlinbox.operations import DeadFilter, DeadLetter, Operations, QueueFigures

from ..ops_render import decoded_arguments
from .charts import charts

#: the dead letters' filters, as the forms and query strings name them
FILTERS = ("queue", "task", "reason", "older_than", "newer_than")
#: how many dead letters one read of the dead-letter page looks at, at most: a filter
#: that takes few of them shows what it found there, and goes on from the last one seen
LOOKED_AT = 1000


def filters_query(values: dict[str, Any]) -> str:
    """A query string of the non-empty ``values``."""
    return urlencode({key: value for key, value in values.items()
                      if value not in (None, "")})


#: the largest number a page takes (a row id, seconds): every database's widest integer
LARGEST = 2**63 - 1


def positive_int(request: Request, name: str) -> int:
    """A query argument that must be a whole number ≥ 0 (0 when absent)."""
    return whole(name, request.args.get(name, "") or "0")


def whole(name: str, raw: str) -> int:
    """``raw`` as a whole number from 0 to :data:`LARGEST` (ASCII digits only)."""
    if not (raw.isascii() and raw.isdigit()) or int(raw) > LARGEST:
        raise BadRequest(f"{name} must be a whole number up to {LARGEST}, not {raw[:40]!r}")
    return int(raw)


def about_of(figures: list[QueueFigures]) -> set[str]:
    """The queues whose figures are estimates."""
    return {found.queue for found in figures if found.about is not None}


class Site(Protocol):
    """What the pages need of the application (:class:`~.app.Dashboard`)."""

    ops: Operations
    page: int
    exact_upto: int

    def render(self, request: Request, template: str, identity: str | None,
               status: int = 200, live: bool = False, **values: Any) -> Response: ...

    def told(self, request: Request, identity: str, page: str, done: str,
             **query: str) -> Response: ...


class Pages:
    """What each route shows or does, over the dashboard's operations."""

    def __init__(self, dashboard: Site) -> None:
        self.dashboard = dashboard
        self.ops = dashboard.ops

    # -- queues ----------------------------------------------------------------------
    def queues(self, request: Request, identity: str) -> Response:
        """Every queue's figures (the ``queues`` command's; a large table's estimated) and
        its throughput over the last hour, refreshed live."""
        figures = estimated_figures(self.ops, exact_upto=self.dashboard.exact_upto)
        return self.dashboard.render(request, "queues.html", identity, live=True,
                                     figures=figures, about=about_of(figures),
                                     exact_upto=self.dashboard.exact_upto,
                                     charts=charts(self.ops, [f.queue for f in figures]))

    def queue(self, request: Request, identity: str, name: str) -> Response:
        """One queue: its figures, a keyset page of its ready rows, its blocked groups."""
        found = estimated_figures(self.ops, (name,), self.dashboard.exact_upto)
        figures = {each.queue: each for each in found}
        if name not in figures:
            raise NotFound(f"no queue {name!r}")
        after, page = positive_int(request, "after"), self.dashboard.page
        rows = ready_page(self.ops, name, after, page + 1)
        groups = blocked_groups(self.ops, name, positive_int(request, "groups_after"),
                                page + 1)
        return self.dashboard.render(
            request, "queue.html", identity, live=True, name=name, figures=figures[name],
            about=about_of(found), exact_upto=self.dashboard.exact_upto,
            rows=rows[:page], next_after=rows[page - 1].id if len(rows) > page else None,
            after=after, groups=None if groups is None else groups[:page],
            next_groups=(groups[page - 1].head if groups and len(groups) > page else None))

    # -- dead letters ----------------------------------------------------------------
    def dead_letters(self, request: Request, identity: str) -> Response:
        """A dead-letter queue's dead letters the filters take, a keyset page at a time,
        looking at :data:`LOOKED_AT` of them at most (then the page says where it
        stopped, and its next page goes on from there)."""
        configured = self.ops.configured_dead_letter_queues()
        dlq = request.args.get("dlq") or (configured[0] if configured else "")
        chosen, values = self.chosen(request.args)
        after, page = positive_int(request, "after"), self.dashboard.page
        found, stopped = self.taken(chosen, dlq, after, page + 1) if dlq else ([], None)
        more = found[page - 1].id if len(found) > page else stopped
        return self.dashboard.render(
            request, "dead.html", identity, configured=configured, dlq=dlq, values=values,
            found=found[:page], after=after, stopped=stopped,
            looked_at=LOOKED_AT, next_query=None if more is None else filters_query(
                {**values, "dlq": dlq, "after": more}))

    def taken(self, chosen: DeadFilter, dlq: str, after: int, limit: int
              ) -> tuple[list[DeadLetter], int | None]:
        """Up to ``limit`` dead letters of ``dlq`` after id ``after`` that ``chosen``
        takes, and the id of the last one looked at where :data:`LOOKED_AT` were looked
        at before ``limit`` were found (None: the table's end, or ``limit`` found)."""
        found: list[DeadLetter] = []
        now = time.time()
        for looked, dead in enumerate(self.ops.dead_letters(only=(dlq,), after=after), 1):
            if chosen(dead, now):
                found.append(dead)
                if len(found) >= limit:
                    return found, None
            if looked >= LOOKED_AT:
                return found, dead.id
        return found, None

    def dead_letter(self, request: Request, identity: str, dlq: str, row_id: int
                    ) -> Response:
        """One dead letter: its decoded arguments, death record and message."""
        found = self.ops.dead_letter(row_id, (dlq,))
        if not found:
            raise NotFound(f"no dead letter {row_id} in {dlq!r}")
        dead = found[0]
        message, arguments = dead.message, None
        shown: dict[str, Any] = {}
        if message is not None:
            arguments = decoded_arguments(message)
            shown = {key: value for key, value in message.items() if key != "body"}
            shown["headers"] = {key: value for key, value in message["headers"].items()
                                if key != DEATH_HEADER}
            shown["properties"] = {key: value for key, value in message["properties"].items()
                                   if key not in DELIVERY_PROPERTIES}
        return self.dashboard.render(
            request, "dead_one.html", identity, dead=dead, arguments=arguments,
            death=json.dumps(dead.death, indent=2, default=str),
            message=json.dumps(shown, indent=2, default=str))

    def requeue(self, request: Request, identity: str) -> Response:
        return self.act(request, identity, requeue=True)

    def purge(self, request: Request, identity: str) -> Response:
        return self.act(request, identity, requeue=False)

    def act(self, request: Request, identity: str, requeue: bool) -> Response:
        """Requeue or purge one dead letter (``row_id``) or those the filters take: first
        a confirmation page saying how many, then (``confirm=yes``) the operation, each
        batch one transaction; back to the list saying how many moved."""
        dlq = request.form.get("dlq", "")
        if not dlq:
            raise BadRequest("which dead-letter queue: dlq is missing")
        chosen, values = self.chosen(request.form)
        verb = "requeue" if requeue else "purge"
        if request.form.get("confirm") != "yes":
            count = sum(1 for dead in self.ops.dead_letters(chosen, (dlq,))
                        if dead.left(requeue) is None)
            return self.dashboard.render(
                request, "confirm.html", identity, verb=verb, count=count, dlq=dlq,
                values=values, row_id=chosen.row_id)
        refused: list[str] = []
        if requeue:
            moved = self.ops.requeue(chosen, (dlq,), refused=lambda dead, why: refused.append(
                f"{dead.id}: {why}"))
        else:
            moved = self.ops.purge(chosen, (dlq,))
        done = f"{verb}d {moved}" + (f"; left {'; '.join(refused)}" if refused else "")
        return self.dashboard.told(request, identity, "dead", done, **values, dlq=dlq)

    @staticmethod
    def chosen(given: MultiDict[str, str]) -> tuple[DeadFilter, dict[str, str]]:
        """The filter the form or query string gives, and its values as given."""
        values = {name: given.get(name, "").strip() for name in FILTERS}
        ages = {}
        for name in ("older_than", "newer_than"):
            try:
                ages[name] = float(values[name]) if values[name] else None
            except ValueError:
                raise BadRequest(f"{name} must be seconds, not {values[name]!r}") from None
        row = given.get("row_id", "").strip()
        return DeadFilter(values["queue"] or None, values["task"] or None,
                          values["reason"] or None, ages["older_than"], ages["newer_than"],
                          whole("row_id", row) if row else None), values
