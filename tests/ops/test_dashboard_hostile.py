"""The dashboard against what an attacker, a careless producer or a new user gives it:
rows whose names, arguments and death records are markup, binary, invalid UTF-8, very
long or of the wrong type; paging numbers no database takes; credentials that are not
text a digest compares; a database URL with a secret in its query string; the token in
the address the standalone server logs. Each is an answer (a page, 400, 401, 403, 404),
never a server error, and nothing in it runs as script or shows a secret."""

from __future__ import annotations

import http.client
import json
import re
import socket
import sys
from html import escape

import pytest
from celery import Celery
from sqlalchemy import text
from sqlalchemy.engine import make_url
from werkzeug.test import Client

from celery_ext.beat import Schedules
from celery_ext.dashboard import TOKEN_ENV, Dashboard
from celery_ext.dashboard.security import COOKIE
from kombu_sqlinbox.codec import DEATH_HEADER
from kombu_sqlinbox.operations import Operations
from kombu_sqlinbox.options import parse_options
from tests.integration.support import quoted
from tests.ops.apps import transport_options
from tests.ops.conftest import Cli, Seeded
from tests.ops.dashboard_support import TOKEN, csrf, ids, signed_in, signed_in_as
from tests.processes import Processes, wait_until
from tests.tcp_proxy import Proxy

#: markup that would run if a page let it through unescaped
SCRIPT, IMAGE = "<script>alert(1)</script>", "<img src=x onerror=alert(1)>"
#: how long the standalone server may take to start and log
SERVE_LIMIT = 60.0


def hostile_dead_letters(app: Celery, seeded: Seeded) -> None:
    """Rows in ``jobs.dead`` as other code or a hostile producer may leave them."""
    with app.producer_or_acquire() as producer:
        def dead(body: object, death: object, task: object = SCRIPT, **more: str) -> None:
            producer.publish(body, routing_key="jobs.dead", headers={
                "task": task, "id": f"t-{IMAGE}", DEATH_HEADER: death}, **more)

        # a death record of the wrong types: its time, attempts, reason and queue
        dead(json.dumps([[IMAGE], {}, {}]), {"queue": ["jobs"], "at": "yesterday",
             "attempts": "many", "reason": ["rejected"]}, content_type="application/json",
             content_encoding="utf-8")
        # markup in the queue, reason, arguments; a NUL; a very long task name
        dead(json.dumps([[f"</code>{SCRIPT}", "a\x00b"], {"k": IMAGE}, {}]),
             {"queue": IMAGE, "at": 1.0, "attempts": 2, "reason": SCRIPT},
             task="t" * 20_000, content_type="application/json", content_encoding="utf-8")
        # a body declared JSON that is not UTF-8, and a binary one
        dead(b"\xff\xfe[1]", {"queue": "jobs", "at": 2.0}, content_type="application/json",
             content_encoding="binary")
        dead(bytes(range(256)), {"queue": "jobs", "at": 3.0},
             content_type="application/octet-stream", content_encoding="binary")
        # a task name that is not text
        dead("[]", {"queue": "jobs", "at": 4.0}, task=["ops", "add"],
             content_type="application/json", content_encoding="utf-8")
    table = seeded.broker.table("jobs.dead").spec.table
    engine = seeded.broker.engine
    with engine.begin() as conn:  # one that does not decode at all
        conn.execute(text(f"INSERT INTO {quoted(engine, table)} (payload, headers) "
                          "VALUES (:payload, :headers)"),
                     {"payload": b"\x00\xff", "headers": '{"properties": 7'})


