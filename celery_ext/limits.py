"""Limited tasks: at most N runs of a key at once across every worker.

``@app.task(base=LimitedTask, limit_key=lambda tenant, *_: f"tenant-{tenant}")`` keys each
send by a function of the task's arguments (or by a fixed string); any task takes
``apply_async(..., limit_key="...")``. The key travels as a message property the transport
reads (:mod:`kombu_sqlinbox.limits`); the queue's ``concurrency_limits`` option says how
many rows of a key may be in work at once.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from kombu_sqlinbox.limits import KEY_PROPERTY

from .tasks import InboxTask

__all__ = ["LimitedTask"]


class LimitedTask(InboxTask):
    """Base of limited tasks (late-acked, as :class:`~celery_ext.tasks.InboxTask`: a running
    task's row holds its slot until the task ends, not only until it is received).

    ``limit_key``: the key of every send, a string or a function taking the task's
    arguments and returning one (None: only sends passing ``limit_key=`` are keyed).
    """

    limit_key: str | Callable[..., str] | None = None

    def apply_async(self, args: Any = None, kwargs: Any = None, task_id: str | None = None,
                    producer: Any = None, link: Any = None, link_error: Any = None,
                    shadow: str | None = None, **options: Any) -> Any:
        if options.get(KEY_PROPERTY) is None:
            key = self._key(args, kwargs)
            if key is not None:
                options[KEY_PROPERTY] = key
        return super().apply_async(args, kwargs, task_id, producer, link, link_error,
                                   shadow, **options)

    def signature_from_request(self, request: Any = None, args: Any = None,
                               kwargs: Any = None, queue: str | None = None,
                               **extra_options: Any) -> Any:
        """Celery's, with the key the request ran under: a retry keeps its slot's key even
        when the arguments it is retried with would give another."""
        request = self.request if request is None else request
        key = getattr(request, KEY_PROPERTY, None) or (
            getattr(request, "properties", None) or {}).get(KEY_PROPERTY)
        if key is not None:
            extra_options.setdefault(KEY_PROPERTY, key)
        return super().signature_from_request(request, args, kwargs, queue, **extra_options)

    def _key(self, args: Any, kwargs: Any) -> str | None:
        """The key of a send: the declared string, or the declared function's (a plain
        function set on the class, not bound to the task) result."""
        declared = inspect.getattr_static(self, "limit_key")
        if isinstance(declared, staticmethod):
            declared = declared.__func__
        if declared is None or isinstance(declared, str):
            return declared
        key: str = declared(*(args or ()), **(kwargs or {}))
        return key
