"""doctor on this machine agrees with free -b, swapon --show and sysctl."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from slmguard.host import procfs
from waiting import scaled

TOOLS = ("free", "swapon", "sysctl")
pytestmark = pytest.mark.skipif(
    any(shutil.which(t) is None for t in TOOLS), reason="needs free, swapon and sysctl (procps)"
)


def _run(*argv: str) -> str:
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=scaled(60), check=True
    ).stdout


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    done = subprocess.run(
        [str(Path(sys.executable).parent / "slmguard"), "doctor", "--json"],
        capture_output=True,
        text=True,
        timeout=scaled(120),
        check=False,
    )
    assert done.returncode in (0, 1, 2), done.stderr
    data: dict[str, Any] = json.loads(done.stdout)
    assert data["exit_code"] == done.returncode
    return data


def _check(report: dict[str, Any], cid: str) -> dict[str, Any]:
    found: dict[str, Any] = next(c for c in report["checks"] if c["id"] == cid)
    return found


def _evidence(check: dict[str, Any], label: str) -> str:
    value: str = next(e["value"] for e in check["evidence"] if e["label"] == label)
    return value


def test_memory_agrees_with_free(report: dict[str, Any]) -> None:
    mem_line = next(line for line in _run("free", "-b").splitlines() if line.startswith("Mem:"))
    swap_line = next(line for line in _run("free", "-b").splitlines() if line.startswith("Swap:"))
    total = int(mem_line.split()[1])
    mem = procfs.read_meminfo(Path("/"))
    assert mem.mem_total_bytes == total
    shown = _evidence(_check(report, "memory.available"), "MemTotal")
    assert shown == f"{total / 1024 / 1024:.0f} MiB"
    swap_total = int(swap_line.split()[1])
    assert (mem.swap_total_bytes or 0) == swap_total


def test_swap_agrees_with_swapon(report: dict[str, Any]) -> None:
    lines = _run("swapon", "--show=NAME", "--noheadings", "--raw").split()
    check = _check(report, "swap.off")
    assert check["severity"] == ("pass" if not lines else "fail")
    if lines:
        assert {e["label"] for e in check["evidence"]} == set(lines)


@pytest.mark.parametrize("name", ["vm.swappiness", "vm.overcommit_memory"])
def test_sysctl_agrees(report: dict[str, Any], name: str) -> None:
    value = _run("sysctl", "-n", name).strip()
    check_id = "vm.swappiness" if name == "vm.swappiness" else "vm.overcommit"
    assert _evidence(_check(report, check_id), name) == value


def test_overcommit_ratio_agrees(report: dict[str, Any]) -> None:
    value = _run("sysctl", "-n", "vm.overcommit_ratio").strip()
    assert _evidence(_check(report, "vm.overcommit"), "vm.overcommit_ratio") == value


def test_reports_what_it_could_not_see(report: dict[str, Any]) -> None:
    assert len(report["checks"]) == sum(report["counts"].values())
    for check in report["checks"]:
        if check["severity"] == "unknown":
            assert check["summary"]
    # This VM has no debugfs DMA-BUF file: it is listed, not fatal.
    if not Path("/sys/kernel/debug/dma_buf/bufinfo").exists():
        assert any("dma_buf" in line for line in report["not_seen"])


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="needs root and setpriv to drop to an unprivileged user",
)
def test_runs_without_root_and_says_what_it_could_not_see(report: dict[str, Any]) -> None:
    done = subprocess.run(
        [
            "setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
            str(Path(sys.executable).parent / "slmguard"), "doctor", "--json",
        ],
        capture_output=True, text=True, timeout=scaled(120), check=False, cwd="/",
    )  # fmt: skip
    if done.returncode == 126 or "Permission denied" in done.stderr:
        pytest.skip(f"the venv is not usable by nobody: {done.stderr.strip()[:200]}")
    data = json.loads(done.stdout)
    assert done.returncode == data["exit_code"] in (0, 1, 2)
    assert data["euid"] == 65534
    assert any(line.startswith("not root:") for line in data["not_seen"])
    # The unprivileged run sees the same swap and sysctl facts as root.
    for cid in ("swap.off", "vm.swappiness", "vm.overcommit"):
        assert _check(data, cid)["severity"] == _check(report, cid)["severity"]