@pytest.mark.drivers
def test_hostile_dead_letters_are_listed_shown_and_filtered_escaped(
        ops: Operations, app: Celery, seeded: Seeded) -> None:
    hostile_dead_letters(app, seeded)
    client = signed_in(Dashboard(ops, token=TOKEN, page=100))
    listed = client.get("/dead")
    assert listed.status_code == 200
    found = ids(listed.text, "dead")
    assert len(found) == 4 + 6  # the seeded ones and these
    pages = [listed.text]
    for query in ("older_than=0", "newer_than=1e400", "older_than=nan", "reason=reject",
                  "task=t*", "queue=jobs", f"queue={IMAGE}"):
        page = client.get(f"/dead?{query}")
        assert page.status_code == 200, (query, page.text)
        pages.append(page.text)
    assert ids(pages[-1], "dead") == [found[5]]  # the markup queue, found by its name
    shown = []
    for row in found:
        page = client.get(f"/dead/jobs.dead/{row}")
        assert page.status_code == 200, (row, page.text)
        shown.append(page.text)
    markup, not_utf8, binary, undecodable = shown[5], shown[6], shown[7], shown[9]
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in markup  # its task and reason
    assert "not decoded (the body is not JSON" in not_utf8
    assert "not decoded (application/octet-stream body)" in binary
    assert "Undecodable: cannot decode stored message" in undecodable
    pages += [*shown, client.get("/").text, client.get("/queues/jobs").text]
    for html in pages:
        assert SCRIPT not in html and IMAGE not in html
    form = {"csrf": csrf(listed), "dlq": "jobs.dead", "older_than": "0"}
    asked = client.post("/dead/purge", data=form)
    assert asked.status_code == 200 and "Purge 8 dead letters?" in asked.text
    done = client.post("/dead/purge", data={**form, "confirm": "yes"})
    assert "purged 8" in client.get(done.headers["Location"]).text
    # left: the row that does not decode, and the one whose death has no time
    assert len(ids(client.get("/dead").text, "dead")) == 2


@pytest.mark.drivers
def test_paging_numbers_are_whole_numbers_every_database_takes(
        ops: Operations, seeded: Seeded) -> None:
    client = signed_in(Dashboard(ops, token=TOKEN))
    largest = str(2**63 - 1)
    for path in ("/queues/jobs?after=", "/queues/fifo?groups_after=", "/dead?after=",
                 "/failures?since="):
        assert client.get(path + largest).status_code == 200, path
        for wrong in ("-1", "x", "1e3", "\u00b2", "\u0661", str(2**63), "9" * 400):
            answer = client.get(path + wrong)
            assert answer.status_code == 400, (path, wrong)
            assert "whole number" in answer.text
    assert client.get(f"/dead/jobs.dead/{largest}").status_code == 404
    assert client.get(f"/dead/jobs.dead/{2**63}").status_code == 404
    token = csrf(client.get("/dead"))
    refused = client.post("/dead/purge", data={"csrf": token, "dlq": "jobs.dead",
                                               "row_id": "9" * 40})
    assert refused.status_code == 400 and "whole number" in refused.text
    assert len(ids(client.get("/dead").text, "dead")) == 4


@pytest.mark.databases("sqlite")
def test_credentials_that_are_not_ascii_are_refused_not_errors(ops: Operations) -> None:
    dashboard = Dashboard(ops, token=TOKEN)
    stranger = Client(dashboard)
    stranger.set_cookie(COOKIE, "\u00e9t\u00e9")
    assert stranger.get("/").status_code == 401
    assert Client(dashboard).get("/?token=\u00e9").status_code == 401
    assert Client(dashboard).get("/", headers={
        "Authorization": "Bearer \u00e9"}).status_code == 401
    client = signed_in(dashboard)
    refused = client.post("/dead/purge", data={"csrf": "\u00e9", "dlq": "jobs.dead"})
    assert refused.status_code == 403 and "CSRF token" in refused.text


def test_a_secret_in_the_database_urls_query_is_never_shown() -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    ops = Operations(f"postgresql+psycopg://app:s3cret@127.0.0.1:{port}/db"
                     "?password=q5ecret&sslpassword=k3y&connect_timeout=5",
                     parse_options({"queues": {"jobs": {}}}), ["jobs"])
    try:
        dashboard = Dashboard(ops, token=TOKEN)
        page = Client(dashboard).get("/", headers={"Authorization": f"Bearer {TOKEN}"})
    finally:
        ops.close()
    assert dashboard.database == (f"postgresql+psycopg://app:***@127.0.0.1:{port}/db"
                                  "?connect_timeout=5&password=***&sslpassword=***")
    assert page.status_code == 503 and "failed" in page.text
    for secret in ("s3cret", "q5ecret", "k3y"):
        assert secret not in page.text


