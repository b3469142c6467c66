"""What the benchmarks that drive a running ``slmguard serve`` share: reading its
``/health`` and waiting for a condition with a bound."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx


def health(url: str) -> dict[str, Any] | None:
    """The server's /health body, or None while it does not answer one."""
    try:
        data: dict[str, Any] = httpx.get(url + "/health", timeout=5).json()
        return data
    except (httpx.HTTPError, ValueError):
        return None


def wait_until(pred: Callable[[], Any], timeout_s: float, step_s: float = 0.1) -> bool:
    """Poll ``pred`` until it is true (True) or ``timeout_s`` passes (False)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(step_s)
    return False
