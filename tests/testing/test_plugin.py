"""The pytest fixtures as a service uses them: the sample shop project's tests
(examples/testing), run by pytester in a pytest of their own, on each database."""

from __future__ import annotations

import shutil

import pytest

from tests.docs.support import EXAMPLES

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


@pytest.mark.parametrize(("starting", "error"), [
    # worker_init: the worker process has imported the app and is starting
    ("print('still waking up', flush=True)\n    time.sleep(30)", "*was not ready within 4 s*"),
    ("print('no worker today', flush=True)\n    os._exit(3)",
     "*exited with code 3 before it was ready*"),
], ids=["late", "dead"])
def test_a_worker_process_that_does_not_start_fails_the_test_with_its_log(
        pytester: pytest.Pytester, starting: str, error: str) -> None:
    pytester.makeini("[pytest]\nsqlinbox = true\nsqlinbox_app = service:app\n"
                     "sqlinbox_worker_start = 4\n")
    pytester.makepyfile(service=(
        "import os\nimport time\n\nfrom celery import Celery\n"
        "from celery.signals import worker_init\n\nimport kombu_sqlinbox  # noqa: F401\n\n"
        "app = Celery('service', broker='memory://')\n\n\n"
        f"@worker_init.connect\ndef starting(**kwargs):\n    {starting}\n"))
    pytester.makepyfile(test_it="def test_worker(sqlinbox_worker_process):\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines([error, "*" + starting.split("'")[1] + "*"])
