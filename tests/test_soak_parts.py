"""The soak's arithmetic (issue 40), without a server: the drift slope over the samples
after warm-up (within each engine process), the pause a retrying client takes (as the
openai and anthropic libraries do), and which failed answers no injected fault explains.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
try:
    import soak
finally:
    sys.path.remove(str(REPO / "benchmarks"))


def _sample(requests: int, front: int, engine: int, pid: int) -> dict[str, object]:
    return {"requests": requests, "front_private_bytes": front,
            "engine_private_bytes": engine, "engine_pid": pid}  # fmt: skip


def test_drift_is_the_slope_after_warm_up_within_each_engine() -> None:
    # The front grows 40 MiB during warm-up, then 100 bytes per request; the engine grows
    # 10 bytes per request but is restarted (smaller) at request 3000.
    samples = [_sample(0, 0, 0, 1), _sample(500, 40 << 20, 5000, 1)]
    for r in range(1000, 6001, 500):
        engine = 10 * r if r < 3000 else 10 * (r - 3000)
        samples.append(_sample(r, (40 << 20) + 100 * r, engine, 1 if r < 3000 else 2))
    front = soak.drift(samples, "front", warmup=1000)
    assert front["per_10000_bytes"] == 1_000_000
    assert (front["samples"], front["from_request"], front["to_request"]) == (11, 1000, 6000)
    engine = soak.drift(samples, "engine", warmup=1000)
    assert engine["per_10000_bytes"] == 100_000 and engine["processes"] == 2


def test_drift_without_two_samples_is_none() -> None:
    assert soak.drift([_sample(1000, 5, 5, 1)], "front", warmup=0)["per_10000_bytes"] is None


def test_a_client_waits_as_retry_after_says_else_backs_off() -> None:
    assert soak.client_delay(soak.Answer("503 x", 503, "3"), 0) == 3.0
    for retry, top in ((0, 0.5), (1, 1.0), (5, 8.0)):
        for after in (None, "0", "121", "soon"):
            pause = soak.client_delay(soak.Answer("503 x", 503, after), retry)
            assert 0.75 * top <= pause <= top
    assert soak.Answer("429 queue_full", 429).retried()
    assert not soak.Answer("429 queue_full", 429, "600").retried()
    assert soak.Answer("transport ReadError").retried() and soak.Answer("transport x").failed
    assert not soak.Answer("400 invalid_json", 400).retried()
    assert soak.Answer("200 stream-error engine_restarting", 200).failed
    assert not soak.Answer("disconnect", 200).failed


def test_only_failures_outside_every_fault_window_are_unexplained() -> None:
    faults = [{"start_s": 10.0, "end_s": 20.0}, {"start_s": 50.0, "end_s": None}]
    failures = [
        {"n": 1, "start_s": 5.0, "end_s": 11.0},  # in flight when the engine was killed
        {"n": 2, "start_s": 19.0, "end_s": 19.5},
        {"n": 3, "start_s": 21.0, "end_s": 22.0},  # after the window: unexplained
        {"n": 4, "start_s": 60.0, "end_s": 61.0},  # the window still open at the end
    ]
    assert [f["n"] for f in soak.unexplained(failures, faults, end_s=70.0)] == [3]
