"""The plan's memory limits and the lines a planned peak must stay under.

Owns the inference zone (RAM less the OS, business and NPU/GPU reserves), MemoryMax and
MemoryHigh within it, the recovery line (``recover_pct`` of MemoryHigh plus the device
bytes outside the cgroup) and the ``vm.overcommit_ratio`` that puts a commit charge at the
recovery line of CommitLimit. The planner sets them; serve's re-budget holds a plan's engine
settings against the same lines. Pure arithmetic on a board profile and watermarks.
"""

from __future__ import annotations

import math

from slmguard.plan.boards import BoardProfile
from slmguard.plan.schema import Watermarks

MiB = 1 << 20
MAX_OVERCOMMIT_RATIO = 100


def zone_bytes(board: BoardProfile) -> int:
    """RAM left for the inference service after the reserves beside it."""
    return (
        board.ram_bytes
        - board.os_reserve_bytes
        - board.business_reserve_bytes
        - board.npu_reserve_bytes
    )


def memory_limits(board: BoardProfile, device_outside: int = 0) -> tuple[int, int]:
    """(MemoryHigh, MemoryMax) in bytes for the board's inference zone, less the
    ``device_outside`` bytes the GPU driver holds outside the cgroup."""
    memory_max = (zone_bytes(board) - device_outside) // MiB * MiB
    gap = max(64 * MiB, math.ceil(memory_max / 20 / MiB) * MiB)
    return max(memory_max - gap, MiB), memory_max


def recovery_line(memory_high_bytes: int, device_bytes: int, marks: Watermarks) -> int:
    """Where a planned peak must stay: ``recover_pct`` of MemoryHigh plus the device bytes
    outside the cgroup (the governor counts them with it)."""
    return int((memory_high_bytes + device_bytes) * marks.recover_pct / 100)


def commit_headroom(marks: Watermarks) -> float:
    """The headroom over a commit charge that puts it at ``recover_pct`` of CommitLimit (25 %
    at 80): under mode 2 the governor counts Committed_AS / CommitLimit as pressure, so a
    commit that reaches the plan must not already be past the shed line."""
    return 100 / marks.recover_pct - 1


def commit_line(commit_limit_bytes: int, marks: Watermarks) -> int:
    """Where a planned commit charge must stay: ``recover_pct`` of the CommitLimit."""
    return int(commit_limit_bytes * marks.recover_pct / 100)


def commit_ratio(commit_bytes: int, ram_bytes: int, marks: Watermarks) -> int:
    """The ``vm.overcommit_ratio`` (no swap) that puts ``commit_bytes`` at the commit line."""
    return math.ceil(commit_bytes * 100 * 100 / (ram_bytes * marks.recover_pct))
