"""The time-bounded values routing keeps (bindings and message TTLs read, declarations and
bindings written lately): each lapses after its own seconds, is read again once lapsed,
and is forgotten at once when told."""

from __future__ import annotations

import time

import pytest

from kombu_sqlinbox.lapsing import Lapsing


class Ticks:
    """A clock that moves only when told (the monotonic clock, stood still)."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_value_is_fresh_for_its_own_seconds_and_then_lapses() -> None:
    ticks = Ticks()
    kept: Lapsing[str, int] = Lapsing(ticks)
    kept.keep("a", 1, 2.0)
    kept.keep("b", 2, 0.5)
    assert kept.fresh("a") and kept.fresh("b") and not kept.fresh("c")
    ticks.now += 1.0
    assert kept.fresh("a") and not kept.fresh("b")
    ticks.now += 1.0
    assert not kept.fresh("a")


def test_read_loads_once_while_fresh_and_again_once_lapsed_a_none_kept_too() -> None:
    ticks = Ticks()
    kept: Lapsing[str, int | None] = Lapsing(ticks)
    loads: list[int | None] = [None, 7]
    assert kept.read("q", 2.0, loads.pop) == 7
    assert kept.read("q", 2.0, loads.pop) == 7  # fresh: not loaded again
    ticks.now += 2.0
    assert kept.read("q", 2.0, loads.pop) is None  # lapsed: loaded again
    ticks.now += 1.0
    assert kept.read("q", 2.0, lambda: pytest.fail("a fresh None loaded again")) is None


def test_forget_and_forget_where_drop_at_once() -> None:
    kept: Lapsing[tuple[str, ...], None] = Lapsing(Ticks())
    for key in [("q",), ("x", "direct", "q", "k", ""), ("y", "direct", "r", "k", "")]:
        kept.keep(key, None, 60.0)
    kept.forget(("q",))
    kept.forget_where(lambda key: len(key) > 1 and key[0] == "x")
    assert [key for key in [("q",), ("x", "direct", "q", "k", ""),
                            ("y", "direct", "r", "k", "")] if kept.fresh(key)] == [
        ("y", "direct", "r", "k", "")]


def test_the_host_clock_stepped_back_or_forth_neither_keeps_nor_drops(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """By default a value lapses by the monotonic clock: the host's stepping a day either
    way changes nothing."""
    kept: Lapsing[str, int] = Lapsing()
    kept.keep("soon", 1, 0.05)
    kept.keep("later", 2, 60.0)
    real = time.time
    for step in (-86400.0, 86400.0):
        monkeypatch.setattr(time, "time", lambda step=step: real() + step)
        assert kept.fresh("later")
    deadline = time.monotonic() + 5
    while kept.fresh("soon") and time.monotonic() < deadline:
        time.sleep(0.01)  # the monotonic clock's own passing is what is awaited
    assert not kept.fresh("soon") and kept.fresh("later")