@pytest.mark.parametrize("database", ["sqlite"])  # serving is the same on every database
def test_the_token_in_an_address_is_not_in_the_servers_log(
        processes: Processes, ops_env: dict[str, str], database: str) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    token = "log-me-not-" + "x" * 20
    server = processes.spawn("dashboard", [
        sys.executable, "-m", "celery", "-A", "tests.ops.apps", "sqlinbox", "dashboard",
        "--port", str(port)], {**ops_env, TOKEN_ENV: token})
    wait_until(lambda: "Running on" in server.output(), SERVE_LIMIT, "the server",
               alive=[server])
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request("GET", f"/dead?token={token}&queue=jobs")
        answer = connection.getresponse()
        answer.read()
    finally:
        connection.close()
    assert answer.status == 303 and COOKIE in (answer.getheader("Set-Cookie") or "")
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        raw.sendall(f"BREW /?token={token} HTTP/1.1\r\n\r\n".encode())
        raw.recv(4096)  # refused: the error is logged with the request line
    logged = wait_until(
        lambda: (found := server.output()).count("token=***") >= 2 and found,
        SERVE_LIMIT, "the requests' log lines", alive=[server])
    assert token not in logged, logged
    assert re.search(r"GET /dead\?token=\*\*\*&queue=jobs", logged), logged


@pytest.mark.drivers
@pytest.mark.databases("postgresql", "mysql")
def test_a_database_that_dies_under_the_pages_is_a_page_saying_so(
        db_url: str, table_prefix: str, app: Celery, seeded: Seeded) -> None:
    target = make_url(db_url)
    proxy = Proxy(str(target.host), int(target.port or 0))
    ops = Operations(proxy.url(db_url), parse_options(transport_options(table_prefix)),
                     list(app.amqp.queues))
    try:
        client = signed_in(Dashboard(ops, token=TOKEN))
        [first, *_] = ids(client.get("/dead").text, "dead")
        paths = ("/", "/queues/jobs", "/dead", f"/dead/jobs.dead/{first}", "/schedules")
        for path in paths:
            assert client.get(path).status_code == 200, path
        token = csrf(client.get("/dead"))
        with proxy.refuse():  # every connection cut, none made again
            for path in paths:
                page = client.get(path)
                assert page.status_code == 503, (path, page.text)
                assert "failed" in page.text and "Traceback" not in page.text
                if target.password:
                    assert target.password not in page.text
            refused = client.post("/dead/purge", data={
                "csrf": token, "dlq": "jobs.dead", "confirm": "yes"})
            assert refused.status_code == 503
        for path in paths:  # the server back, the pages are
            assert client.get(path).status_code == 200, path
        assert len(ids(client.get("/dead").text, "dead")) == 4  # nothing was purged
    finally:
        ops.close()
        proxy.close()


@pytest.mark.databases("sqlite")
def test_a_confirmation_of_row_zero_acts_on_row_zero_only(
        ops: Operations, seeded: Seeded) -> None:
    client = signed_in(Dashboard(ops, token=TOKEN))
    form = {"csrf": csrf(client.get("/dead")), "dlq": "jobs.dead", "row_id": "0"}
    asked = client.post("/dead/purge", data=form)
    assert "Purge 0 dead letters?" in asked.text and "Dead letter 0 in" in asked.text
    confirmed = dict(re.findall(r'<input type="hidden" name="(\w+)" value="([^"]*)"',
                                asked.text))
    assert confirmed["row_id"] == "0"  # the form confirmed is the one asked about
    done = client.post("/dead/purge", data=confirmed)
    assert "purged 0" in client.get(done.headers["Location"]).text
    assert len(ids(client.get("/dead").text, "dead")) == 4


