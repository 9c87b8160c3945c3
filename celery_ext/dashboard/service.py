"""The dashboard's pages of the app's own parts: its outbox (republish), its recent
failures (the sqlinbox result backend's table) and the database scheduler's schedules
(pause, resume). Each says plainly when the app has no such part."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, inspect
from werkzeug.exceptions import BadRequest, NotFound
from werkzeug.wrappers import Request, Response

from kombu_sqlinbox.history import ResultsMissing

from ..beat import Schedules
from ..history_cli import duration_text, exception_text, source
from ..ops_render import timing_text
from ..outbox import OutboxError, outbox_of
from .pages import Site, positive_int

__all__ = ["Service"]

#: the failures page's window unless ``?since=`` says otherwise, and how many it lists
SINCE, LISTED = 3600, 50


class Service:
    """The outbox, failures and schedules pages of the dashboard's app (None: no app,
    only ``--url``: each page says it needs one)."""

    def __init__(self, dashboard: Site, app: Any) -> None:
        self.dashboard = dashboard
        self.ops = dashboard.ops
        self.app = app

    # -- the outbox ------------------------------------------------------------------
    def outbox(self, request: Request, identity: str) -> Response:
        """The outbox's counts and its oldest unprocessed record's age."""
        counts, missing = None, None
        try:
            counts = self._outbox().status(self.dashboard.exact_upto)
        except OutboxError as exc:
            missing = str(exc)
        return self.dashboard.render(request, "outbox.html", identity, live=True,
                                     counts=counts, missing=missing,
                                     exact_upto=self.dashboard.exact_upto)

    def republish(self, request: Request, identity: str) -> Response:
        """Send again the records unprocessed for longer than the grace period, after a
        confirmation saying how many are unprocessed."""
        try:
            found = self._outbox()
        except OutboxError as exc:
            raise BadRequest(str(exc)) from None
        if request.form.get("confirm") != "yes":
            return self.dashboard.render(
                request, "confirm_outbox.html", identity,
                count=found.status().unprocessed)
        done = found.republish()
        failed = ", ".join(map(str, done.failed)) or "none"
        return self.dashboard.told(request, identity, "outbox", f"republished {done.sent}, "
                                   f"failed {failed}, held back for their eta {done.held}")

    def _outbox(self) -> Any:
        if self.app is None:
            raise OutboxError("the outbox page needs the app (celery -A proj)")
        return outbox_of(self.app)

    # -- recent failures ---------------------------------------------------------------
    def failures(self, request: Request, identity: str) -> Response:
        """The failures of the last ``since`` seconds in the result table, the latest
        first, and per task."""
        since = positive_int(request, "since") or SINCE
        task = request.args.get("task") or None
        found = source(self.app, self.ops, results_only=False)
        listed: list[tuple[Any, str]] = []
        per_task: list[tuple[Any, str]] = []
        missing = None
        if found is None:
            missing = "the app's result backend is not sqlinbox: its failures are elsewhere"
        else:
            try:
                listed = [(each, exception_text(each, found.decode))
                          for each in found.history.failures(since, LISTED, task)]
                per_task = [(each, "-" if each.last is None
                             else exception_text(each.last, found.decode))
                            for each in found.history.summary(since, LISTED, task)]
            except ResultsMissing as exc:
                missing = str(exc)
        return self.dashboard.render(
            request, "failures.html", identity, live=True, missing=missing,
            window=duration_text(since), task=task or "", since=since, listed=listed,
            per_task=per_task)

    # -- schedules ---------------------------------------------------------------------
    def schedules(self, request: Request, identity: str) -> Response:
        """The database scheduler's schedules: timing, state, last and next run."""
        store = self._schedules()
        found, now = (store.all(), store.now()) if self._exists(store) else (None, 0.0)
        return self.dashboard.render(
            request, "schedules.html", identity, live=True, found=found, clock=now,
            timing=timing_text)

    def pause_schedule(self, request: Request, identity: str) -> Response:
        return self._switch(request, identity, "pause")

    def resume_schedule(self, request: Request, identity: str) -> Response:
        return self._switch(request, identity, "resume")

    def _switch(self, request: Request, identity: str, verb: str) -> Response:
        name = request.form.get("name", "")
        store = self._schedules()
        if not self._exists(store) or not getattr(store, verb)(name):
            raise NotFound(f"no schedule {name!r}")
        return self.dashboard.told(request, identity, "schedules", f"{verb}d {name}")

    def _schedules(self) -> Schedules:
        """The schedules under the transport's prefix, on the operations' database."""
        return Schedules(self.ops.broker.database, self.ops.options.table_prefix, self.app)

    @staticmethod
    def _exists(store: Schedules) -> bool:
        def look(conn: Connection) -> bool:
            return bool(inspect(conn).has_table(store.sql.names[0]))

        return bool(store.database.run(look, read_only=True))
