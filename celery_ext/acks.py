"""The worker's side of a result written with its row: a late-acked task whose success
was written in the transaction that completed its delivered row (see
:meth:`~celery_ext.results.SqlInboxBackend.completed_by_success`) leaves the worker's
main process with no acknowledgement of its own to write, rather than one the fence
refuses and the lease keeper reports as a row that had already left."""

from __future__ import annotations

from typing import Any

from celery.worker.request import Request


class ResultRequest(Request):  # type: ignore[misc]
    """A worker request whose success, completed with its result, needs no ack.

    Celery's worker builds a subclass of a task's request class with an ``on_success``
    of its own, which acknowledges: each subclass's ``on_success`` is wrapped here."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        own = cls.__dict__.get("on_success")
        if own is not None:
            def on_success(self: ResultRequest, failed__retval__runtime: Any,
                           **more: Any) -> Any:
                self.completed_by_success(failed__retval__runtime)
                return own(self, failed__retval__runtime, **more)

            cls.on_success = on_success  # type: ignore[method-assign]

    def on_success(self, failed__retval__runtime: Any, **kwargs: Any) -> Any:
        self.completed_by_success(failed__retval__runtime)
        return super().on_success(failed__retval__runtime, **kwargs)

    def completed_by_success(self, failed__retval__runtime: Any) -> None:
        """A success whose write completed the row: the delivery leaves as acknowledged
        (the transport's ``completed``), and Celery's acknowledgement that follows is
        skipped."""
        backend = self.task.backend
        qos: Any = getattr(getattr(self.message, "channel", None), "qos", None)
        if (failed__retval__runtime[0] or self.acknowledged or not hasattr(qos, "completed")
                or not hasattr(backend, "completed_by_success")
                or not backend.completed_by_success(self)):
            return
        qos.completed(self.message.delivery_tag)
        self.acknowledged: bool = True
