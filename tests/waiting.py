"""Waiting in tests without racing the clock: one helper, bounds scaled for slow machines.

Every bound a test waits with goes through :func:`scaled`, which multiplies it
by ``SLMGUARD_TEST_TIME_FACTOR`` (default 1; a board or a loaded CI runner
sets 3 or 10). A bound is how long a test is willing to wait before calling
the thing broken, never how long the thing takes: :func:`wait_for` returns as
soon as its condition holds. Rule of thumb for choosing a bound: at least the
interval being waited for plus a generous margin (``wait_for`` refuses a
bound shorter than the interval it is told about).

Example::

    wait_for(lambda: state.exists(), 30, "the state file", interval_s=1.0)
    proc.communicate(timeout=scaled(60))
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

ENV = "SLMGUARD_TEST_TIME_FACTOR"
POLL_S = 0.05


def time_factor() -> float:
    """``SLMGUARD_TEST_TIME_FACTOR`` as a number >= 1 (unset, empty or bad: 1)."""
    try:
        return max(1.0, float(os.environ.get(ENV, "") or 1))
    except ValueError:
        return 1.0


def scaled(seconds: float) -> float:
    """A bound of ``seconds`` on this machine (times the test time factor)."""
    return seconds * time_factor()


def wait_for(
    condition: Callable[[], T | bool | None],
    timeout_s: float,
    what: str,
    *,
    interval_s: float = 0.0,
) -> T:
    """Poll ``condition`` until it returns something truthy, and return that.

    ``timeout_s`` is scaled here (pass the unscaled bound). ``interval_s`` is
    the period of what is being waited for (a daemon's poll interval): a
    bound shorter than twice that is a test bug, refused at once. Raises
    AssertionError naming ``what`` when the bound passes.
    """
    if timeout_s < 2 * interval_s:
        raise AssertionError(
            f"waiting {timeout_s:g} s for {what}, which happens every {interval_s:g} s: "
            "the bound must be at least twice the interval"
        )
    bound = scaled(timeout_s)
    deadline = time.monotonic() + bound
    while True:
        value = condition()
        if value:
            return value  # type: ignore[return-value]
        if time.monotonic() > deadline:
            raise AssertionError(
                f"gave up waiting for {what} after {bound:g} s "
                f"({ENV}={time_factor():g}; raise it on a slow machine)"
            )
        time.sleep(POLL_S)