def every_route(dashboard: Dashboard) -> list[tuple[str, str]]:
    """Each route but the static files' as (method, path), its variables given sample
    values: the routes of pages added later are checked as these are."""
    adapter = dashboard.routes.bind("localhost")
    samples = {"name": "jobs", "dlq": "jobs.dead", "row_id": 1}
    found = []
    for rule in dashboard.routes.iter_rules():
        if rule.endpoint == "static":
            continue
        path = adapter.build(rule.endpoint, {key: samples.get(key, "x")
                                             for key in rule.arguments})
        found += [(method, path) for method in sorted(rule.methods or ()) if method in (
            "GET", "POST")]
    return found


@pytest.mark.databases("sqlite")
def test_every_route_asks_for_the_token_and_every_action_for_post_csrf_and_writing(
        ops: Operations, seeded: Seeded) -> None:
    dashboard = Dashboard(ops, token=TOKEN)
    routes = every_route(dashboard)
    actions = [path for method, path in routes if method == "POST"]
    assert len(actions) >= 5 and len(routes) > len(actions) + 5
    stranger, client = Client(dashboard), signed_in(dashboard)
    token = csrf(client.get("/dead"))
    read_only = Dashboard(ops, token=TOKEN, read_only=True)
    reader = signed_in(read_only)
    valid = read_only.guard.csrf(read_only.guard.session_value())
    for method, path in routes:
        assert stranger.open(path, method=method).status_code == 401, path
        if method == "GET":
            assert client.get(path).status_code < 500, path
            continue
        assert client.get(path).status_code == 405, path  # never by GET
        form = {"dlq": "jobs.dead", "confirm": "yes", "name": "x"}
        for data, headers in [(form, {}), ({**form, "csrf": "forged"}, {}),
                              ({**form, "csrf": token}, {"Origin": "http://evil.example"})]:
            assert client.post(path, data=data, headers=headers).status_code == 403, path
        refused = reader.post(path, data={**form, "csrf": valid})
        assert refused.status_code == 403 and "read-only" in refused.text, path
    assert len(ids(client.get("/dead").text, "dead")) == 4  # nothing was acted on


@pytest.mark.parametrize("database", ["sqlite"])  # serving is the same on every database
def test_behind_a_tls_proxy_the_forms_https_origin_is_its_own(
        processes: Processes, ops_env: dict[str, str], database: str, seeded: Seeded) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = processes.spawn("dashboard", [
        sys.executable, "-m", "celery", "-A", "tests.ops.apps", "sqlinbox", "dashboard",
        "--port", str(port), "--proxied"], {**ops_env, TOKEN_ENV: TOKEN})
    wait_until(lambda: "Running on" in server.output(), SERVE_LIMIT, "the server",
               alive=[server])
    proxy = {"Authorization": f"Bearer {TOKEN}", "Host": f"127.0.0.1:{port}",
             "X-Forwarded-Proto": "https", "X-Forwarded-Host": "ops.example"}

    def ask(method: str, path: str, headers: dict[str, str], body: str = ""
            ) -> tuple[int, str, str]:
        """The answer's status, page and cookie set."""
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        try:
            connection.request(method, path, body, headers)
            answer = connection.getresponse()
            return (answer.status, answer.read().decode(),
                    answer.getheader("Set-Cookie") or "")
        finally:
            connection.close()

    assert "Secure" in ask("GET", f"/?token={TOKEN}", proxy)[2]  # the address is https
    assert "Secure" not in ask("GET", f"/?token={TOKEN}", {"Host": f"127.0.0.1:{port}"})[2]
    status, page, _ = ask("GET", "/dead", proxy)
    assert status == 200
    found = re.search(r'name="csrf" value="([^"]+)"', page)
    assert found, page
    form = {"Origin": "https://ops.example",
            "Content-Type": "application/x-www-form-urlencoded"}
    body = f"csrf={found.group(1)}&dlq=jobs.dead"
    status, page, _ = ask("POST", "/dead/purge", {**proxy, **form}, body)
    assert status == 200 and "Purge 4 dead letters?" in page  # its own origin: asked
    status, page, _ = ask("POST", "/dead/purge", {**proxy, **form,
                                               "Origin": "https://evil.example"}, body)
    assert status == 403 and "another origin" in page


