"""How the ``sqlinbox`` commands print queue figures (a plain text table, or Prometheus's
text exposition: ``queues --format prometheus``) and the scheduler's schedules."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from kombu_sqlinbox.operations import Paused, QueueFigures

if TYPE_CHECKING:
    from .beat import Schedule

#: Prometheus metric names and help, by figure
METRICS = {
    "ready": "Messages claimable now.",
    "delayed": "Messages not due yet (eta, countdown, retry delay).",
    "in_work": "Messages held under a live lease.",
    "blocked": "Due messages waiting behind an unfinished earlier message of their FIFO group.",
    "blocked_groups": "FIFO groups whose head is in work with messages behind it.",
    "lapsed": "Leases that ran out unsettled (a dead worker's messages, claimable again).",
    "oldest_ready_age": "Seconds the oldest claimable message has been ready.",
    "oldest_lease_age": "Seconds since the oldest live lease was taken or last extended.",
    "dead_letters": "Messages in the queue's dead-letter queue.",
    "paused": "1 while the queue is paused (sqlinbox pause), else 0.",
}
SECONDS = ("oldest_ready_age", "oldest_lease_age")


def metric_name(figure: str) -> str:
    return f"sqlinbox_queue_{figure}" + ("_seconds" if figure in SECONDS else "")


def age_text(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.1f}s"


def text_table(header: Sequence[str], rows: Sequence[Sequence[Any]], align: str = "") -> str:
    """A plain text table; ``align`` has a ``<`` (left) or ``>`` per column (default: the
    first left, the rest right)."""
    align = align or "<" + ">" * (len(header) - 1)
    cells = [list(header), *[[str(value) for value in row] for row in rows]]
    widths = [max(len(row[n]) for row in cells) for n in range(len(header))]
    def line(row: list[str]) -> str:
        return "  ".join(cell.ljust(width) if side == "<" else cell.rjust(width)
                         for cell, width, side in zip(row, widths, align, strict=True))

    return "\n".join(line(row).rstrip() for row in cells)


def paused_text(paused: Paused, now: float) -> str:
    """When, by whom and why a queue was paused, in one line."""
    at = datetime.fromtimestamp(paused.at, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    return (f"since {at} ({age_text(now - paused.at)} ago) by {paused.by or '-'}"
            + (f": {paused.reason}" if paused.reason else ""))


def render_paused(found: Sequence[Paused], now: float) -> str:
    return "\n".join(f"PAUSED {each.queue} {paused_text(each, now)}" for each in found)


def render_text(figures: Sequence[QueueFigures], now: float) -> str:
    """The figures' table, then a line per paused queue saying who paused it, when and
    why."""
    table = text_table(
        ("queue", "ready", "delayed", "in work", "lease age", "blocked", "groups", "lapsed",
         "oldest ready", "dead letters", "state"),
        [(f.queue, f.ready, f.delayed, f.in_work, age_text(f.oldest_lease_age), f.blocked,
          f.blocked_groups, f.lapsed, age_text(f.oldest_ready_age),
          "-" if f.dead_letters is None else f"{f.dead_letters} ({f.dead_letter_queue})",
          "PAUSED" if f.paused else "-")
         for f in figures])
    paused = [f.paused for f in figures if f.paused is not None]
    return table + ("\n" + render_paused(paused, now) if paused else "")


def decoded_arguments(message: dict[str, Any]) -> str:
    """A Celery message's arguments (JSON bodies only: nothing else is deserialised)."""
    if message.get("content-type") != "application/json":
        return f"not decoded ({message.get('content-type')} body)"
    body = message.get("body")
    try:
        loaded = json.loads(body.decode() if isinstance(body, bytes) else body or "")
    except ValueError as exc:
        return f"not decoded (the body is not JSON: {exc})"
    if isinstance(loaded, list) and len(loaded) == 3:  # Celery's message protocol 2
        return f"args={json.dumps(loaded[0])} kwargs={json.dumps(loaded[1])}"
    return json.dumps(loaded)


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render_prometheus(figures: Sequence[QueueFigures]) -> str:
    """Prometheus text exposition: one gauge per figure, labelled by queue and table; an
    age with nothing to measure, and the dead letters of a queue without a dead-letter
    queue, have no sample."""
    lines = []
    for figure, help_text in METRICS.items():
        name = metric_name(figure)
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge"]
        for found in figures:
            value = getattr(found, figure)
            if figure == "paused":
                value = int(value is not None)
            if value is None:
                continue
            labels = f'queue="{_label(found.queue)}",table="{_label(found.table)}"'
            if figure == "dead_letters":
                labels += f',dead_letter_queue="{_label(str(found.dead_letter_queue))}"'
            lines.append(f"{name}{{{labels}}} {value}")
    return "\n".join(lines) + "\n"


def timing_text(kind: str, spec: str) -> str:
    """A stored schedule's timing as ``schedules add`` takes it."""
    fields = json.loads(spec)
    if kind == "interval":
        return f"every:{fields['every']:g}"
    if kind == "crontab":
        return "crontab:" + " ".join(str(value) for value in fields.values())
    return f"{kind}:" + ":".join(str(value) for value in fields.values())


def schedule_record(found: Schedule) -> dict[str, Any]:
    """A schedule as ``schedules list --json`` prints it (times epoch seconds)."""
    return {"name": found.name, "task": found.task,
            "schedule": timing_text(found.kind, found.spec), "args": found.args,
            "kwargs": found.kwargs, "options": found.options, "misfire": found.misfire,
            "grace": found.grace, "enabled": found.enabled, "last_run_at": found.last_run_at,
            "next_run_at": found.next_run_at, "total_run_count": found.total_run_count}


def render_schedules(found: Sequence[Schedule], now: float) -> str:
    """The schedules as a text table: last run ago, next run in, by the database's clock."""
    return text_table(
        ("name", "task", "schedule", "state", "misfire", "last run", "next run", "runs"),
        [(each.name, each.task, timing_text(each.kind, each.spec),
          "enabled" if each.enabled else "paused", each.misfire,
          "-" if each.last_run_at is None else f"{now - each.last_run_at:.1f}s ago",
          f"in {max(each.next_run_at - now, 0):.1f}s", each.total_run_count)
         for each in found], align="<<<<<>>>")
