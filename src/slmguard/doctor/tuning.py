"""Doctor checks on the board's tuning: each :mod:`slmguard.tuning` note as a finding.

Owns the doctor's side of the tuning checks (``tuning.cpufreq``, ``tuning.affinity``,
``tuning.ddr``, ``tuning.accel``, ``tuning.power_mode``, ``tuning.pi_throttle``,
``tuning.thermal``): the target they are judged for (the cores the unit's
``CPUAffinity=`` pins the service to, else the plan's ``cpu_affinity``, else every
online core; the plan's threads, zones, NPU and GPU) and the note turned into a
:class:`~slmguard.doctor.findings.Finding`. The judgement itself is
:mod:`slmguard.tuning`'s, which ``top`` shares. Pure: reads only the snapshot.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from slmguard.doctor.findings import Check, CheckId, Evidence, Finding
from slmguard.host import systemd
from slmguard.host.boardstate import BoardState
from slmguard.host.snapshot import HostSnapshot, Unread
from slmguard.plan.schema import Plan
from slmguard.tuning import TuningCheck, target_for
from slmguard.tuning.cpu import check_affinity, check_cpufreq
from slmguard.tuning.devfreq import check_accel, check_ddr
from slmguard.tuning.heat import check_thermal
from slmguard.tuning.notes import Note
from slmguard.tuning.power import check_pi_throttle, check_power_mode


def _pinned(s: HostSnapshot) -> tuple[tuple[int, ...] | None, str]:
    """The unit's CPUAffinity= as CPUs, and where it was read."""
    if not isinstance(s.unit, systemd.UnitFile):
        return None, ""
    e = s.unit.entry("Service", "CPUAffinity")
    if e is None:
        return None, ""
    try:
        return systemd.parse_cpu_set(e.value), f"CPUAffinity= of {s.unit.name} ({e.where})"
    except ValueError:
        return None, ""


_ROOTED = ("sys/", "proc/", "etc/", "var/", "dev/")


def finding(note: Note, root: Path | None = None) -> Finding:
    """A tuning note as a doctor finding (a finding is a note): the files its evidence
    names, relative to the root, joined to ``root`` as the other findings show them."""
    evidence = tuple(
        Evidence(
            e.label,
            e.value,
            str(root / e.source) if root is not None and e.source.startswith(_ROOTED) else e.source,
        )
        for e in note.evidence
    )
    return replace(note, evidence=evidence)


def _wrap(check: TuningCheck, check_id: str, title: str) -> Check:
    def run(s: HostSnapshot, plan: Plan | None) -> Finding:
        board = s.board
        if isinstance(board, Unread):
            return CheckId(check_id, title).unread(board)
        if not isinstance(board, BoardState):
            return CheckId(check_id, title).unknown("the board's state was not read")
        pinned, where = _pinned(s)
        return finding(check(board, target_for(board, plan, pinned, where)), s.root)

    run.__name__ = f"check_{check_id.replace('.', '_')}"
    run.__doc__ = f"{check_id}: {title} (see :mod:`slmguard.tuning`)."
    return run


TUNING_CHECKS: tuple[Check, ...] = (
    _wrap(check_cpufreq, "tuning.cpufreq", "CPU clocks of the service's cores"),
    _wrap(check_affinity, "tuning.affinity", "The service's cores are the big ones"),
    _wrap(check_ddr, "tuning.ddr", "DDR clock (the memory controller's devfreq)"),
    _wrap(check_accel, "tuning.accel", "NPU and GPU clocks (devfreq)"),
    _wrap(check_power_mode, "tuning.power_mode", "Jetson power mode (nvpmodel)"),
    _wrap(check_pi_throttle, "tuning.pi_throttle", "Raspberry Pi firmware throttle flags"),
    _wrap(check_thermal, "tuning.thermal", "Thermal zones and their trip points"),
)
