"""The sdist and the wheel as built from a clone: checked by twine, holding every file the
package needs, installed as the package people import, its commands and plugin with it."""

from __future__ import annotations

import configparser
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

from tests.package.conftest import Installed
from tests.processes import ROOT

PACKAGES = ("kombu_sqlinbox", "celery_ext")
LIMIT = 120.0


def test_twine_checks_the_sdist_and_the_wheel(installed: Installed) -> None:
    built = [installed.dist(".tar.gz"), installed.dist(".whl")]
    done = subprocess.run([sys.executable, "-m", "twine", "check", "--strict", *map(str, built)],
                          capture_output=True, text=True, timeout=LIMIT)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_wheel_holds_every_file_of_the_packages_and_their_entry_points(
        installed: Installed) -> None:
    with zipfile.ZipFile(installed.dist(".whl")) as wheel:
        names = set(wheel.namelist())
        (entry_points,) = [name for name in names if name.endswith(".dist-info/entry_points.txt")]
        shipped = configparser.ConfigParser()
        shipped.read_string(wheel.read(entry_points).decode())
    needed = {name for name in installed.files if name.split("/")[0] in PACKAGES}
    assert needed - names == set()  # a migration, py.typed, any data file the code reads
    assert {name for name in names - needed if ".dist-info/" not in name} == set()
    declared = configparser.ConfigParser()
    declared.read(ROOT / "setup.cfg")
    for group, lines in declared["options.entry_points"].items():
        assert {line.replace(" ", "") for line in lines.split("\n") if line} == {
            f"{name}={value}" for name, value in shipped[group].items()}, group


def test_the_sdist_holds_what_builds_tests_and_documents_the_package(
        installed: Installed) -> None:
    sdist = installed.dist(".tar.gz")
    with tarfile.open(sdist) as archive:
        top = sdist.name.removesuffix(".tar.gz") + "/"
        names = {member.name.removeprefix(top) for member in archive.getmembers()}
    wanted = {name for name in installed.files if not name.startswith(".")}
    assert wanted - names == set()
    assert "CHANGELOG.rst" in names


def test_the_package_imported_is_the_installed_wheel(installed: Installed,
                                                      tmp_path: Path) -> None:
    done = installed.run(
        "python -c 'import importlib.metadata as m, kombu_sqlinbox as k, celery_ext as c; "
        "print(k.__file__, c.__file__, k.__version__, m.version(\"kombu-sqlinbox\"))'",
        cwd=tmp_path, timeout=LIMIT)
    assert done.returncode == 0, done.stderr
    package, extension, version, distribution = done.stdout.split()
    site = installed.venv / "lib"
    assert Path(package).is_relative_to(site) and Path(extension).is_relative_to(site)
    assert version == distribution
    assert installed.dist(".whl").name.startswith(f"kombu_sqlinbox-{version}-")


def test_the_commands_come_with_the_wheel(installed: Installed, tmp_path: Path) -> None:
    for command in ("sqlinbox --help", "celery sqlinbox --help", "celery outbox --help"):
        done = installed.run(command, cwd=tmp_path, timeout=LIMIT)
        assert done.returncode == 0, f"{command}: {done.stdout}{done.stderr}"


def test_the_changelog_names_the_version_first() -> None:
    from kombu_sqlinbox import __version__

    changelog = (ROOT / "CHANGELOG.rst").read_text()
    assert re.findall(r"^(\d+\.\d+\.\d+)\n-+$", changelog, re.MULTILINE)[0] == __version__


def test_a_driver_not_installed_names_the_extra_that_installs_it(installed: Installed,
                                                                 tmp_path: Path) -> None:
    """The guide installs the ``postgres`` extra only: a URL naming psycopg2, or a MySQL
    URL, says which extra to install, on one line, not a driver's ImportError."""
    for url, extra in (("postgresql+psycopg2://root:s3cret@127.0.0.1/test", "psycopg2"),
                       ("mysql://root:s3cret@127.0.0.1/test", "mysql"),
                       ("mysql+pymysql://root:s3cret@127.0.0.1/test", "mysql")):
        done = installed.run(f"sqlinbox --url '{url}' queues", cwd=tmp_path, timeout=LIMIT)
        assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
        (error,) = [line for line in done.stderr.splitlines() if line.startswith("Error:")]
        assert f"pip install 'kombu-sqlinbox[{extra}]'" in error, error
        assert "s3cret" not in done.stderr
        connect = (f"python -c 'import kombu, kombu_sqlinbox; "
                   f"kombu.Connection(\"sqlinbox+{url}\").default_channel'")
        done = installed.run(connect, cwd=tmp_path, timeout=LIMIT)
        last = done.stderr.strip().splitlines()[-1]
        assert last.startswith("kombu_sqlinbox.errors.ConfigurationError: "), done.stderr
        assert f"pip install 'kombu-sqlinbox[{extra}]'" in last and "s3cret" not in last


def test_the_dashboard_without_its_extra_names_the_extra_that_installs_it(
        installed: Installed, tmp_path: Path) -> None:
    """The guide's install has no ``dashboard`` extra: ``sqlinbox dashboard`` says which
    extra to install, on one line, not an ImportError's traceback."""
    absent = installed.run("python -c 'import jinja2'", cwd=tmp_path, timeout=LIMIT)
    assert absent.returncode != 0, "the guide's install brought Jinja2: nothing to check"
    done = installed.run(f"sqlinbox --url 'sqlite:///{tmp_path}/q.db' dashboard --port 0",
                         cwd=tmp_path, timeout=LIMIT)
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
    (error,) = [line for line in done.stderr.splitlines() if line.startswith("Error:")]
    assert "pip install 'kombu-sqlinbox[dashboard]'" in error, error
