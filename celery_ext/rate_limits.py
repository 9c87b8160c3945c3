"""Tasks' own ``rate_limit`` kept across every worker.

``global_rate_limits(app)``: each worker of ``app``, once it has imported its tasks, gives
the transport option ``task_rate_limits`` (every queue's default) each task's own
``rate_limit`` (``@app.task(rate_limit="10/s")``, or ``task_annotations``), so the claim
holds it for all workers together (:mod:`kombu_sqlinbox.task_rates`). A rate set in the
transport options for a task wins. Celery's own limit stays in force too: each worker
also keeps the task to that rate alone, which can only space out what the claim gave it.
"""

from __future__ import annotations

from typing import Any

from celery import Celery
from celery.signals import worker_init

from kombu_sqlinbox.options import parse_options

__all__ = ["global_rate_limits", "keep_task_rate_limits", "task_rate_limits"]


def task_rate_limits(app: Celery) -> dict[str, Any]:
    """Each of ``app``'s tasks with a ``rate_limit``: its name and that rate."""
    return {name: task.rate_limit for name, task in app.tasks.items() if task.rate_limit}


def global_rate_limits(app: Celery) -> None:
    """Have each worker of ``app`` keep its tasks' ``rate_limit`` across every worker (see
    the module)."""

    def install(sender: Any = None, **_: Any) -> None:
        if getattr(sender, "app", None) is app:
            keep_task_rate_limits(app)

    worker_init.connect(install, weak=False)


def keep_task_rate_limits(app: Celery) -> None:
    """Give the transport option ``task_rate_limits`` of ``app`` its tasks' own rates (its
    own first); a rate the transport cannot read stops the worker's start, naming its
    task."""
    options = dict(app.conf.broker_transport_options or {})
    options["task_rate_limits"] = {**task_rate_limits(app),
                                   **options.get("task_rate_limits", {})}
    parse_options(options)
    app.conf.broker_transport_options = options
