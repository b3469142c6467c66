"""The governor counts the engine's device memory that its cgroup does not see.

On a Jetson (nvmap) or a vendor-kernel RK3588 (Mali kbase) the GPU's buffers come out
of the same DRAM but are charged to no cgroup; the plan gives them
``limits.device_bytes``. Pure policy first (a snapshot whose "used" includes them), then
the signal and the governor's loop over the captured Orin Nano tree (its
``NvMapMemUsed`` and debugfs nvmap clients: the engine, pid 4242, holds 742,400 KiB)
with a cgroup v2 tree beside it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gputrees import engine_process
from hostboards import copy_board
from hosttree import build_tree
from slmguard.governor.policy import Level, PolicyState, admit, decide
from slmguard.governor.runtime import Governor
from slmguard.governor.signal import MemorySignal, MemorySnapshot, sample_interval_s
from slmguard.host import devmem
from test_governor_policy import DEG, MODEL, TH
from test_governor_runtime import CONFIG, Clock, RecordingEngine, req

MIB = 1 << 20
KIB = 1 << 10
ENGINE_PID = 4242
NVMAP_ENGINE = 742400 * KIB  # the engine's row of the captured nvmap clients
NVMAP_SYSTEM = 934912 * KIB  # NvMapMemUsed of the captured meminfo
CGROUP_LIMIT = 1000 * MIB  # memory.max of the service
ALLOWANCE = 800 * MIB  # the plan's limits.device_bytes
CG = "sys/fs/cgroup/slmguard.service"


def snapshot(working_set: int, device: int, limit: int) -> MemorySnapshot:
    return MemorySnapshot(
        0.0, "cgroup2", working_set, limit, "memory.max", psi_some_avg10_pct=0.0,
        device_bytes=device, device_source="devmem",
    )  # fmt: skip


def test_policy_sheds_on_the_cgroup_and_the_device_together() -> None:
    """82% of the cgroup side alone is normal; with the device memory it is 86%: shed."""
    limit = 1_000_000
    alone = snapshot(820_000, 0, limit)
    both = snapshot(820_000, 40_000, limit)
    assert (alone.used_pct, both.used_pct, both.used_bytes) == (82.0, 86.0, 860_000)
    st = PolicyState.initial(2048)
    assert decide(st, alone, 0.0, TH, DEG, MODEL).state.level is Level.NORMAL
    shed = decide(st, both, 0.0, TH, DEG, MODEL).state
    assert shed.level is Level.SHED
    # A request whose projected growth crosses the shed line counts the device too.
    calm = decide(st, snapshot(700_000, 0, limit), 0.0, TH, DEG, MODEL).state
    ok = admit(state=calm, snap=snapshot(700_000, 0, limit), th=TH, extra_bytes=100_000)
    assert ok.status == 200
    refused = admit(state=calm, snap=snapshot(700_000, 100_000, limit), th=TH, extra_bytes=100_000)
    assert (refused.status, refused.code) == (503, "memory_projection")
    # The sampler looks sooner when the device brings the next line nearer.
    big = 4096 * MIB  # a 4 GiB limit: 50% alone, 80% with the device
    near, far = snapshot(big // 2, big * 3 // 10, big), snapshot(big // 2, 0, big)
    assert sample_interval_s(near, (85, 92, 97)) < sample_interval_s(far, (85, 92, 97))


def orin(tmp_path: Path, working_set: int, *, nvmap_clients: bool = True) -> Path:
    """The captured Orin Nano, a cgroup v2 service at ``working_set``, the engine's fds."""
    root = copy_board("jetson-orin-nano-devkit", tmp_path / "host")
    build_tree(root, {
        f"{CG}/memory.current": f"{working_set}\n",
        f"{CG}/memory.high": "max\n",
        f"{CG}/memory.max": f"{CGROUP_LIMIT}\n",
        f"{CG}/memory.stat": "anon 0\ninactive_file 0\n",
        f"{CG}/memory.events": "oom_kill 0\n",
        **engine_process(ENGINE_PID, "pos:\t0\n"),
    })  # fmt: skip
    if not nvmap_clients:
        (root / devmem.NVMAP_CLIENTS).unlink()
    return root


