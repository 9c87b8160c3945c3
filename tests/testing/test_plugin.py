"""The pytest fixtures as a service uses them: the sample shop project's tests
(examples/testing), run by pytester in a pytest of their own, on each database."""

from __future__ import annotations

import dataclasses
import shutil
import uuid

import pytest
from sqlalchemy import inspect, text
from sqlalchemy.engine import Engine

import celery_ext
from kombu_sqlinbox.brokers import close_all
from tests.databases import drop_tables
from tests.docs.support import EXAMPLES
from tests.integration.support import quoted

SHOP = EXAMPLES / "testing"


def test_the_shop_tests_pass_with_the_clock_on(database: str, db_url: str,
                                                 pytester: pytest.Pytester) -> None:
    """On each database (``db_url`` comes first: pytester forgets the modules a test
    imports after it, and SQLAlchemy warns when its dialects are imported again)."""
    for name in ("shop.py", "test_shop.py", "conftest.py", "pytest.ini"):
        shutil.copy(SHOP / name, pytester.path / name)
    # SQLite: the default, a new file per test; a server: its URL, a prefix per test
    url = [] if database == "sqlite" else [f"--sqlinbox-url={db_url}"]
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", *url)
    result.assert_outcomes(passed=7)


def test_an_app_without_an_outbox_or_a_name_drains_and_says_what_it_lacks(
        pytester: pytest.Pytester) -> None:
    """Opted in with --sqlinbox; the app comes from an overridden fixture, not the ini, so
    no worker process can import it by name."""
    pytester.makeconftest("""
        import pytest
        from celery import Celery

        import kombu_sqlinbox  # noqa: F401

        app = Celery("plain", broker="memory://")

        @app.task
        def add(x, y):
            return x + y

        @app.task
        def again():
            again.delay()

        @pytest.fixture
        def sqlinbox_service_app():
            return app
    """)
    pytester.makepyfile("""
        import pytest

        def test_drain(sqlinbox_app, sqlinbox_drain):
            sqlinbox_app.tasks["conftest.add"].delay(2, 3)
            assert [(ran.task, ran.result) for ran in sqlinbox_drain()] == [
                ("conftest.add", 5)]

        def test_a_task_that_keeps_sending_itself(sqlinbox_app, sqlinbox_drain):
            sqlinbox_app.tasks["conftest.again"].delay()
            with pytest.raises(RuntimeError, match="drain[(][)] ran 5 tasks and more are"):
                sqlinbox_drain(limit=5)

        def test_no_dead_letter_queue(sqlinbox_dead_letters):
            with pytest.raises(ValueError, match="'celery' has no dead_letter_queue"):
                sqlinbox_dead_letters()

        def test_waiting_in_vain(sqlinbox):
            with pytest.raises(TimeoutError, match="still false after 0.1 s"):
                sqlinbox.wait_for(lambda: False, timeout=0.1)

        def test_outbox(sqlinbox_outbox):
            pass

        def test_worker_process(sqlinbox_worker_process):
            pass
    """)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--sqlinbox")
    result.assert_outcomes(passed=4, errors=2)
    result.stdout.fnmatch_lines(["*the service's app has no outbox*",
                                 "*a worker process imports the app by name*"])


