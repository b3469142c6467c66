"""Doctor checks on kernel settings: sysctl, the cgroup hierarchy and PSI.

Owns ``vm.swappiness``, ``vm.overcommit`` (mode, ratio and whether strict
overcommit still admits the plan's commit charge), ``cgroup.v2-memory`` and
``psi.memory``. Without a plan, sysctl values are compared with the plan
defaults (swappiness 0, overcommit 2 / 80). Fixes persist a value in
``/etc/sysctl.d/99-slmguard.conf``. Pure: reads only the snapshot.
"""

from __future__ import annotations

import math

from slmguard.doctor.findings import CheckId, Evidence, Finding, mib
from slmguard.host import procfs
from slmguard.host.snapshot import HostSnapshot, Unread
from slmguard.plan.schema import KernelSettings, Plan

SYSCTL_FILE = "/etc/sysctl.d/99-slmguard.conf"


def _kernel(plan: Plan | None) -> KernelSettings:
    return plan.kernel if plan else KernelSettings()


def _persist(line: str) -> str:
    key, _, value = line.partition(" = ")
    return f"sysctl -w {key}={value} && echo '{line}' >> {SYSCTL_FILE}"


def check_swappiness(s: HostSnapshot, plan: Plan | None) -> Finding:
    check = CheckId("vm.swappiness", "vm.swappiness as planned")
    want = _kernel(plan).swappiness
    value = s.sysctl.get("vm.swappiness")
    if value is None or isinstance(value, Unread):
        return check.unread(value or Unread("vm.swappiness", "not read"))
    ev = (Evidence("vm.swappiness", str(value), str(s.root / "proc/sys/vm/swappiness")),)
    if value == want:
        return check.passed(f"vm.swappiness is {value}", ev)
    return check.warn(
        f"vm.swappiness is {value}, planned {want}: if swap comes back, the kernel will use it",
        ev,
        _persist(f"vm.swappiness = {want}"),
    )


def _needed_ratio(mem: procfs.MemInfo, charge: int, held: int) -> int | None:
    """overcommit_ratio that makes CommitLimit cover Committed_AS - held + charge
    (``held``: what the running service commits now, given back at its restart)."""
    if mem.committed_as_bytes is None:
        return None
    swap = mem.swap_total_bytes or 0
    need = mem.committed_as_bytes - held + charge - swap
    return max(0, math.ceil(need * 100 / mem.mem_total_bytes))


def _overcommit_evidence(
    s: HostSnapshot, mode: int, headroom: int | None, charge: int
) -> list[Evidence]:
    """The overcommit sysctls, the commit headroom and the planned charge, with their files."""
    vm = s.root / "proc/sys/vm"
    ev = [Evidence("vm.overcommit_memory", str(mode), str(vm / "overcommit_memory"))]
    ratio = s.sysctl.get("vm.overcommit_ratio")
    if isinstance(ratio, int):
        ev.append(Evidence("vm.overcommit_ratio", str(ratio), str(vm / "overcommit_ratio")))
    mem = s.meminfo if isinstance(s.meminfo, procfs.MemInfo) else None
    if mem and headroom is not None:
        ev.append(
            Evidence(
                "CommitLimit - Committed_AS",
                f"{mib(mem.commit_limit_bytes)} - {mib(mem.committed_as_bytes)} = {mib(headroom)}",
                str(s.root / "proc/meminfo"),
            )
        )
    if charge:
        ev.append(Evidence("planned commit charge", mib(charge), "plan.kernel.commit_charge_bytes"))
    svc = s.service_commit
    if svc is not None:
        ev.append(
            Evidence(
                f"committed by the running {svc.unit} ({svc.processes} processes)",
                mib(svc.committed_bytes),
                str(svc.cgroup_dir / "cgroup.procs"),
            )
        )
    kbytes = s.sysctl.get("vm.overcommit_kbytes")
    if mode == 2 and isinstance(kbytes, int) and kbytes > 0:
        ev.append(Evidence("vm.overcommit_kbytes", str(kbytes), str(vm / "overcommit_kbytes")))
    return ev


def _strict_commit_failure(
    s: HostSnapshot,
    check: CheckId,
    ev: list[Evidence],
    mem: procfs.MemInfo,
    headroom: int,
    charge: int,
) -> Finding:
    """Mode 2 with less commit headroom than the plan commits: the load fails with ENOMEM."""
    held = s.service_commit.committed_bytes if s.service_commit else 0
    needed = _needed_ratio(mem, charge, held)
    if needed is not None and needed <= 100:
        fix = _persist(f"vm.overcommit_ratio = {needed}")
    else:
        fix = "free committed memory (stop other services) or use a smaller plan"
    return check.fail(
        f"mode 2 (strict): only {mib(headroom)} can still be committed"
        f"{' (counting what the running service holds)' if held else ''}, the plan "
        f"commits {mib(charge)}; model load will fail with ENOMEM",
        ev,
        fix,
    )


