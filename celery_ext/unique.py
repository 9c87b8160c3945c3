"""Unique tasks: a send whose key is held by a task of the queue returns that task.

``@app.task(base=UniqueTask, unique="active")`` keys each send by the task's name and
arguments (or by ``unique_key=``, a function of the task's arguments); any task takes
``apply_async(..., unique_key="...", unique_scope="waiting")``. The key travels as a
message property the transport reads (:mod:`kombu_sqlinbox.unique`); a send whose key is
held writes nothing, and :class:`UniqueTask` returns the holder's ``AsyncResult`` (or
raises :class:`~kombu_sqlinbox.errors.DuplicateTask` with ``unique_raise=True``).
"""

from __future__ import annotations

import hashlib
import inspect
import json
from collections.abc import Callable
from typing import Any

from kombu_sqlinbox.errors import DuplicateTask
from kombu_sqlinbox.unique import KEY_PROPERTY, SCOPE_PROPERTY

from .tasks import InboxTask

__all__ = ["DuplicateTask", "UniqueTask", "default_key"]


def default_key(name: str, args: Any, kwargs: Any) -> str:
    """The task's name and a digest of its arguments as JSON (keys sorted): equal
    arguments, equal key, however long they are."""
    arguments = json.dumps([list(args or ()), dict(kwargs or {})], sort_keys=True,
                           separators=(",", ":"), default=repr)
    return f"{name}:{hashlib.sha256(arguments.encode()).hexdigest()}"


class UniqueTask(InboxTask):
    """Base of unique tasks (late-acked, as :class:`~celery_ext.tasks.InboxTask`: a running
    task's row holds its key until the task ends).

    ``unique``: the scope of every send (``"active"``: waiting or running; ``"waiting"``;
    a number of seconds from the send), or None (only sends passing ``unique_key=`` are
    keyed); ``unique_key``: a function
    taking the task's arguments and returning the key (default: :func:`default_key`);
    ``unique_raise``: raise instead of returning the holder's result.
    """

    unique: str | float | None = None
    unique_key: Callable[..., str] | None = None
    unique_raise = False

    def apply_async(self, args: Any = None, kwargs: Any = None, task_id: str | None = None,
                    producer: Any = None, link: Any = None, link_error: Any = None,
                    shadow: str | None = None, **options: Any) -> Any:
        raises = options.pop("unique_raise", self.unique_raise)
        if options.get(KEY_PROPERTY) is None and self.unique is not None:
            options[KEY_PROPERTY] = self._key(args, kwargs)
        if options.get(KEY_PROPERTY) is not None:
            options.setdefault(SCOPE_PROPERTY, self.unique or "active")
        try:
            return super().apply_async(args, kwargs, task_id, producer, link, link_error,
                                       shadow, **options)
        except DuplicateTask as exc:
            if raises or exc.task_id is None:
                raise
            return self.AsyncResult(exc.task_id)

    def signature_from_request(self, request: Any = None, args: Any = None,
                               kwargs: Any = None, queue: str | None = None,
                               **extra_options: Any) -> Any:
        """Celery's, with the key and scope the request was sent with: Celery republishes a
        retry from the request's execution options, which carry no message property, so
        the retry would otherwise hold another key (or none) than the task it continues."""
        request = self.request if request is None else request
        properties = getattr(request, "properties", None) or {}
        for name in (KEY_PROPERTY, SCOPE_PROPERTY):
            if properties.get(name) is not None:
                extra_options.setdefault(name, properties[name])
        return super().signature_from_request(request, args, kwargs, queue, **extra_options)

    def _key(self, args: Any, kwargs: Any) -> str:
        """The key of a send: the declared function's (a plain function set on the class,
        not bound to the task), else :func:`default_key`."""
        function = inspect.getattr_static(self, "unique_key")
        if isinstance(function, staticmethod):
            function = function.__func__
        if function is None:
            return default_key(self.name, args, kwargs)
        key: str = function(*(args or ()), **(kwargs or {}))
        return key