@pytest.mark.parametrize(("ini", "fixture", "error"), [
    # installed, the plugin only adds options: no fixtures until the project opts in
    ("[pytest]\n", "sqlinbox_clock", "*fixture 'sqlinbox_clock' not found*"),
    ("[pytest]\nsqlinbox = true\n", "sqlinbox_app", "*set sqlinbox_app = module:attribute*"),
], ids=["not opted in", "no app named"])
def test_a_project_not_set_up_gets_an_error_saying_so(
        pytester: pytest.Pytester, ini: str, fixture: str, error: str) -> None:
    pytester.makeini(ini)
    pytester.makepyfile(f"def test_it({fixture}):\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines([error])


@pytest.mark.parametrize(("starting", "patience", "error"), [
    # worker_init: the worker process has imported the app and is starting
    # (a loaded machine may take several seconds to get there)
    ("print('still waking up', flush=True)\n    time.sleep(120)", 15,
     "*was not ready within 15 s*"),
    ("print('no worker today', flush=True)\n    os._exit(3)", 60,
     "*exited with code 3 before it was ready*"),
], ids=["late", "dead"])
def test_a_worker_process_that_does_not_start_fails_the_test_with_its_log(
        pytester: pytest.Pytester, starting: str, patience: int, error: str) -> None:
    pytester.makeini("[pytest]\nsqlinbox = true\nsqlinbox_app = service:app\n"
                     f"sqlinbox_worker_start = {patience}\n")
    pytester.makepyfile(service=(
        "import os\nimport time\n\nfrom celery import Celery\n"
        "from celery.signals import worker_init\n\nimport kombu_sqlinbox  # noqa: F401\n\n"
        "app = Celery('service', broker='memory://')\n\n\n"
        f"@worker_init.connect\ndef starting(**kwargs):\n    {starting}\n"))
    pytester.makepyfile(test_it="def test_worker(sqlinbox_worker_process):\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines([error, "*" + starting.split("'")[1] + "*"])


SERVICE = """
from celery import Celery
from kombu import Queue

import celery_ext
import kombu_sqlinbox  # noqa: F401
from kombu_sqlinbox import TableBuilder

JOBS = (TableBuilder("{jobs}").id().payload().headers().priority().available_at()
        .locked_until().attempt().build())


def make_app(broker="sqlinbox+sqlite:///unused.db", prefix="sqlinbox_"):
    made = Celery("service", broker=broker, set_as_current=False)
    made.conf.update(task_ignore_result=True, task_queues=[Queue("celery"), Queue("jobs")],
                     broker_transport_options={{"table_prefix": prefix,
                                               "queues": {{"jobs": {{"table": JOBS}}}}}})
    made.task(name="service.add")(add)
    return made


def add(x, y):
    return x + y


# in production, the service's migrations make its tables
app = make_app()
app.conf.broker_transport_options["create_tables"] = False
outbox = celery_ext.install(app, table="{outbox}", create_table=False)
"""

TESTS = """
import os

from sqlalchemy import create_engine, inspect


def record(sqlinbox):
    \"\"\"Write the test's prefix and the tables under it now, while the test runs.\"\"\"
    engine = create_engine(os.environ["SQLINBOX_DATABASE"])
    names = [name for name in inspect(engine).get_table_names()
             if name.startswith(sqlinbox.prefix)]
    engine.dispose()
    with open(os.environ["SQLINBOX_PREFIXES"], "a") as out:
        out.write(" ".join([sqlinbox.prefix, *sorted(names)]) + "\\n")


def test_drain(sqlinbox, sqlinbox_app, sqlinbox_drain):
    sqlinbox_app.send_task("service.add", (1, 2))
    sqlinbox_app.send_task("service.add", (2, 3), queue="jobs")
    assert sorted(ran.result for ran in sqlinbox_drain()) == [3, 5]
    record(sqlinbox)


def test_outbox(sqlinbox, sqlinbox_outbox):
    assert sqlinbox_outbox.status().unprocessed == 0
    record(sqlinbox)
"""


def test_the_fixtures_leave_the_service_tables_alone(
        database: str, db_url: str, engine: Engine, table_prefix: str,
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run against a database where the service already has its outbox table (one
    unprocessed record) and a declared queue table (one message): each test runs on
    tables under a prefix of its own (the queues', the routing tables, the declared ones
    renamed), dropped after it, and the service's tables (its routing tables under its
    own prefix too) are left as they were.
    The service makes its tables itself (create_tables off): the tests' own are the
    fixtures' to make."""
    tag = uuid.uuid4().hex[:8]
    jobs, outbox_table = f"svc_jobs_{tag}", f"svc_outbox_{tag}"
    pytester.makepyfile(service=SERVICE.format(jobs=jobs, outbox=outbox_table),
                        test_service=TESTS)
    pytester.makeini("[pytest]\nsqlinbox = true\nsqlinbox_app = service:app\n")
    prefixes = pytester.path / "prefixes.txt"
    monkeypatch.setenv("SQLINBOX_PREFIXES", str(prefixes))
    monkeypatch.setenv("SQLINBOX_DATABASE", db_url)
    monkeypatch.syspath_prepend(pytester.path)
    import service  # the project's own module, as the deployed service has it

    deployed = service.make_app("sqlinbox+" + db_url, table_prefix)
    outbox = celery_ext.install(deployed, db_url, table=outbox_table)
    try:
        deployed.send_task("service.add", (7, 7), queue="jobs")  # recorded, then sent
        outbox.uninstall()
        outbox.close()
        close_all()
        before = {jobs: count(engine, jobs), outbox_table: count(engine, outbox_table)}
        assert before == {jobs: 1, outbox_table: 1}
        service_tables = tables_of(engine, table_prefix, jobs, outbox_table)

        result = pytester.runpytest_subprocess("-p", "no:cacheprovider",
                                               f"--sqlinbox-url={db_url}")
        assert {jobs: count(engine, jobs), outbox_table: count(engine, outbox_table)} == before
        assert tables_of(engine, table_prefix, jobs, outbox_table) == service_tables
        result.assert_outcomes(passed=2)
        during = {prefix: names for prefix, *names in map(str.split,
                                                         prefixes.read_text().splitlines())}
        assert len(during) == 2, during
        for prefix, names in during.items():  # the queues', renamed declared and routing
            assert {f"{prefix}celery", f"{prefix}{jobs}", f"{prefix}queues"} <= set(names), (
                prefix, names)
        assert any(f"{prefix}{outbox_table}" in names for prefix, names in during.items())
        assert tables_of(engine, *during) == set()
    finally:
        close_all()
        drop_tables(engine, jobs)
        drop_tables(engine, outbox_table)


def tables_of(engine: Engine, *starts: str) -> set[str]:
    """The tables whose names start with one of ``starts`` (prefixes, or whole names)."""
    return {name for name in inspect(engine).get_table_names() if name.startswith(starts)}


def count(engine: Engine, table: str) -> int | None:
    """The rows of ``table``; None when it does not exist."""
    if not inspect(engine).has_table(table):
        return None
    with engine.connect() as conn:
        return int(conn.execute(text(f"SELECT COUNT(*) FROM {quoted(engine, table)}")).scalar())


def test_a_declared_table_and_its_publish_statement_are_renamed_for_a_test() -> None:
    from celery_ext.testing import own_table
    from kombu_sqlinbox import TableBuilder

    spec = (TableBuilder("email_jobs", schema="app").id().payload().locked_until().attempt()
            .publish_statement('INSERT INTO app."email_jobs" (payload) VALUES (:payload)')
            .build())
    renamed = own_table(spec, "t1234_")
    assert (renamed.table, renamed.schema) == ("t1234_email_jobs", "app")
    assert renamed.publish == 'INSERT INTO app."t1234_email_jobs" (payload) VALUES (:payload)'
    plain = dataclasses.replace(spec, publish="insert into email_jobs_x select * from email_jobs")
    assert own_table(plain, "t1_").publish == (
        "insert into email_jobs_x select * from t1_email_jobs")


def test_a_fixture_that_fails_to_set_up_leaves_the_app_as_it_was(
        pytester: pytest.Pytester) -> None:
    """A queue table that cannot serve (its publish statement names a column it lacks)
    fails the test's set-up, and the next test finds the service's app unbound, its
    declarations under their own names (not under a prefix, nor under two)."""
    pytester.makeini("[pytest]\nsqlinbox = true\nsqlinbox_app = service:app\n")
    pytester.makepyfile(service="""
        from celery import Celery
        from kombu import Queue

        import celery_ext
        import kombu_sqlinbox  # noqa: F401
        from kombu_sqlinbox import TableBuilder

        JOBS = (TableBuilder("svc_jobs").id().payload().locked_until().attempt()
                .publish_statement("INSERT INTO svc_jobs (payload, nosuch) VALUES (:payload, 1)")
                .build())
        app = Celery("service", broker="sqlinbox+sqlite:///unused.db", set_as_current=False)
        app.conf.update(task_queues=[Queue("jobs")],
                        broker_transport_options={"queues": {"jobs": {"table": JOBS}}})
        outbox = celery_ext.install(app, table="svc_outbox")
    """)
    pytester.makepyfile(test_it="""
        import service


        def test_set_up_fails(sqlinbox):
            pass


        def test_the_app_is_as_it_was():
            options = service.app.conf.broker_transport_options
            assert service.app.conf.broker_url == "sqlinbox+sqlite:///unused.db"
            assert options == {"queues": {"jobs": {"table": service.JOBS}}}
            assert service.outbox.spec.table == "svc_outbox"
            assert service.outbox.store.create_table
    """)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*its publish statement does not fit the schema*"])


def test_a_database_gone_before_tear_down_leaves_the_app_as_it_was(
        pytester: pytest.Pytester) -> None:
    """The test's database is gone when its tables are to be dropped (here: the SQLite
    file's directory is removed): that tear-down fails, saying so, and the next test
    still finds the service's app unbound."""
    pytester.makeini("[pytest]\nsqlinbox = true\nsqlinbox_app = service:app\n")
    pytester.makepyfile(service="""
        from celery import Celery

        import celery_ext
        import kombu_sqlinbox  # noqa: F401

        app = Celery("service", broker="sqlinbox+sqlite:///unused.db", set_as_current=False)
        outbox = celery_ext.install(app, table="svc_outbox")
    """)
    pytester.makeconftest("""
        import pytest

        @pytest.fixture
        def sqlinbox_url(tmp_path):
            (tmp_path / "db").mkdir()
            return f"sqlinbox+sqlite:///{tmp_path / 'db' / 'inbox.db'}"
    """)
    pytester.makepyfile(test_it="""
        import shutil

        import service


        def test_the_database_goes_away(sqlinbox, sqlinbox_app, sqlinbox_url):
            sqlinbox_app.send_task("service.add", (1, 2))
            shutil.rmtree(sqlinbox_url.removeprefix("sqlinbox+sqlite:///").rsplit("/", 1)[0])


        def test_the_app_is_as_it_was():
            assert service.app.conf.broker_url == "sqlinbox+sqlite:///unused.db"
            assert service.app.conf.broker_transport_options == {}
            assert service.outbox.spec.table == "svc_outbox"
    """)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(["*ERROR at teardown of test_the_database_goes_away*"])


def test_the_worker_process_gets_the_password_outside_its_command_line(
        pytester: pytest.Pytester) -> None:
    """Any local user reads a process's command line (``ps``): the worker process started
    for a test on ``--sqlinbox-url`` must not carry the URL's password there."""
    from sqlalchemy.engine import make_url

    from tests.databases import require_server

    secret = f"Pw-{uuid.uuid4().hex[:12]}"
    # PostgreSQL here trusts local connections: any password is accepted
    url = make_url(require_server("postgresql")).set(password=secret).render_as_string(
        hide_password=False)
    pytester.makeini("[pytest]\nsqlinbox = true\nsqlinbox_app = service:app\n")
    pytester.makepyfile(service="""
        from celery import Celery

        import kombu_sqlinbox  # noqa: F401

        app = Celery("service", broker="sqlinbox+sqlite:///unused.db", set_as_current=False)
    """)
    pytester.makepyfile(test_it=f"""
        from pathlib import Path


        def test_command_line(sqlinbox_worker_process):
            cmdline = Path(f"/proc/{{sqlinbox_worker_process.pid}}/cmdline").read_bytes()
            assert b"celery_ext.testing" in cmdline
            assert {secret!r}.encode() not in cmdline, cmdline
    """)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", f"--sqlinbox-url={url}")
    result.assert_outcomes(passed=1)
