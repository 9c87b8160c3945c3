"""Which row a task's delivery is, and the process's broker that holds it: what a
transactional task and the result backend need to complete that row in a transaction
of their own."""

from __future__ import annotations

import os
from typing import Any

from kombu_sqlinbox.broker import Broker
from kombu_sqlinbox.codec import ROW_KEY
from kombu_sqlinbox.errors import ConfigurationError


class TransactionalTaskError(ConfigurationError):
    """A transactional task cannot run where it was delivered (wrong broker or claim form)."""


def delivered_row(request: Any) -> dict[str, Any] | None:
    """Which row a task's delivery is (queue, id, attempt), or None off an inbox queue.

    The transport puts it in the message's delivery_info; Celery hands the message's
    properties, delivery_info included, to the task's request in every pool (a prefork
    child receives a copy), while it keeps only a few fields in ``request.delivery_info``.
    """
    properties = getattr(request, "properties", None) or {}
    row: dict[str, Any] | None = (properties.get("delivery_info") or {}).get(ROW_KEY)
    return row


_BROKERS: dict[tuple[int, int], Broker] = {}


def broker_of(app: Any) -> Broker:
    """This process's sqlinbox broker for the app's broker URL (one per app and process)."""
    key = (id(app), os.getpid())
    found = _BROKERS.get(key)
    if found is None:
        transport = app.connection_for_write().transport
        found = getattr(transport, "broker", None)
        if not isinstance(found, Broker):
            raise TransactionalTaskError(
                f"transactional tasks need the sqlinbox broker; this app uses "
                f"{type(transport).__module__}")
        _BROKERS[key] = found
    return found
