"""The Markdown table (grouped by database), the target ratios, and the JSON record."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .registry import Cell, columns
from .targets import SERVER_BROKERS, Context

Results = dict[tuple[str | None, str], dict[str, Cell]]
RAW_DRIVERS = {"postgresql": "psycopg2", "mysql": "pymysql", "sqlite": "sqlite3"}
#: (what, (broker, column) over (broker, column), target): the figures issue 2 asks for
RATIOS = (
    ("sqlinbox consume pf10 ÷ kombu sqla consume pf10", ("sqlinbox", "consume_10"),
     ("sqla", "consume_10"), 20.0),
    ("sqlinbox consume pf100 ÷ kombu sqla consume pf100", ("sqlinbox", "consume_100"),
     ("sqla", "consume_100"), 20.0),
    ("sqlinbox consume pf100 ÷ RabbitMQ consume pf100", ("sqlinbox", "consume_100"),
     ("rabbitmq", "consume_100"), 1.0),
    ("sqlinbox publish ÷ raw publish (1 row/commit)", ("sqlinbox", "publish"),
     ("raw", "publish"), 0.8),
    ("Celery prefork: sqlinbox ÷ Redis", ("sqlinbox", "celery_prefork"),
     ("redis", "celery_prefork"), 1.0),
    ("Celery prefork: sqlinbox ÷ RabbitMQ (the aim)", ("sqlinbox", "celery_prefork"),
     ("rabbitmq", "celery_prefork"), 1.0),
)


def broker_label(broker: str, database: str) -> str:
    if broker == "raw":
        return f"raw {RAW_DRIVERS.get(database, 'driver')} ‡"
    if broker == "sqla":
        return "kombu sqla †"
    return broker + (" *" if broker in SERVER_BROKERS else "")


def rows_of(results: Results, database: str) -> list[tuple[str, dict[str, Cell]]]:
    own = [(b, cells) for (db, b), cells in results.items() if db == database]
    shared = [(b, cells) for (db, b), cells in results.items() if db is None]
    return own + shared


def cell_of(results: Results, database: str, broker: str, column: str) -> Cell | None:
    return results.get((None if broker in SERVER_BROKERS else database, broker), {}).get(column)


def ratios(results: Results, databases: list[str]) -> list[dict[str, Any]]:
    found = []
    for database in databases:
        for what, (top_broker, top), (bottom_broker, bottom), target in RATIOS:
            a = cell_of(results, database, top_broker, top)
            b = cell_of(results, database, bottom_broker, bottom)
            value = a.value / b.value if a and b and a.value and b.value else None
            found.append({"database": database, "ratio": what, "value": value, "target": target,
                          "met": value is not None and value >= target})
    return found


def markdown(results: Results, databases: list[str], ctx: Context) -> str:
    headings = columns()
    used = [key for key in headings if any(key in cells for cells in results.values())]
    lines = []
    for database in databases:
        rows = rows_of(results, database)
        if not rows:
            continue
        lines += [f"### {database}", "",
                  "| broker | " + " | ".join(headings[key] for key in used) + " |",
                  "|---|" + "---:|" * len(used)]
        for broker, cells in rows:
            texts = [cells[key].text if key in cells else "-" for key in used]
            lines.append(f"| {broker_label(broker, database)} | " + " | ".join(texts) + " |")
        lines.append("")
    sizes = ctx.sizes
    lines += [
        f"Messages: publish {sizes.publish}, consume/race {sizes.consume}, Celery tasks "
        f"{sizes.tasks}, latency samples {sizes.latency}; each measurement capped at "
        f"{sizes.cap:.0f} s (a capped one shows received/expected).",
        "Consume: kombu Consumer, basic_qos(prefetch), acking callback, drain_events; first "
        "to last message. Racers: processes draining one queue (dup = delivered twice, lost = "
        "neither received nor left in the queue). Celery: from worker start until the last "
        "task ran (in brackets: first to last task).",
        "* measured once per run, shown in every group. † kombu sqla gets a tenth of the "
        "consume/race/Celery message counts (it manages a few hundred msg/s at best). "
        "‡ raw driver loop of the transport's own SQL: publish and 'pf10' = one row per "
        "commit, 'pf100' = claim 100 + delete 100 + commit.",
        "",
    ]
    found = [r for r in ratios(results, databases) if r["value"] is not None]
    if found:
        lines += ["### Targets (issue 2)", "", "| database | ratio | value | target | met |",
                  "|---|---|---:|---:|---|"]
        for r in found:
            lines.append(f"| {r['database']} | {r['ratio']} | {r['value']:.2f} | "
                         f"≥ {r['target']:g} | {'yes' if r['met'] else 'no'} |")
        lines.append("")
    return "\n".join(lines)


def write_json(path: Path, results: Results, databases: list[str], ctx: Context,
               quick: bool) -> None:
    record = {
        "run_id": ctx.run_id,
        "quick": quick,
        "sizes": asdict(ctx.sizes),
        "results": [
            {"database": db, "broker": broker, "column": column, **asdict(cell)}
            for (db, broker), cells in results.items() for column, cell in cells.items()
        ],
        "ratios": ratios(results, databases),
    }
    path.write_text(json.dumps(record, indent=2, default=str))
