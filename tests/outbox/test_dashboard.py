"""The dashboard's outbox page on every database, the sqlinbox broker in the outbox's
database: it counts the records a lost broker left unprocessed, and its republish (after
a confirmation) sends each of them again, once."""

from __future__ import annotations

from werkzeug.test import Client

from celery_ext.dashboard import Dashboard
from kombu_sqlinbox.operations import Operations
from kombu_sqlinbox.options import parse_options
from tests.ops.dashboard_support import TOKEN, csrf, signed_in
from tests.outbox.conftest import OutboxEnv
from tests.outbox.test_republish import drain, lost_records


def counts(client: Client) -> dict[str, int]:
    page = client.get("/outbox").text
    return {name: int(page.split(f'<td class="{name}">')[1].split("<")[0])
            for name in ("unprocessed", "processed")}


def test_the_outbox_page_counts_and_republishes_the_lost_records(inbox_any: OutboxEnv) -> None:
    env = inbox_any
    app, _, ids = lost_records(env, 3)
    ops = Operations(env.broker, parse_options(app.conf.broker_transport_options),
                     list(app.amqp.queues))
    try:
        client = signed_in(Dashboard(ops, token=TOKEN, app=app))
        assert counts(client) == {"unprocessed": 3, "processed": 0}
        form = {"csrf": csrf(client.get("/outbox"))}
        asked = client.post("/outbox/republish", data=form)
        assert "3 records unprocessed" in asked.text
        assert env.queue_depth(app) == 0  # nothing sent before the confirmation
        done = client.post("/outbox/republish", data={**form, "confirm": "yes"})
        assert done.status_code == 303
        assert "republished 3, failed none" in client.get(done.headers["Location"]).text
        assert drain(env, app, 3) == {record_id: 1 for record_id in ids}
    finally:
        ops.close()