@pytest.mark.databases("sqlite")
def test_a_schedule_of_any_name_is_paused_and_said_so(ops: Operations, app: Celery) -> None:
    client = signed_in(Dashboard(ops, token=TOKEN, app=app))
    store = Schedules.for_app(app)
    try:
        store.ensure()
        names = ["tidy & co #1 100% <b>x</b>", "two\r\nlines"]
        for name in names:
            store.add(name, "ops.add", 60.0)
        token = csrf(client.get("/schedules"))
        for name in names:
            done = client.post("/schedules/pause", data={"csrf": token, "name": name})
            assert done.status_code == 303, done.text
            said = client.get(done.headers["Location"])
            assert said.status_code == 200
            assert f'<p class="done">paused {escape(name)}</p>' in said.text, said.text
            found = store.get(name)
            assert found is not None and not found.enabled
    finally:
        store.close()


@pytest.mark.databases("sqlite")
def test_a_stranger_is_not_told_which_database_it_is(ops: Operations) -> None:
    dashboard = Dashboard(ops, token=TOKEN)
    named = str(ops.broker.engine.url.database)
    stranger = Client(dashboard)
    for method, path, status in [("GET", "/", 401), ("GET", "/nowhere", 404),
                                 ("GET", "/dead/purge", 405), ("POST", "/dead/purge", 401)]:
        answer = stranger.open(path, method=method)
        assert answer.status_code == status, path
        assert named not in answer.text and "sqlite" not in answer.text, answer.text
    known = signed_in(dashboard).get("/nowhere")  # to the signed in, every page says it
    assert known.status_code == 404 and named in known.text


@pytest.mark.databases("sqlite")  # the URL given is a server's that does not answer
def test_the_command_on_a_database_that_fails_shows_no_query_secret(cli: Cli) -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    failed = cli("dashboard", "--port", "0", standalone=True, check=False,
                 url=f"postgresql+psycopg://app:s3cret@127.0.0.1:{port}/db"
                     "?sslpassword=k3y&password=q5ecret&application_name=shop")
    said = failed.stdout + failed.stderr
    assert failed.returncode != 0 and "failed" in said, said
    assert "?sslpassword=***&password=***&application_name=shop" in said, said
    for secret in ("s3cret", "q5ecret", "k3y"):
        assert secret not in said


@pytest.mark.databases("sqlite")
def test_an_actions_message_is_the_dashboards_own_never_a_links(
        ops: Operations, app: Celery) -> None:
    """A link carrying a message of its own (``?done=`` as a redirect after an action has
    it) shows none on any page; the message an action's redirect carries shows, escaped,
    to whoever took it, and shows nothing once altered or opened by someone else."""
    client = signed_in(Dashboard(ops, token=TOKEN, app=app))
    spoof = f"Your session ended: sign in again at evil.example {SCRIPT}"
    for page in ("/dead", "/pauses", "/outbox", "/schedules"):
        for query in ({"done": spoof}, {"done": spoof, "seal": "0" * 64}):
            shown = client.get(page, query_string=query)
            assert shown.status_code == 200, (page, shown.text)
            assert "evil.example" not in shown.text and 'class="done"' not in shown.text, page
    mounted = Dashboard(ops, app=app)
    alice, bob = signed_in_as(mounted, "alice"), signed_in_as(mounted, "bob")
    token = csrf(alice.get("/pauses"))
    done = alice.post("/pauses/pause", data={"csrf": token, "queue": "jobs",
                                             "reason": SCRIPT})
    assert done.status_code == 303, done.text
    link = done.headers["Location"]
    assert '<p class="done">paused jobs</p>' in alice.get(link).text
    altered = link.replace("paused", "purged")
    assert altered != link and 'class="done"' not in alice.get(altered).text
    assert 'class="done"' not in bob.get(link).text  # not bob's to be told
    assert ops.resume("jobs")
