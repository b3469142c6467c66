"""The board's tuning against a plan: each setting a run's speed depends on, judged.

Pure checks on one :class:`~slmguard.host.boardstate.BoardState` and a
:class:`~slmguard.tuning.notes.Target` (the cores the service runs on, the plan's
threads and zones, whether it uses the NPU or the GPU), each returning a
:class:`~slmguard.tuning.notes.Note` with its evidence and its fix. Below the doctor
(which wraps each note as a finding) and ``top`` (which shows them), neither of which
may import the other; the bench records the state they judge. Modules:

    notes     the note model, the target, formatting
    cpu       tuning.cpufreq (the service's cores' clocks), tuning.affinity (big cores)
    devfreq   tuning.ddr (the DDR controller's devfreq), tuning.accel (NPU, GPU)
    power     tuning.power_mode (Jetson nvpmodel), tuning.pi_throttle (Pi firmware)
    heat      tuning.thermal (the watched zones, their trips and temperature)

Reads nothing: :func:`slmguard.host.boardstate.read_board_state` does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from slmguard.host.boardstate import BoardState
from slmguard.plan.schema import Plan
from slmguard.tuning.cpu import check_affinity, check_cpufreq
from slmguard.tuning.devfreq import check_accel, check_ddr
from slmguard.tuning.heat import check_thermal
from slmguard.tuning.notes import FAIL, PASS, UNKNOWN, WARN, Evidence, Note, Target
from slmguard.tuning.power import check_pi_throttle, check_power_mode

__all__ = [
    "CHECKS",
    "FAIL",
    "PASS",
    "UNKNOWN",
    "WARN",
    "Evidence",
    "Note",
    "Target",
    "TuningCheck",
    "assess",
    "target_for",
]

TuningCheck = Callable[[BoardState, Target], Note]

CHECKS: tuple[TuningCheck, ...] = (
    check_cpufreq,
    check_affinity,
    check_ddr,
    check_accel,
    check_power_mode,
    check_pi_throttle,
    check_thermal,
)


def target_for(
    state: BoardState,
    plan: Plan | None,
    pinned: Iterable[int] | None = None,
    pinned_from: str = "",
) -> Target:
    """What to check the board for: the cores ``pinned`` (a CPUAffinity=, the engine's
    affinity; named by ``pinned_from``), else the plan's ``cpu_affinity``, else every online
    core; the plan's threads, zones, NPU and GPU use."""
    cpus: tuple[int, ...] = ()
    cpus_from = "every online core"
    if pinned is not None:
        # As given, online or not: a core the service is meant to run on that is offline
        # (a Jetson power mode's) is itself a finding.
        cpus, cpus_from = tuple(sorted(set(pinned))), pinned_from or "pinned"
    if not cpus and plan is not None and plan.cpu_affinity:
        cpus, cpus_from = tuple(sorted(plan.cpu_affinity)), "the plan's cpu_affinity"
    if not cpus:
        cpus, cpus_from = tuple(sorted(state.online)), "every online core"
    if plan is None:
        return Target(cpus=cpus, cpus_from=cpus_from)
    return Target(
        cpus=cpus,
        cpus_from=cpus_from,
        threads=plan.engine.n_threads,
        zones=tuple(plan.board.thermal_zones),
        npu=plan.board.npu_reserve_bytes > 0,
        gpu=plan.engine.n_gpu_layers > 0,
    )


def assess(
    state: BoardState, target: Target, checks: Iterable[TuningCheck] = CHECKS
) -> tuple[Note, ...]:
    """Every check on one state. Pure: the same state and target, the same notes."""
    return tuple(check(state, target) for check in checks)
