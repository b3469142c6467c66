"""The Retry-After of a 503 about an engine on its way back (serve/readiness.py), as a table;
the supervisor's own snapshot of it (``EngineProcess.readiness``) with time passed in."""

from __future__ import annotations

from pathlib import Path

import pytest

from slmguard.serve.engine import EngineProcess, RestartPolicy
from slmguard.serve.llamaserver import EngineConfig
from slmguard.serve.readiness import Readiness, RetryAfter

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
