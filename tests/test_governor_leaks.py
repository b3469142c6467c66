"""Leak tracking and the recycle decision (pure), the footprint reader, and the governor
acting on a footprint that grows in a real /proc tree (issue 40).

The engine's whole life with a real leak is ``test_serve_recycle.py``; here the
arithmetic and the loop are driven with literal numbers and files.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import replace
from pathlib import Path

import pytest

from hosttree import build_tree
from slmguard.errors import ConfigError
from slmguard.governor.leaks import (
    EngineView,
    LeakSettings,
    LeakTrack,
    Sample,
    drift,
    drift_bound_bytes,
    observe,
    recycle_verdict,
)
from slmguard.governor.runtime import Governor
from slmguard.governor.signal import MemorySignal
from slmguard.host.footprint import parse_footprint, parse_io, read_footprint, read_io
from test_governor_runtime import CG, CONFIG, Clock, RecordingEngine, host, set_pct

MIB = 1 << 20
FIXTURES = Path(__file__).parent / "fixtures" / "proc"
SETTINGS = LeakSettings(warmup_requests=4, min_bound_bytes=8 * MIB)


def track_of(points: list[tuple[int, int]], *, pid: int = 7) -> LeakTrack:
    track = LeakTrack()
    for requests, mib in points:
        track = observe(track, Sample(pid, mib * MIB, requests), SETTINGS)
    return track


# ---------------------------------------------------------------- the reader


def test_footprint_of_a_captured_llama_server_status() -> None:
    """This machine's llama-server (2026-12-05, Gemma 3 270M loaded, no swap)."""
    fp = parse_footprint((FIXTURES / "llama-server-status").read_text())
    assert fp is not None
    assert (fp.anon_bytes, fp.shmem_bytes, fp.swap_bytes) == (73272 * 1024, 0, 0)
    assert fp.private_bytes == 73272 * 1024


def test_swapped_out_memory_counts_as_the_same_leak() -> None:
    """ollama #18106: a leak the kernel swapped out shows as VmSwap, not RssAnon."""
    text = (FIXTURES / "llama-server-status").read_text()
    swapped = text.replace("VmSwap:\t       0 kB", "VmSwap:\t   40960 kB")
    fp = parse_footprint(swapped)
    assert fp is not None and fp.private_bytes == (73272 + 40960) * 1024


@pytest.mark.parametrize(
    "text",
    ["", "Name:\tkthreadd\nVmSwap:\t0 kB\n", "RssAnon:\tlots kB\n", "RssAnon"],
    ids=["empty", "kernel-thread", "garbled", "truncated"],
)
def test_a_status_without_rss_anon_has_no_footprint(text: str) -> None:
    assert parse_footprint(text) is None


def test_io_counters_of_a_captured_llama_server() -> None:
    io = parse_io((FIXTURES / "llama-server-io").read_text())
    assert io is not None and (io.write_bytes, io.wchar, io.stored_bytes) == (0, 620, 0)
    assert parse_io("rchar: 1\n") is None
    cancelled = parse_io("write_bytes: 8192\ncancelled_write_bytes: 12288\nwchar: 9\n")
    assert cancelled is not None and cancelled.stored_bytes == 0  # never below 0


def test_readers_take_a_root_and_say_none_for_a_gone_process(tmp_path: Path) -> None:
    root = build_tree(tmp_path, {"proc/42/status": "RssAnon:\t10 kB\nVmSwap:\t2 kB\n"})
    fp = read_footprint(root, 42)
    assert fp is not None and fp.private_bytes == 12 * 1024
    assert read_footprint(root, 43) is None and read_io(root, 42) is None
    assert read_footprint(pid=os.getpid()) is not None  # this process, the real /proc


# ---------------------------------------------------------------- the pure decisions


def test_the_baseline_is_taken_after_the_warmup_and_a_new_pid_starts_over() -> None:
    track = track_of([(0, 80), (2, 90), (4, 100), (6, 102)])
    assert track.baseline is not None and track.baseline.private_bytes == 100 * MIB
    assert drift(track_of([(0, 80), (3, 95)]), SETTINGS) is None  # still warming up
    fresh = observe(track, Sample(8, 81 * MIB, 7), SETTINGS)
    assert (fresh.pid, fresh.baseline, fresh.first) == (8, None, Sample(8, 81 * MIB, 7))


