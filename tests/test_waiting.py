"""The test wait helper: bounds scale with SLMGUARD_TEST_TIME_FACTOR, short bounds are refused."""

from __future__ import annotations

import time

import pytest

from waiting import ENV, scaled, time_factor, wait_for


@pytest.mark.parametrize(("value", "factor"), [("", 1.0), ("3", 3.0), ("0.5", 1.0), ("x", 1.0)])
def test_time_factor(monkeypatch: pytest.MonkeyPatch, value: str, factor: float) -> None:
    monkeypatch.setenv(ENV, value)
    assert time_factor() == factor
    assert scaled(10) == 10 * factor


def test_wait_for_returns_the_condition_value_as_soon_as_it_holds() -> None:
    start = time.monotonic()
    values = iter([None, 0, "ready"])
    assert wait_for(lambda: next(values), 30, "the value") == "ready"
    assert time.monotonic() - start < 30  # returned on the condition, not the bound


def test_wait_for_refuses_a_bound_shorter_than_the_interval() -> None:
    with pytest.raises(AssertionError, match="at least twice the interval"):
        wait_for(lambda: True, 30, "a 30 s poll", interval_s=30)


def test_wait_for_names_what_it_gave_up_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "1")
    with pytest.raises(AssertionError, match=r"gave up waiting for the impossible after 0\.1 s"):
        wait_for(lambda: False, 0.1, "the impossible")
