"""Chords counted in the service's database: the chord half of the sqlinbox result backend
(:class:`celery_ext.results.SqlInboxBackend`).

One counter row per chord (``<prefix>chords``): its size, the header tasks counted, and
its meta, which keeps what the body receives: the header's results in order and the
results beyond it, ``more`` (tasks added with ``Task.add_to_chord``). A header given as
a generator, whose task ids are known only as they run, has each part record its id in a
row of its own (``<prefix>chord_parts``) as it is counted, ordered by its group index as
the Redis backend orders them. A count reads and writes the counter's numbers only, so
it costs the same however large the chord; the last part counted reads the rest and
publishes the body in the transaction counting it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime, timezone
from functools import partial
from typing import Any

from celery import states
from celery.backends.base import BaseBackend, _create_chord_error_with_cause
from celery.canvas import maybe_signature
from celery.exceptions import ChordError
from celery.result import AsyncResult, ResultSet, result_from_tuple
from celery.utils.functional import _regen
from kombu.utils.encoding import ensure_bytes
from sqlalchemy import Connection

from kombu_sqlinbox import binding
from kombu_sqlinbox.broker import Broker, same_database
from kombu_sqlinbox.results import ResultStore, StoredResult

from .delivery import TransactionalTaskError, broker_of

logger = logging.getLogger(__name__)

#: a request attribute: its chord part was counted with its result
COUNTED = "sqlinbox_chord_counted"
#: what runs once a chord's counting transaction committed (its error callbacks)
After = Callable[[], Any] | None


def _leaves(result: Any) -> list[str]:
    """The task ids of a header's results, nested groups' included."""
    if isinstance(result, ResultSet):
        return [leaf for part in result.results for leaf in _leaves(part)]
    return [result.id] if isinstance(result, AsyncResult) else []


def date_done(seconds: float | None) -> datetime | None:
    return None if seconds is None else datetime.fromtimestamp(seconds, tz=timezone.utc)


def _in_order(parts: list[tuple[int | None, str]]) -> list[tuple[int | None, str]]:
    """A generator's parts by group index (none last), then by id: the Redis backend's
    order (a sorted set by group index), an added task beside its adder."""
    return sorted(parts, key=lambda part: (part[0] is None, part[0] or 0, part[1]))


class ChordBackend(BaseBackend):
    """Celery's chord calls on the counter rows of :attr:`store`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._chords: tuple[Broker | None] | None = None

    @property
    def store(self) -> ResultStore:
        """The result tables (the backend's)."""
        raise NotImplementedError

    def _row(self, task_id: str, result: Any, state: str, traceback: Any,
             request: Any) -> tuple[str, bytes, Any, Any]:
        """A task's state, encoded meta, name and worker, as the backend writes them."""
        raise NotImplementedError

    def _meta(self, found: StoredResult) -> dict[str, Any]:
        meta: dict[str, Any] = self.decode_result(found.meta)
        finished = found.status in states.READY_STATES  # each write stamps it: for expiry
        meta["date_done"] = date_done(found.date_done) if finished else None
        return meta

    def _chord_broker(self) -> Broker | None:
        """The sqlinbox broker on this database, which publishes a chord's body in the
        transaction counting its last header task; None (another broker or database):
        Celery's ``chord_unlock`` runs the chord instead."""
        if self._chords is None:
            try:
                broker: Broker | None = broker_of(self.app)
            except TransactionalTaskError:
                broker = None
            if broker is not None and not same_database(broker.engine,
                                                        self.store.database.engine):
                broker = None
            self._chords = (broker,)
        return self._chords[0]

    def apply_chord(self, header_result_args: Any, body: Any, **kwargs: Any) -> Any:
        """Save the chord's counter row, its header's results in order (what the body
        receives; its size: :meth:`set_chord_size`), in the bound transaction if any. A
        header given as a generator is left unread (Celery publishes each of its tasks
        as it comes): its parts keep their ids as they are counted."""
        if self._chord_broker() is None:
            return super().apply_chord(header_result_args, body, **kwargs)
        group_id, results = header_result_args[0], header_result_args[1]
        generated = isinstance(results, _regen)
        header = None if generated else self.app.GroupResult(*header_result_args).as_tuple()
        self.store.save_chord(group_id, ensure_bytes(self.encode(
            {"header": header, "more": []})), generated, self.store.database.bound_caller())
        return None

    def set_chord_size(self, group_id: str, chord_size: int) -> None:
        """Celery calls it before publishing the header's last task: no count completes before."""
        if self._chord_broker() is not None:
            self.store.size_chord(group_id, chord_size, self.store.database.bound_caller())

    def add_to_chord(self, chord_id: str, result: Any) -> None:
        """``Task.add_to_chord`` from a header task: one more task expected by the chord,
        its result among the body's values after the header's; in the bound transaction
        if any."""
        if self._chord_broker() is None:
            super().add_to_chord(chord_id, result)  # Celery's NotImplementedError
            return

        def more(meta: bytes) -> bytes | None:
            chord = self.decode(meta)
            if chord["header"] is None:
                return None  # a generator's header: the task keeps its id as it is counted
            chord.setdefault("more", []).append([None, result.as_tuple()])  # in order added
            encoded: bytes = ensure_bytes(self.encode(chord))
            return encoded

        if not self.store.add_to_chord(chord_id, more, self.store.database.bound_caller()):
            raise ChordError(f"chord {chord_id}: its counter row is missing from "
                             f"{self.store.sql.names[2]} (done, expired or deleted): "
                             "no task can be added to it")

    def on_chord_part_return(self, request: Any, state: str, result: Any,
                             **kwargs: Any) -> None:
        """Count a header task not counted with its result (see
        ``SqlInboxBackend._with_ack``) in a transaction of its own."""
        broker = self._chord_broker()
        if broker is None or getattr(request, COUNTED, False) or not (
                request.group and request.id):
            return
        self.store.ensure()
        after = broker.run(partial(self._count_part, request))
        setattr(request, COUNTED, True)
        if after is not None:
            after()

    def _count_part(self, request: Any, conn: Connection) -> After:
        """Count one header task in ``conn``'s transaction; the part reaching the size
        reads the header's results in order, deletes the counter row and publishes the
        body bound to the transaction (a chord in it saves its counter row there too, see
        ``ResultStore.save_chord``): it is sent once, as this commits. A failed header
        task, or a missing counter row, gives the body's error callbacks a ChordError
        once the transaction is over (what they publish is not part of it)."""
        callback = maybe_signature(request.chord, app=self.app)
        counted = self.store.count_chord(conn, request.group, request.id,
                                         request.group_index)
        if counted is None:
            gone = ChordError(
                f"chord {request.group}: its counter row is missing from "
                f"{self.store.sql.names[2]} (expired by result_expires, or deleted); "
                "its body is not run")
            # the first part to find it gone stores the body's failure, in its counting
            # transaction: parts counted together (nothing left to lock) fail it once
            if callback.id and not self.store.write_new(
                    callback.id, *self._row(callback.id, self.prepare_exception(gone),
                                            states.FAILURE, None, None), conn):
                return None  # an earlier part found it missing: the body has failed
            return partial(self._chord_error, callback, gone)
        done, size = counted
        if size is None or done < size:
            return None
        meta, parts = self.store.finish_chord(conn, request.group)
        chord = self.decode(meta)
        header = [] if chord["header"] is None else result_from_tuple(
            chord["header"], self.app).results
        more = [result_from_tuple(entry[1], self.app) for entry in chord.get("more", [])]
        whole = ResultSet([*header, *more, *(self.app.AsyncResult(task_id)
                                             for _, task_id in _in_order(parts))])
        try:
            values = self._values(whole, self.store.read_many(_leaves(whole), conn))
        except ChordError as exc:
            logger.error("sqlinbox: chord %s: %s", request.group, exc)
            return partial(self._chord_error, callback, exc)
        token = binding.BOUND.set(conn)
        try:
            callback.delay(values)
        finally:
            binding.BOUND.reset(token)
        return None

    def _chord_error(self, callback: Any, exc: ChordError) -> Any:
        """Celery's ``chord_error_from_stack``, which stores the body's failure with the
        traceback of the exception being handled: this one."""
        try:
            raise exc
        except ChordError:
            return self.chord_error_from_stack(callback, exc)

    def _values(self, result: Any, stored: dict[str, StoredResult]) -> Any:
        """A header's values in its order (a nested group's as a list), or the ChordError
        of the first that failed or has no result."""
        if isinstance(result, ResultSet):
            return [self._values(part, stored) for part in result.results]
        found = stored.get(result.id)
        if found is None or found.status not in states.READY_STATES:
            raise ChordError(f"Dependency {result.id} has no result stored")
        meta = self._meta(found)
        if found.status in states.PROPAGATE_STATES:
            raise _create_chord_error_with_cause(
                message=f"Dependency {result.id} raised {meta['result']!r}",
                original_exc=meta["result"])
        return meta["result"]
