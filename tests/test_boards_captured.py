"""`--board auto`, doctor and plan on board trees captured from real boards.

The trees in ``tests/fixtures/boards/`` hold what the kernel shows on a Radxa
ROCK 5B (RK3588, Rockchip BSP kernel), a Jetson Orin Nano developer kit
(JetPack 6), a Raspberry Pi 5 and a Raspberry Pi 4 in 64-bit mode (the generic
path: no known device tree, no dot product); their sources are in the README
beside them. Each test copies a tree under ``tmp_path`` and runs the real
readers and the real CLI on it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hostboards import BOARD_FIXTURES, copy_board
from slmguard.cli import main
from slmguard.host.cpu import read_cpu_facts
from slmguard.plan.boards import detect_board, isa_from_cpuinfo

ALL6 = (0, 1, 2, 3, 4, 5)
BOARDS = {
    # tree: (profile, isa, online CPUs, big cores by cpu_capacity)
    "rk3588-rock5b": ("rk3588-8g", "arm_dotprod", tuple(range(8)), (4, 5, 6, 7)),
    "jetson-orin-nano-devkit": (
        "jetson-orin-nano-8g",
        "arm_dotprod",
        tuple(range(6)),
        tuple(range(6)),
    ),
    "rpi5": ("rpi5-8g", "arm_dotprod", (0, 1, 2, 3), (0, 1, 2, 3)),
    "rpi4-aarch64": ("generic", "none", (0, 1, 2, 3), (0, 1, 2, 3)),
}


@pytest.fixture(params=sorted(BOARDS))
def board(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, Path]:
    name: str = request.param
    return name, copy_board(name, tmp_path / name)


def test_every_tree_is_tested() -> None:
    assert sorted(p.name for p in BOARD_FIXTURES.iterdir() if p.is_dir()) == sorted(BOARDS)


def test_board_auto(board: tuple[str, Path]) -> None:
    name, root = board
    profile, isa, online, big = BOARDS[name]
    b = detect_board(root)
    assert (b.name, b.isa, b.cpus, b.big_cores) == (profile, isa, online, big)
    assert b.max_threads == len(online)
    assert "big cores by cpu_capacity" in b.detected_from


def test_rk3588_capacity_ranks_the_a76_cluster(tmp_path: Path) -> None:
    cpu = read_cpu_facts(copy_board("rk3588-rock5b", tmp_path))
    assert cpu.capacity == {**dict.fromkeys(range(4), 397), **dict.fromkeys(range(4, 8), 1024)}
    assert cpu.max_freq_khz[0] == 1_800_000 and cpu.max_freq_khz[4] == 2_400_000


def test_affinity_on_the_little_cluster_leaves_no_big_core(tmp_path: Path) -> None:
    root = copy_board("rk3588-rock5b", tmp_path)
    (root / "proc/self/status").write_text("Name:\tslmguard\nCpus_allowed_list:\t0-3\n")
    b = detect_board(root)
    # Pinned to the A55s: the fastest usable cores are those, and 4 threads.
    assert b.big_cores == (0, 1, 2, 3) and b.max_threads == 4


@pytest.mark.parametrize(
    ("features", "isa"),
    [
        (["fp asimd evtstrm crc32 cpuid"], "none"),  # Cortex-A53/A72
        (["fp asimd asimddp"] * 2, "arm_dotprod"),
        (["fp asimd asimddp sve i8mm bf16"], "arm_i8mm"),
        # heterogeneous: only what every core has counts
        (["fp asimd asimddp i8mm", "fp asimd asimddp"], "arm_dotprod"),
        ([], "x86_avx2"),
    ],
)
def test_isa_from_cpuinfo(features: list[str], isa: str) -> None:
    text = "".join(f"processor\t: {i}\nFeatures\t: {f}\n\n" for i, f in enumerate(features))
    assert isa_from_cpuinfo(text) == isa


def test_isa_of_x86_cpuinfo_is_avx2() -> None:
    assert isa_from_cpuinfo("processor\t: 0\nflags\t\t: fpu vme avx2 fma\n") == "x86_avx2"


def _run(argv: list[str]) -> int:
    with pytest.raises(SystemExit) as done:
        main(argv)
    return int(done.value.code or 0)


def _doctor(
    root: Path, capsys: pytest.CaptureFixture[str], *extra: str
) -> tuple[int, dict[str, Any]]:
    code = _run(["doctor", "--root", str(root), "--json", *extra])
    out = json.loads(capsys.readouterr().out)
    return code, {c["id"]: c for c in out["checks"]}


def _plan(root: Path, capsys: pytest.CaptureFixture[str]) -> Path:
    out = root.parent / (root.name + ".plan.json")
    assert _run(["plan", "--root", str(root), "--json", "--out", str(out)]) == 0
    capsys.readouterr()
    return out


DOCTOR = {
    # tree: {check: (severity, substring of its summary)}
    "rk3588-rock5b": {
        "board.model": ("pass", "Radxa ROCK 5B"),
        "cma.size": ("fail", "CMA is 256 MiB; the plan reserves 512 MiB"),
        "npu.devices": ("pass", "/dev/dma_heap/system-uncached-dma32"),
        "swap.off": ("pass", "no swap"),
    },
    "jetson-orin-nano-devkit": {
        "board.model": ("pass", "NVIDIA Jetson Orin Nano Developer Kit"),
        "zram.off": ("fail", "zram is set up"),
        "swap.off": ("fail", "6 swap area(s)"),
        "npu.devices": ("pass", "/dev/nvmap"),
    },
    "rpi5": {
        "board.model": ("pass", "Raspberry Pi 5"),
        "cma.size": ("pass", "CMA 64 MiB"),
        "swap.off": ("fail", "1 swap area(s)"),
        "npu.devices": ("pass", "/dev/dma_heap/linux,cma"),
    },
    "rpi4-aarch64": {
        "board.model": ("pass", "Raspberry Pi 4"),
        "npu.devices": ("pass", "CPU only"),
    },
}


def test_doctor_with_the_plan_made_for_the_board(
    board: tuple[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    name, root = board
    plan = _plan(root, capsys)
    code, checks = _doctor(root, capsys, "--plan", str(plan))
    for check, (severity, text) in DOCTOR[name].items():
        assert checks[check]["severity"] == severity, (check, checks[check])
        assert text in checks[check]["summary"], (check, checks[check]["summary"])
    assert checks["memory.available"]["severity"] == "pass"
    fails = [c for c in checks.values() if c["severity"] == "fail"]
    assert code == (2 if fails else 1)  # 1: stock sysctls warn


def test_rknpu_debugfs_version_is_evidence(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, checks = _doctor(copy_board("rk3588-rock5b", tmp_path), capsys)
    evidence = {e["label"]: e["value"] for e in checks["npu.devices"]["evidence"]}
    assert evidence["rknpu driver"] == "RKNPU driver: v0.9.8"


def test_plan_on_the_rk3588_pins_the_a76_cluster(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = json.loads(_plan(copy_board("rk3588-rock5b", tmp_path / "b"), capsys).read_text())
    assert plan["board"]["name"] == "rk3588-8g"
    assert plan["board"]["big_cores"] == [4, 5, 6, 7]
    assert plan["cpu_affinity"] == [4, 5, 6, 7]
    assert plan["engine"]["n_threads"] == 4


def test_jetson_cma_is_not_judged_against_the_gpu_reserve(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = copy_board("jetson-orin-nano-devkit", tmp_path / "j")
    plan = _plan(root, capsys)
    _, checks = _doctor(root, capsys, "--plan", str(plan))
    assert checks["cma.size"]["severity"] != "fail"
