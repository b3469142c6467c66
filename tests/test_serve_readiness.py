"""The Retry-After of a 503 about an engine on its way back (serve/readiness.py), as a table;
the supervisor's own snapshot of it (``EngineProcess.readiness``) with time passed in; the
relay's and the engine views' use of it over an engine that answers 503 itself (the HTTP
layer alone: the real engine's restarts are tests/test_serve_retry_after.py)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from slmguard.errors import EngineBusyError, envelope
from slmguard.governor.request import NoPolicy
from slmguard.serve.engine import EngineProcess, RestartPolicy
from slmguard.serve.flights import Flights
from slmguard.serve.llamaserver import EngineConfig
from slmguard.serve.readiness import Readiness, RetryAfter
from slmguard.serve.relay import Relay
from slmguard.serve.routes import ENGINE_VIEWS, view
from slmguard.serve.sizing import Sizing, TokenLimits

BOUNDS = RetryAfter(2, 60)


@pytest.mark.parametrize(
    ("readiness", "died", "seconds"),
    [
        # restarting: the backoff left + the last load, rounded up
        (Readiness("restarting", backoff_left_s=0.4, next_backoff_s=1, last_load_s=3.2), False, 4),
        (Readiness("stalled", backoff_left_s=5.0, next_backoff_s=1.0, last_load_s=2.5), False, 8),
        # restarting before the backoff is scheduled: the next backoff
        (Readiness("restarting", next_backoff_s=1.0, last_load_s=3.2), False, 5),
        # loading: the rest of the last load's time, or as long again as it ran
        (Readiness("loading", loading_for_s=1.0, last_load_s=4.5), False, 4),
        (Readiness("loading", loading_for_s=6.2, last_load_s=4.5), False, 7),
        # ready, but a request found it gone: the next backoff + the last load
        (Readiness("ready", next_backoff_s=0.5, last_load_s=3.1), True, 4),
        # ready and busy: nothing says when; the default
        (Readiness("ready", next_backoff_s=0.5, last_load_s=3.1), False, 2),
        # before the first load finished, parked, failed: the default
        (Readiness("loading", loading_for_s=30.0), False, 2),
        (Readiness("restarting", backoff_left_s=9.0), False, 2),
        (Readiness("parked", last_load_s=9.0), False, 2),
        (Readiness("failed", last_load_s=9.0), True, 2),
        # bounded: never below the default, never above the maximum
        (Readiness("restarting", backoff_left_s=0.0, last_load_s=0.2), False, 2),
        (Readiness("restarting", backoff_left_s=30.0, last_load_s=290.0), False, 60),
        (Readiness("loading", loading_for_s=400.0, last_load_s=1.0), False, 60),
    ],
)
def test_retry_after_counts_the_backoff_left_and_the_last_load(
    readiness: Readiness, died: bool, seconds: int
) -> None:
    assert BOUNDS.seconds(readiness, died=died) == seconds


def test_a_whole_second_is_not_rounded_up_past_itself() -> None:
    assert BOUNDS.seconds(Readiness("restarting", backoff_left_s=1.0, last_load_s=3.0)) == 4
    assert RetryAfter(5, 60).seconds(Readiness("restarting", backoff_left_s=1, last_load_s=1)) == 5


def _supervisor(tmp_path: Path, policy: RestartPolicy) -> EngineProcess:
    config = EngineConfig(model_path="/m", n_ctx=512, n_batch=512, n_ubatch=512, n_threads=1)
    return EngineProcess(Path("/bin/false"), config, policy, alias="m", runtime_dir=tmp_path)


def test_the_supervisors_snapshot_says_what_it_measured(tmp_path: Path) -> None:
    policy = RestartPolicy(backoff_initial_s=0.5, backoff_max_s=4.0, window_s=60.0)
    eng = _supervisor(tmp_path, policy)
    first = eng.readiness(100.0)
    assert first == Readiness("loading", next_backoff_s=0.5)  # nothing measured yet
    eng.last_load_s = 3.0
    eng._load_started_s = 98.0
    assert eng.readiness(100.0).loading_for_s == 2.0
    eng._load_started_s = None
    eng.state = "restarting"
    eng._restart_at_s = 101.5
    eng._spawned_s, eng._consecutive = 90.0, 2  # the third death in a row: 0.5 x 2**2
    snap = eng.readiness(100.0)
    assert (snap.backoff_left_s, snap.next_backoff_s, snap.last_load_s) == (1.5, 2.0, 3.0)
    # A child that lived longer than the restart window starts the doubling again.
    assert eng.readiness(151.0).next_backoff_s == 0.5


# ---------------------------------------------------------------- the relay and the views


class LoadingEngine:
    """An engine as the relay sees it while it reloads: its socket already answers, 503
    ``Loading model`` (llama-server's answer before its model is loaded)."""

    state = "loading"
    recycling = False
    config = SimpleNamespace(n_ctx_slot=512)

    def __init__(self, readiness: Readiness) -> None:
        self.client = self
        self._readiness = readiness

    def readiness(self) -> Readiness:
        return self._readiness

    async def calls_open(self) -> None:
        return None

    async def request(self, method: str, path: str, body: Any = None,
                      timeout_s: float = 0) -> tuple[int, bytes, str]:  # fmt: skip
        error = {"code": 503, "message": "Loading model", "type": "unavailable_error"}
        return 503, json.dumps({"error": error}).encode(), "application/json"


def _relay(engine: Any) -> Relay:
    queue = SimpleNamespace(slots=1)
    sizing = Sizing(NoPolicy(), TokenLimits(), settings=lambda: engine.config,
                    slots=lambda: queue.slots)  # fmt: skip
    return Relay(engine, queue, Flights(), None, NoPolicy(), sizing,  # type: ignore[arg-type]
                 retry_after=BOUNDS, sessions=None)  # fmt: skip


def test_a_tokenize_answered_loading_model_says_when_the_load_ends() -> None:
    """The soak's 503 engine_unavailable: a dialect's call reached the reloading engine."""
    relay = _relay(LoadingEngine(Readiness("loading", loading_for_s=0.5, last_load_s=6.2)))
    with pytest.raises(EngineBusyError) as info:
        asyncio.run(relay.call_json("/tokenize", {"content": "Hi"}))
    env = envelope(info.value, retry_after_s=2)
    assert (env.status, env.code) == (503, "engine_unavailable")
    assert env.headers()["Retry-After"] == "6"  # 6.2 - 0.5, rounded up


@pytest.mark.parametrize("path", sorted(ENGINE_VIEWS))
def test_an_engine_view_passes_the_engines_503_on_with_retry_after(path: str) -> None:
    """A view relays the engine's own answer; its 503 (a ready engine that says it is
    busy: nothing says when) gets the default Retry-After, as the front's own do."""
    engine = LoadingEngine(Readiness("ready", next_backoff_s=0.5, last_load_s=9.5))
    engine.state = "ready"
    srv = SimpleNamespace(engine=engine, relay=_relay(engine))
    request = SimpleNamespace(url=SimpleNamespace(path=path))
    resp = asyncio.run(view(request, srv))  # type: ignore[arg-type]
    assert resp.status_code == 503
    assert resp.headers["retry-after"] == "2"