def check_overcommit(s: HostSnapshot, plan: Plan | None) -> Finding:
    check = CheckId("vm.overcommit", "Overcommit admits the planned allocation")
    k = _kernel(plan)
    mode = s.sysctl.get("vm.overcommit_memory")
    ratio = s.sysctl.get("vm.overcommit_ratio")
    if mode is None or isinstance(mode, Unread):
        return check.unread(mode or Unread("vm.overcommit_memory", "not read"))
    mem = s.meminfo if isinstance(s.meminfo, procfs.MemInfo) else None
    headroom = mem.commit_headroom_bytes if mem else None
    charge = plan.kernel.commit_charge_bytes if plan else 0
    ev = _overcommit_evidence(s, mode, headroom, charge)
    if headroom is not None and s.service_commit is not None:
        # The running service's charge is in Committed_AS already, and a restart on
        # the plan gives it back before charging the plan's: count it as headroom.
        headroom += s.service_commit.committed_bytes
    if mode == 2 and charge and headroom is not None and mem is not None and headroom < charge:
        return _strict_commit_failure(s, check, ev, mem, headroom, charge)
    if mode != k.overcommit_memory:
        fix = _persist(f"vm.overcommit_memory = {k.overcommit_memory}")
        if k.overcommit_memory == 2:
            fix += " && " + _persist(f"vm.overcommit_ratio = {k.overcommit_ratio}")
        return check.warn(f"vm.overcommit_memory is {mode}, planned {k.overcommit_memory}", ev, fix)
    if mode == 2 and isinstance(ratio, int) and ratio != k.overcommit_ratio:
        return check.warn(
            f"vm.overcommit_ratio is {ratio}, planned {k.overcommit_ratio}",
            ev,
            _persist(f"vm.overcommit_ratio = {k.overcommit_ratio}"),
        )
    if mode == 2 and charge and headroom is None:
        return check.unknown("mode 2 but CommitLimit/Committed_AS unreadable", ev)
    what = f"mode {mode}" + (f", {mib(headroom)} commit headroom" if mode == 2 and headroom else "")
    return check.passed(what, ev)


# ---------------------------------------------------------------- cgroups


V1_LOSSES = (
    "MemoryHigh= (throttle before the hard limit) is ignored on v1",
    "no per-cgroup memory.pressure (PSI) or memory.events",
    "MemorySwapMax= and memory.oom.group are v2 only",
)


def check_cgroup(s: HostSnapshot, plan: Plan | None) -> Finding:
    check = CheckId("cgroup.v2-memory", "cgroup v2 with the memory controller")
    if isinstance(s.cgroup_layout, Unread):
        return check.unread(s.cgroup_layout)
    lay = s.cgroup_layout
    src = str(s.root / "proc/self/mountinfo")
    ev = (
        Evidence("layout", lay.mode, src),
        Evidence(
            "v2 controllers",
            " ".join(lay.v2_controllers) or "(none)",
            f"{lay.v2_mount}/cgroup.controllers" if lay.v2_mount else "no cgroup2 mount",
        ),
        Evidence("v1 controllers", " ".join(lay.v1_controllers) or "(none)", src),
    )
    if lay.memory_version == 2:
        return check.passed("memory controller on cgroup v2", ev)
    fix = (
        "add `systemd.unified_cgroup_hierarchy=1 cgroup_no_v1=all` to the kernel arguments "
        "(boot file), then reboot"
    )
    if lay.memory_version == 1:
        return check.warn(
            "memory controller on cgroup v1: MemoryMax= works, but " + "; ".join(V1_LOSSES),
            ev,
            fix,
        )
    return check.fail(
        "no memory cgroup controller: MemoryHigh=/MemoryMax= have no effect",
        ev,
        "add `cgroup_enable=memory` (Raspberry Pi: in /boot/firmware/cmdline.txt) and " + fix,
    )


def check_psi(s: HostSnapshot, plan: Plan | None) -> Finding:
    check = CheckId("psi.memory", "Memory pressure (PSI) available")
    if isinstance(s.pressure, Unread):
        return check.warn(
            f"no PSI ({s.pressure.reason}): the governor and watch lose their pressure signal",
            (Evidence("/proc/pressure/memory", s.pressure.reason, s.pressure.path),),
            "add `psi=1` to the kernel arguments (CONFIG_PSI_DEFAULT_DISABLED kernels)",
        )
    p = s.pressure
    return check.passed(
        f"some avg10 {p.some_avg10_pct:.2f}%, full avg10 {p.full_avg10_pct or 0:.2f}%",
        (
            Evidence(
                "memory pressure",
                f"some avg60 {p.some_avg60_pct:.2f}%",
                str(s.root / "proc/pressure/memory"),
            ),
        ),
    )
