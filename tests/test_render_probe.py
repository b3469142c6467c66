"""The pods' liveness probe: alive while the front recovers by itself, dead when it cannot.

The judgement is a table on ``/health`` answers; then the probe runs, as the
kubelet runs it (``python -m slmguard.deploy.probe``), against a real server
with the real engine: a stopped engine (a wedged decode) is the front's to
replace and the probe stays alive through it; a stopped front is dead.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from typing import Any

import pytest

from serveproc import ServeFactory, scaled
from slmguard.deploy.probe import judge


def _health(state: str, **over: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "state": state,
        "engine": {"state": state, "restarts": 0, "stalls": 0},
        "liveness": {"since_progress_s": 1.0, "stall_after_s": 15.0},
        "in_flight": 0,
    }
    body.update(over)
    return body


@pytest.mark.parametrize(
    ("status", "body", "alive", "says"),
    [
        (200, _health("ready"), True, "alive"),
        (200, _health("degraded"), True, "alive"),
        (503, _health("loading"), True, "alive: engine loading"),
        (503, _health("restarting"), True, "alive"),  # killed engine: the front restarts it
        (503, _health("stalled"), True, "alive"),  # found and being replaced
        (503, _health("parked"), True, "alive"),  # the governor stopped it on purpose
        (503, _health("failed"), False, "failed for good"),
        (503, _health("stopped"), False, "stopped for good"),
        (None, None, False, "no answer"),
        (500, {"detail": "x"}, False, "answered 500"),
        (200, None, False, "without the server's health body"),
        # a stall the front should have replaced twice over: its liveness loop is not running
        (
            200,
            _health("ready", in_flight=2, liveness={"since_progress_s": 31, "stall_after_s": 15}),
            False,
            "has not replaced it",
        ),
        # within the grace: the front's own check comes first
        (
            200,
            _health("ready", in_flight=2, liveness={"since_progress_s": 29, "stall_after_s": 15}),
            True,
            "alive",
        ),
        # idle: no progress is expected
        (
            200,
            _health("ready", in_flight=0, liveness={"since_progress_s": 900, "stall_after_s": 15}),
            True,
            "alive",
        ),
    ],
)
def test_judge(status: int | None, body: dict[str, Any] | None, alive: bool, says: str) -> None:
    ok, reason = judge(status, body)
    assert (ok, says in reason) == (alive, True), reason


def _probe(url: str, timeout_s: float = 3.0) -> tuple[int, str]:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "slmguard.deploy.probe",
            "--url",
            url,
            "--timeout-s",
            str(timeout_s),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return done.returncode, done.stdout.strip()


@pytest.mark.engine
@pytest.mark.slow
def test_the_probe_on_a_real_server(serve_factory: ServeFactory) -> None:
    s = serve_factory("--stall-timeout-s", "4", "--canary-interval-s", "1")
    url = s.url + "/health"
    assert _probe(url) == (0, "alive: engine ready, 0 stalls handled, HTTP 200")
    engine = s.engine_pid()
    os.kill(engine, signal.SIGSTOP)  # a wedged decode: the idle canary finds it
    answers = []
    try:
        deadline = time.monotonic() + scaled(120)
        while time.monotonic() < deadline:
            answers.append(_probe(url))
            health = s.health() or {}
            if health.get("engine", {}).get("stalls", 0) >= 1 and health.get("state") == "ready":
                break
            time.sleep(0.5)
    finally:
        with contextlib.suppress(ProcessLookupError):  # the front killed it: replaced
            os.kill(engine, signal.SIGCONT)
    health = s.wait_state("ready", timeout_s=scaled(120))
    assert health["engine"]["stalls"] >= 1 and health["engine"]["pid"] != engine
    assert answers and all(code == 0 for code, _ in answers), answers
    assert _probe(url)[0] == 0
    # The front itself stopped: nothing answers, the kubelet must restart the container.
    os.kill(s.proc.pid, signal.SIGSTOP)
    try:
        code, reason = _probe(url, timeout_s=2.0)
    finally:
        os.kill(s.proc.pid, signal.SIGCONT)
    assert (code, reason) == (1, "no answer from the front: its event loop is hung or it is gone")
    s.wait_state("ready", timeout_s=scaled(60))
