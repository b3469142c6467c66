"""host.psi: PSI text from the kernel docs, captured files, malformed input, live."""

from __future__ import annotations

from pathlib import Path

import pytest

from cgrouptrees import DIRS, TREES
from hosttree import build_tree, copy_captured
from slmguard.errors import HostReadError
from slmguard.host.psi import PROC_PRESSURE_MEMORY, Pressure, parse_pressure, read_pressure


def test_parse_both_lines() -> None:
    p = parse_pressure(
        "some avg10=0.22 avg60=0.17 avg300=1.11 total=58761459\n"
        "full avg10=0.23 avg60=0.16 avg300=1.08 total=58464525\n"
    )
    assert p == Pressure(0.22, 0.17, 1.11, 58761459, 0.23, 0.16, 1.08, 58464525)


def test_parse_some_only() -> None:
    # System-wide cpu pressure before Linux 5.13 has no "full" line.
    p = parse_pressure("some avg10=5.00 avg60=1.00 avg300=0.10 total=100\n")
    assert p.some_avg10_pct == 5.0 and p.full_avg10_pct is None and p.full_total_us is None


@pytest.mark.parametrize(
    "text",
    ["", "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n", "some avg10=0.00 avg60=0.0\n"],
)
def test_parse_rejects_incomplete(text: str) -> None:
    with pytest.raises(ValueError):
        parse_pressure(text)


def test_parse_rejects_garbage_number() -> None:
    with pytest.raises(ValueError):
        parse_pressure("some avg10=x avg60=0 avg300=0 total=0\n")


def test_read_captured_this_machine(tmp_path: Path) -> None:
    root = copy_captured("thismachine", tmp_path)
    p = read_pressure(root / PROC_PRESSURE_MEMORY)
    assert p.some_total_us >= 0 and p.full_total_us is not None
    unified = read_pressure(root / "sys/fs/cgroup/unified/memory.pressure")
    assert unified.full_avg300_pct is not None


def test_read_cgroup_v2_memory_pressure(tmp_path: Path) -> None:
    root = build_tree(tmp_path, TREES[2])
    p = read_pressure(root / DIRS[2] / "memory.pressure")
    assert p.some_avg10_pct == 1.5 and p.full_total_us == 212345


def test_read_missing_and_malformed(tmp_path: Path) -> None:
    with pytest.raises(HostReadError, match="missing"):
        read_pressure(tmp_path / "nope")
    bad = build_tree(tmp_path, {"p": "some avg10=0.0\n"})
    with pytest.raises(HostReadError, match="not PSI text") as err:
        read_pressure(bad / "p")
    assert err.value.path == tmp_path / "p"


def test_read_live() -> None:
    path = Path("/") / PROC_PRESSURE_MEMORY
    if not path.exists():
        pytest.skip("kernel without PSI")
    p = read_pressure(path)
    assert 0.0 <= p.some_avg10_pct <= 100.0
    assert p.some_total_us >= 0
