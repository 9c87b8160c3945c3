"""Checks of the routing tables' statements: a binding routes a message to a transient
queue, whose size counts what has not expired and whose claim takes it."""

from __future__ import annotations

from typing import Any

from .suite import Suite, expect


def check_routing(suite: Suite) -> None:
    """The routing tables as the transport uses them on every exchange: created by their
    DDL, a transient queue declared and bound, messages routed to it by key (one already
    expired), counted and claimed."""
    sql = suite.dialect.routing_statements(suite.prefix)
    with suite.engine.begin() as conn:
        for ddl in sql.ddl:
            conn.exec_driver_sql(ddl)
        conn.execute(sql.declare, {"name": "jobs", "transient": 1, "expires": None,
                                   "message_ttl": None})
        conn.execute(sql.bind, {"exchange": "ex", "queue": "jobs", "routing_key": "key",
                                "type": "direct", "pattern": ""})
    for routing_key, ttl in (("key", None), ("other", None), ("key", -60.0)):
        params: dict[str, Any] = {
            "exchange": "ex", "routing_key": routing_key, "payload": b"body",
            "headers": None, "ttl": ttl, "priority": 0, "channel_prefix": suite.name("t_")}
        with suite.engine.begin() as conn:
            conn.execute(sql.route, params)
    with suite.engine.begin() as conn:
        size = conn.execute(sql.size, {"queue": "jobs"}).scalar_one()
    expect(size == 1, f"size counted {size} messages, expected 1 (of three routed: one "
           "by another key, one expired)")
    with suite.engine.begin() as conn:
        first, *then = sql.claim
        rows = conn.execute(first, {"queue": "jobs", "limit": 10}).all()
        for statement in then:
            conn.execute(statement, {"ids": [row[0] for row in rows]})
    expect([bytes(row[1]) for row in rows] == [b"body"],
           f"the transient claim took {len(rows)} messages, expected the one unexpired")
    with suite.engine.begin() as conn:
        left = conn.execute(sql.size, {"queue": "jobs"}).scalar_one()
    expect(left == 0, f"size counted {left} messages after the claim, expected 0")