def signal(root: Path, *, allowance: int = ALLOWANCE, pid: int | None = ENGINE_PID) -> MemorySignal:
    return MemorySignal(root, cgroup_dir=root / CG, device_bytes=allowance, device_pid=lambda: pid)


def test_the_signal_adds_the_engines_nvmap_and_its_allowance(tmp_path: Path) -> None:
    ws = 820 * MIB
    snap = signal(orin(tmp_path, ws)).sample()
    assert (snap.device_bytes, snap.device_source) == (NVMAP_ENGINE, "devmem")
    assert (snap.limit_bytes, snap.limit_source) == (CGROUP_LIMIT + ALLOWANCE, "memory.max")
    assert snap.used_bytes == ws + NVMAP_ENGINE
    assert snap.used_pct == pytest.approx(100 * (ws + NVMAP_ENGINE) / (CGROUP_LIMIT + ALLOWANCE))
    assert snap.as_dict()["device_bytes"] == NVMAP_ENGINE
    assert snap.as_dict()["used_bytes"] == ws + NVMAP_ENGINE


def test_without_an_allowance_or_an_engine_nothing_is_added(tmp_path: Path) -> None:
    root = orin(tmp_path, 820 * MIB)
    for sig in (signal(root, allowance=0), signal(root, pid=None), signal(root, pid=99)):
        snap = sig.sample()
        assert (snap.device_bytes, snap.device_source) == (0, None)
        assert snap.limit_bytes == CGROUP_LIMIT  # the cgroup's own limit, not raised
        assert snap.used_pct == pytest.approx(82.0)


def test_unreadable_debugfs_counts_every_nvmap_client_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """debugfs is root's: without the per-process rows, NvMapMemUsed (all clients)."""
    root = orin(tmp_path, 820 * MIB, nvmap_clients=False)
    (root / devmem.NVMAP_CLIENTS).mkdir()  # a read error, as a permission error gives
    sig = signal(root)
    snap = sig.sample()
    assert (snap.device_bytes, snap.device_source) == (NVMAP_SYSTEM, "NvMapMemUsed")
    sig.sample()
    problems = [r for r in caplog.records if r.getMessage().startswith("device memory:")]
    assert len(problems) == 1 and "nvmap" in problems[0].getMessage()  # once, not per sample


def test_the_governor_sheds_before_cgroup_plus_device_pass_85_pct(tmp_path: Path) -> None:
    """The cgroup side at 82% of its own limit would be normal; with the engine's nvmap
    (outside the cgroup) the board's DRAM in use is 85.8% of cgroup + allowance: shed."""
    root = orin(tmp_path, 820 * MIB)
    clock = Clock()
    engine = RecordingEngine()
    gov = Governor(signal(root), CONFIG, 2048, engine=engine, root=root, clock=clock)
    gov.tick()
    assert gov.state.level is Level.SHED
    verdict = gov.admit(req(None, 16))
    assert verdict is not None and getattr(verdict, "code", None) == "memory_shedding"
    status = gov.status()
    assert status["device_allowance_bytes"] == ALLOWANCE
    assert (status["signal"]["device_bytes"], status["signal"]["device_source"]) == (
        NVMAP_ENGINE, "devmem")  # fmt: skip
    blind = Governor(signal(root, allowance=0), CONFIG, 2048, engine=engine, root=root, clock=clock)
    blind.tick()
    assert blind.status()["device_allowance_bytes"] == 0
    assert blind.status()["signal"]["device_source"] is None
    assert blind.state.level is Level.NORMAL and blind.admit(req(None, 16)) is None
    assert engine.calls == []  # shedding does not touch the engine
