"""Where MariaDB's same-host wake-ups meet: a directory of this user's alone, per server
and database, under the temporary directory; anything else there means polling."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
from sqlalchemy import create_engine

from kombu_sqlinbox.dialects import dialect_for

URL = "mysql+pymysql://root@127.0.0.1:3306/"


def signal_directory(database: str = "test") -> str | None:
    engine = create_engine(URL + database)  # no connection is made
    try:
        return dialect_for(engine).signal_directory()
    finally:
        engine.dispose()


@pytest.fixture
def temp_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path / f"sqlinbox-{os.getuid()}"


def test_one_private_directory_per_server_and_database(temp_dir: Path) -> None:
    first, again, other = signal_directory(), signal_directory(), signal_directory("other")
    assert first == again != other
    assert first is not None and Path(first).parent == temp_dir
    assert temp_dir.stat().st_mode & 0o777 == 0o700


@pytest.mark.parametrize("made", ["open to others", "a file"])
def test_a_root_not_ours_alone_means_polling(temp_dir: Path, made: str,
                                             caplog: pytest.LogCaptureFixture) -> None:
    if made == "a file":
        temp_dir.write_text("")
    else:
        temp_dir.mkdir()
        temp_dir.chmod(0o777)
    assert signal_directory() is None
    assert "no same-host wake-ups" in caplog.text