def test_linear_growth_is_a_spread_drift_with_its_rate_per_1000_requests() -> None:
    track = track_of([(0, 80), (4, 100), *((r, 100 + (r - 4)) for r in range(5, 45))])
    d = drift(track, SETTINGS)
    assert d is not None and d.spread
    assert (d.baseline_bytes, d.current_bytes, d.drift_bytes) == (100 * MIB, 140 * MIB, 40 * MIB)
    assert (d.requests, d.per_1000_requests_bytes) == (40, 1000 * MIB)


def test_one_step_is_not_a_leak() -> None:
    """A long prompt touching more compute buffer: one step, then flat."""
    step_early = track_of([(0, 80), (4, 100), (6, 140), *((r, 140) for r in range(7, 45))])
    step_late = track_of([(0, 80), (4, 100), *((r, 100) for r in range(5, 40)), (44, 140)])
    for track in (step_early, step_late):
        d = drift(track, SETTINGS)
        assert d is not None and d.drift_bytes == 40 * MIB and not d.spread
        assert recycle_verdict(d, 8 * MIB, idle=True, settings=SETTINGS) is None


def test_growth_the_plan_explains_is_no_drift() -> None:
    """The plan's use parts (compute buffers resident as requests reach them) on top of the
    first sight are expected, even when the baseline was taken before they all were."""
    track = track_of([(0, 80), (4, 90), *((r, 90 + (r - 4) // 4) for r in range(5, 45))])
    d = drift(track, SETTINGS, use_bytes=30 * MIB)
    assert d is not None and d.expected_bytes == 110 * MIB and d.drift_bytes == -10 * MIB


def test_points_are_thinned_keeping_the_span() -> None:
    track = track_of([(r, 80 + r) for r in range(0, 2000)])
    assert len(track.points) <= SETTINGS.max_points
    assert track.points[0] == (4, 84 * MIB) and track.points[-1] == (1999, 2079 * MIB)


def test_the_bound_is_a_share_of_the_room_below_shed() -> None:
    # 1000 MiB limit, shed at 85%: 850; 600 used of which 100 is drift: room 350, half 175.
    bound = drift_bound_bytes(1000 * MIB, 85.0, 600 * MIB, 100 * MIB, SETTINGS)
    assert bound == 175 * MIB
    assert drift_bound_bytes(1000 * MIB, 85.0, 900 * MIB, 0, SETTINGS) == 8 * MIB  # the floor
    assert drift_bound_bytes(None, 85.0, 900 * MIB, 0, SETTINGS) is None


def test_the_verdict_drains_at_the_bound_and_takes_an_idle_moment_before() -> None:
    track = track_of([(0, 80), (4, 100), *((r, 100 + (r - 4)) for r in range(5, 45))])
    d = drift(track, SETTINGS)  # 40 MiB
    assert recycle_verdict(d, 40 * MIB, idle=False, settings=SETTINGS) == "drain"
    assert recycle_verdict(d, 50 * MIB, idle=False, settings=SETTINGS) is None
    assert recycle_verdict(d, 50 * MIB, idle=True, settings=SETTINGS) == "idle"  # 40 >= 37.5
    assert recycle_verdict(d, 60 * MIB, idle=True, settings=SETTINGS) is None
    off = LeakSettings(enabled=False)
    assert recycle_verdict(d, 1, idle=True, settings=off) is None


def test_the_drain_starts_early_by_what_the_queued_generations_will_add() -> None:
    """The drain lets the generations in flight and queued finish on the old engine
    first: at megabytes leaked a request, a drain decided at the bound itself would stop
    that engine well past the bound, closer to shedding than the bound allows."""
    track = track_of([(0, 80), (4, 100), *((r, 100 + 8 * (r - 4)) for r in range(5, 9))])
    d = drift(track, SETTINGS)  # 32 MiB over 4 requests: 8 MiB a request
    assert d is not None and d.per_1000_requests_bytes == 8000 * MIB
    assert recycle_verdict(d, 48 * MIB, idle=False, settings=SETTINGS) is None
    assert recycle_verdict(d, 48 * MIB, idle=False, settings=SETTINGS, queued=1) is None
    assert recycle_verdict(d, 48 * MIB, idle=False, settings=SETTINGS, queued=2) == "drain"


@pytest.mark.parametrize(
    "bad",
    [
        {"warmup_requests": 0},
        {"room_fraction": 0},
        {"room_fraction": 1.5},
        {"spread_min": 0.5},
        {"drain_timeout_s": 0},
        {"max_points": 2},
    ],
)
def test_bad_leak_settings_are_refused(bad: dict[str, float]) -> None:
    with pytest.raises(ConfigError, match="leak settings"):
        LeakSettings(**bad)  # type: ignore[arg-type]


# ---------------------------------------------------------------- the governor acting


def engine_status(root: Path, pid: int, anon_mib: int) -> None:
    proc = root / "proc" / str(pid)
    proc.mkdir(parents=True, exist_ok=True)
    (proc / "status").write_text(f"RssAnon:\t{anon_mib * 1024} kB\nVmSwap:\t0 kB\n")


def test_the_governor_recycles_a_leaking_engine_with_its_evidence(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A real /proc tree whose engine status grows 1 MiB per request: once the drift
    reaches the bound (half the room below shed) the governor asks the engine to recycle,
    keeps the evidence and logs it; the front is read too, and a fresh pid starts over."""
    root = host(tmp_path / "host")
    engine_status(root, os.getpid(), 60)  # the front (this process's pid in the tree)
    clock = Clock()
    engine = RecordingEngine()
    engine.recycled_pid = 4243
    config = replace(CONFIG, leaks=LeakSettings(warmup_requests=4, min_bound_bytes=0))
    gov = Governor(MemorySignal(root, clock=clock), config, 2048, engine=engine, root=root,
                   clock=clock)  # fmt: skip
    caplog.set_level(logging.INFO, logger="slmguard.governor")
    for requests in range(400):
        leaked = max(0, requests - 4)
        engine_status(root, 4242, 100 + leaked)
        # The cgroup holds 700 MiB of 1000 and the leak: shed (850) is 150 MiB away.
        (root / CG / "memory.current").write_text(f"{(700 + leaked) * MIB}\n")
        engine.view = EngineView(4242, requests, idle=False)
        clock.now += 1.0
        gov.tick()
        if not gov._actions.empty():
            break
    action = gov._actions.get_nowait()
    assert type(action).__name__ == "RecycleEngine" and action.verdict == "drain"
    # Recycled at half the room below shed (75 MiB of drift), before the level moved.
    d = gov.recycling.engine_drift
    assert d is not None and gov.recycling.bound_bytes == 75 * MIB
    assert 75 * MIB <= d.drift_bytes < 80 * MIB and gov.state.level.label == "normal"
    asyncio.run(gov.execute(action))
    assert engine.calls[-1][0] == "recycle" and "drifted" in str(engine.calls[-1][1])
    status = gov.status()["leaks"]
    record = status["recycles"][0]
    assert (record["pid_before"], record["pid_after"], record["verdict"]) == (4242, 4243, "drain")
    assert record["drift_bytes"] == d.drift_bytes and record["per_1000_requests_bytes"] > 0
    assert (record["queued"], record["drain_growth_bytes"]) == (0, 0)  # nothing was queued
    assert gov.summary()["recycle"]["count"] == 1 and status["front"] is not None
    assert any(r.getMessage().startswith("governor.recycle {") for r in caplog.records)
    # The fresh engine starts a track of its own: nothing to judge until its warmup.
    engine_status(root, 4243, 100)
    clock.now += 1.0
    gov.tick()
    assert gov._actions.empty() and gov.recycling.engine_track.pid == 4243


def test_a_drain_that_does_not_finish_postpones_and_retries_later(tmp_path: Path) -> None:
    root = host(tmp_path / "host")
    set_pct(root, 30)
    clock = Clock()
    engine = RecordingEngine()

    async def postponed(reason: str, drain_timeout_s: float) -> object:
        from slmguard.governor.leaks import RecycleOutcome

        return RecycleOutcome(4242, 4242, drain_timeout_s, 0.0, postponed=True)

    engine.recycle = postponed  # type: ignore[method-assign,assignment]
    gov = Governor(MemorySignal(root, clock=clock), CONFIG, 2048, engine=engine, root=root,
                   clock=clock)  # fmt: skip
    gov.recycling.pending = True
    asyncio.run(gov.recycling.run(engine, "drain"))
    assert (gov.recycling.count, gov.recycling.postponed, gov.recycling.pending) == (0, 1, False)
    assert gov.recycling.not_before_s == clock.now + gov.config.leaks.retry_s
