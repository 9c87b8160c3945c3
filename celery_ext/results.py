"""Celery's result backend in the service's database: ``result_backend =
"sqlinbox+postgresql://..."`` (MariaDB/MySQL and SQLite URLs too, as the broker takes
them).

Celery finds it under the ``celery.result_backends`` entry point ``sqlinbox``: Celery
reads a result backend URL's scheme up to its ``+`` as the backend's name, and hands
the rest (the SQLAlchemy URL) to it. One row per task (:mod:`kombu_sqlinbox.results`),
written by :meth:`SqlInboxBackend._store_result` as Celery's own database backend
writes its rows, so that the transport can write it in the transaction of a task's
acknowledgement later on; ``get()`` waits for a NOTIFY, the same-host signal or an
adaptive poll rather than a fixed half second.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from celery import states
from celery.backends.base import BaseBackend
from celery.exceptions import TimeoutError as CeleryTimeout
from celery.result import result_from_tuple
from kombu.utils.encoding import ensure_bytes

from kombu_sqlinbox.errors import ConfigurationError
from kombu_sqlinbox.options import TransportOptions
from kombu_sqlinbox.results import ResultStore, store_for
from kombu_sqlinbox.urls import URL_PREFIX, masked

#: the options ``result_backend_transport_options`` takes, and their defaults
#: (``table_prefix``: the broker's ``table_prefix`` when the broker sets one)
OPTIONS: dict[str, Any] = {
    "table_prefix": None,
    "create_tables": True,
    "engine_options": {},
    "max_result_bytes": None,
    "cleanup_batch": 1000,
}


def backend_options(app: Any) -> dict[str, Any]:
    """``result_backend_transport_options`` checked (a misspelt key fails at start-up,
    as the transport's own options do), over the defaults."""
    given = dict(app.conf.get("result_backend_transport_options") or {})
    unknown = sorted(set(given) - set(OPTIONS))
    if unknown:
        raise ConfigurationError(
            f"result_backend_transport_options: unknown key(s) {', '.join(unknown)}; "
            f"the sqlinbox result backend takes {', '.join(sorted(OPTIONS))}")
    options = {**OPTIONS, **given}
    if options["table_prefix"] is None:
        broker = dict(app.conf.get("broker_transport_options") or {})
        options["table_prefix"] = broker.get("table_prefix", TransportOptions.table_prefix)
    return options


def _date_done(seconds: float | None) -> datetime | None:
    return None if seconds is None else datetime.fromtimestamp(seconds, tz=timezone.utc)


class SqlInboxBackend(BaseBackend):
    """Task states and results, and saved groups, in two tables of the service's
    database under the table prefix (``<prefix>task_results``, ``<prefix>group_results``)."""

    #: ``ResultSet.iterate``'s wait between results: each ``get()`` waits woken
    subpolling_interval = 0.05

    def __init__(self, app: Any, url: str | None = None, **kwargs: Any) -> None:
        super().__init__(app, url=url, expires_type=float, **kwargs)
        if not url:
            raise ConfigurationError(
                "the sqlinbox result backend needs the database's URL: "
                "result_backend = 'sqlinbox+postgresql://user@host/db' "
                "(or sqlinbox+mysql://..., sqlinbox+sqlite:///jobs.db)")
        self.options = backend_options(app)
        self._store: ResultStore | None = None

    @property
    def store(self) -> ResultStore:
        """The process's store for this URL and options (connected on first use)."""
        if self._store is None:
            options = self.options
            self._store = store_for(str(self.url), options["table_prefix"],
                                    options["create_tables"], options["max_result_bytes"],
                                    options["engine_options"])
        return self._store

    def as_uri(self, include_password: bool = False) -> str:
        """The URL as configured (``sqlinbox+...``), its password masked unless asked for:
        the worker's banner shows it."""
        url = str(self.url or "")
        return URL_PREFIX + (url if include_password else masked(url, "**"))

    # -- tasks ---------------------------------------------------------------------------
    def _store_result(self, task_id: str, result: Any, state: str, traceback: Any = None,
                      request: Any = None, **kwargs: Any) -> Any:
        meta = self._get_result_meta(result=result, state=state, traceback=traceback,
                                     request=request, format_date=False)
        meta.pop("date_done", None)  # the database's clock sets it, in its own column
        meta["task_id"] = task_id
        self.store.store(task_id, state, ensure_bytes(self.encode(meta)),
                         state in states.READY_STATES, meta.get("name"), meta.get("worker"))
        return result

    def _get_task_meta_for(self, task_id: str) -> dict[str, Any]:
        found = self.store.read(task_id)
        if found is None:
            return {"status": states.PENDING, "result": None}
        meta: dict[str, Any] = self.decode_result(found.meta)
        meta["date_done"] = _date_done(found.date_done)
        return meta

    def _forget(self, task_id: str) -> None:
        self.store.forget(task_id)

    def task_result_exists(self, task_id: str) -> bool:
        return self.store.read(task_id) is not None

    # -- groups --------------------------------------------------------------------------
    def _save_group(self, group_id: str, result: Any) -> Any:
        self.store.save_group(group_id, ensure_bytes(self.encode(
            {"result": result.as_tuple()})))
        return result

    def _restore_group(self, group_id: str) -> dict[str, Any] | None:
        found = self.store.restore_group(group_id)
        if found is None:
            return None
        meta: dict[str, Any] = self.decode(found[0])
        meta["result"] = result_from_tuple(meta["result"], self.app)
        meta["date_done"] = _date_done(found[1])
        return meta

    def _delete_group(self, group_id: str) -> None:
        self.store.delete_group(group_id)

    # -- expiry --------------------------------------------------------------------------
    def cleanup(self) -> None:
        """Celery's ``backend_cleanup`` task: delete results older than
        ``result_expires``, in batches."""
        if self.expires:
            self.store.expire(float(self.expires), int(self.options["cleanup_batch"]))

    # -- waiting -------------------------------------------------------------------------
    def wait_for(self, task_id: str, timeout: float | None = None, interval: float = 0.5,
                 no_ack: bool = True, on_interval: Any = None) -> dict[str, Any]:
        """The task's meta once ready, read again at each wake-up for its result (or
        after at most ``interval`` seconds); Celery's ``TimeoutError`` after
        ``timeout`` seconds."""
        self._ensure_not_eager()

        def ready() -> dict[str, Any] | None:
            meta: dict[str, Any] = self.get_task_meta(task_id)
            return meta if meta["status"] in states.READY_STATES else None

        found = self.store.wait(task_id, ready, timeout, interval, on_interval)
        if found is None:
            raise CeleryTimeout("The operation timed out.")
        return found

    def __reduce__(self, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        return super().__reduce__(args, {**(kwargs or {}), "url": self.url,
                                         "expires": self.expires})
