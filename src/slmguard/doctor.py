"""The host audit: pure checks on a :class:`~slmguard.host.snapshot.HostSnapshot`.

Owns what "deployable" means. Each check is a function ``(snapshot, plan) ->
Finding`` with an id, a severity (``pass``, ``warn``, ``fail``, ``unknown``),
the evidence (each value with the file it was read from) and the fix (the
exact command or file line). Checks never read files; ``host.snapshot``
collects, ``commands.doctor`` prints. Without a plan, kernel settings are
compared with the plan defaults (swappiness 0, overcommit 2 / 80) and checks
that need the plan's numbers say ``unknown``.

Exit status (``exit_code``): 0 every check passed, 1 a warning, 2 a failure
(``unknown`` does not change it unless ``strict``); 3, could not run, is the
CLI's (bad root, plan or unit argument).
"""

from __future__ import annotations

import contextlib
import ipaddress
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from slmguard.host import cgroup, procfs, systemd
from slmguard.host.snapshot import HostSnapshot, Unread
from slmguard.planfile import KernelSettings, Plan

PASS, WARN, FAIL, UNKNOWN = "pass", "warn", "fail", "unknown"
SEVERITIES = (PASS, UNKNOWN, WARN, FAIL)  # in increasing order of concern

SYSCTL_FILE = "/etc/sysctl.d/99-slmguard.conf"
MIB = 1024 * 1024


@dataclass(frozen=True)
class Evidence:
    """One value a check relied on and where it came from."""

    label: str
    value: str
    source: str


@dataclass(frozen=True)
class Finding:
    id: str
    title: str
    severity: str
    summary: str
    evidence: tuple[Evidence, ...] = ()
    fix: str | None = None


@dataclass(frozen=True)
class Report:
    root: str
    euid: int
    findings: tuple[Finding, ...]
    not_seen: tuple[str, ...] = field(default_factory=tuple)

    def count(self, severity: str) -> int:
        return sum(1 for f in self.findings if f.severity == severity)

    def exit_code(self, strict: bool = False) -> int:
        sev = {f.severity for f in self.findings}
        if FAIL in sev:
            return 2
        if WARN in sev or (strict and UNKNOWN in sev):
            return 1
        return 0


def mib(n: int | None) -> str:
    if n is None:
        return "unlimited"
    if n % MIB == 0 or n >= 100 * MIB:
        return f"{n / MIB:.0f} MiB"
    return f"{n / MIB:.1f} MiB"


def _unknown(fid: str, title: str, unread: Unread, fix: str | None = None) -> Finding:
    return Finding(fid, title, UNKNOWN, f"could not read {unread.path}: {unread.reason}", fix=fix)


def _kernel(plan: Plan | None) -> KernelSettings:
    return plan.kernel if plan else KernelSettings()


def _persist(line: str) -> str:
    key, _, value = line.partition(" = ")
    return f"sysctl -w {key}={value} && echo '{line}' >> {SYSCTL_FILE}"


# ---------------------------------------------------------------- swap and zram


def check_swap_off(s: HostSnapshot, plan: Plan | None) -> Finding:
    fid, title = "swap.off", "No active swap"
    if isinstance(s.swaps, Unread):
        return _unknown(fid, title, s.swaps)
    src = str(s.root / "proc/swaps")
    if not s.swaps:
        return Finding(
            fid, title, PASS, "no swap area is active", (Evidence("swaps", "none", src),)
        )
    ev = tuple(
        Evidence(a.filename, f"{a.kind}, {mib(a.size_bytes)}, {mib(a.used_bytes)} used", src)
        for a in s.swaps
    )
    return Finding(
        fid,
        title,
        FAIL,
        f"{len(s.swaps)} swap area(s) active: under memory pressure the board thrashes "
        "instead of OOM-killing, and flash wears out",
        ev,
        "swapoff -a",
    )


def check_swap_boot(s: HostSnapshot, plan: Plan | None) -> Finding:
    fid, title = "swap.boot", "No swap comes back at boot"
    if isinstance(s.fstab_swaps, Unread):
        return _unknown(fid, title, s.fstab_swaps)
    src = str(s.root / "etc/fstab")
    at_boot = [e for e in s.fstab_swaps if e.at_boot]
    ev = [Evidence(f"fstab line {e.lineno}", e.line.strip(), src) for e in s.fstab_swaps]
    services = s.swapfile_services if isinstance(s.swapfile_services, tuple) else ()
    ev.extend(Evidence(x.name, x.reason, str(x.path)) for x in services)
    enabled = [x for x in services if x.enabled]
    if not at_boot and not enabled:
        return Finding(
            fid, title, PASS, "no fstab swap line or swap-file service at boot", tuple(ev)
        )
    fixes = [f"sed -i '{e.lineno}s/^/# /' /etc/fstab" for e in at_boot]
    fixes += [x.fix for x in enabled]
    what = []
    if at_boot:
        what.append("fstab turns swap back on at every boot (swapon -a, systemd)")
    if enabled:
        what.append(", ".join(x.name for x in enabled) + " creates a swap file at boot")
    return Finding(fid, title, FAIL, "; ".join(what), tuple(ev), " && ".join(fixes))


def check_zram_off(s: HostSnapshot, plan: Plan | None) -> Finding:
    fid, title = "zram.off", "No zram device in use"
    if isinstance(s.zram_devices, Unread):
        return _unknown(fid, title, s.zram_devices)
    active = [d for d in s.zram_devices if d.active]
    ev = tuple(
        Evidence(
            d.name,
            f"disksize {mib(d.disksize_bytes)}"
            + (f", uses {mib(d.mem_used_bytes)} RAM" if d.mem_used_bytes is not None else ""),
            str(s.root / "sys/block" / d.name / "disksize"),
        )
        for d in s.zram_devices
    )
    if not active:
        what = "no zram device" if not s.zram_devices else "zram devices exist but are not set up"
        return Finding(fid, title, PASS, what, ev)
    fix = " && ".join(f"swapoff /dev/{d.name}; echo 1 > /sys/block/{d.name}/reset" for d in active)
    return Finding(
        fid,
        title,
        FAIL,
        "zram is set up: compressing pages under pressure burns the CPU the model needs "
        "and hides the OOM that should restart the service",
        ev,
        fix,
    )


def check_zram_boot(s: HostSnapshot, plan: Plan | None) -> Finding:
    fid, title = "zram.boot", "No service recreates zram at boot"
    if isinstance(s.zram_services, Unread):
        return _unknown(fid, title, s.zram_services)
    ev = tuple(Evidence(x.name, x.reason, str(x.path)) for x in s.zram_services)
    enabled = [x for x in s.zram_services if x.enabled]
    if not enabled:
        what = (
            "zram services are installed but disabled"
            if s.zram_services
            else "no zram service installed"
        )
        return Finding(fid, title, PASS, what, ev)
    return Finding(
        fid,
        title,
        FAIL,
        "zram comes back at the next boot via " + ", ".join(x.name for x in enabled),
        ev,
        " ; ".join(x.fix for x in enabled),
    )


# ---------------------------------------------------------------- sysctl


def check_swappiness(s: HostSnapshot, plan: Plan | None) -> Finding:
    fid, title = "vm.swappiness", "vm.swappiness as planned"
    want = _kernel(plan).swappiness
    value = s.sysctl.get("vm.swappiness")
    if value is None or isinstance(value, Unread):
        return _unknown(fid, title, value or Unread("vm.swappiness", "not read"))
    ev = (Evidence("vm.swappiness", str(value), str(s.root / "proc/sys/vm/swappiness")),)
    if value == want:
        return Finding(fid, title, PASS, f"vm.swappiness is {value}", ev)
    return Finding(
        fid,
        title,
        WARN,
        f"vm.swappiness is {value}, planned {want}: if swap comes back, the kernel will use it",
        ev,
        _persist(f"vm.swappiness = {want}"),
    )


def _needed_ratio(mem: procfs.MemInfo, charge: int) -> int | None:
    """overcommit_ratio that makes CommitLimit cover Committed_AS + charge."""
    if mem.committed_as_bytes is None:
        return None
    swap = mem.swap_total_bytes or 0
    need = mem.committed_as_bytes + charge - swap
    return max(0, math.ceil(need * 100 / mem.mem_total_bytes))


def check_overcommit(s: HostSnapshot, plan: Plan | None) -> Finding:
    fid, title = "vm.overcommit", "Overcommit admits the planned allocation"
    k = _kernel(plan)
    mode = s.sysctl.get("vm.overcommit_memory")
    ratio = s.sysctl.get("vm.overcommit_ratio")
    kbytes = s.sysctl.get("vm.overcommit_kbytes")
    if mode is None or isinstance(mode, Unread):
        return _unknown(fid, title, mode or Unread("vm.overcommit_memory", "not read"))
    vm = s.root / "proc/sys/vm"
    ev: list[Evidence] = [
        Evidence("vm.overcommit_memory", str(mode), str(vm / "overcommit_memory"))
    ]
    if isinstance(ratio, int):
        ev.append(Evidence("vm.overcommit_ratio", str(ratio), str(vm / "overcommit_ratio")))
    mem = s.meminfo if isinstance(s.meminfo, procfs.MemInfo) else None
    headroom = mem.commit_headroom_bytes if mem else None
    if mem and headroom is not None:
        ev.append(
            Evidence(
                "CommitLimit - Committed_AS",
                f"{mib(mem.commit_limit_bytes)} - {mib(mem.committed_as_bytes)} = {mib(headroom)}",
                str(s.root / "proc/meminfo"),
            )
        )
    charge = plan.kernel.commit_charge_bytes if plan else 0
    if charge:
        ev.append(Evidence("planned commit charge", mib(charge), "plan.kernel.commit_charge_bytes"))
    if mode == 2:
        if isinstance(kbytes, int) and kbytes > 0:
            ev.append(Evidence("vm.overcommit_kbytes", str(kbytes), str(vm / "overcommit_kbytes")))
        if charge and headroom is not None and mem is not None and headroom < charge:
            needed = _needed_ratio(mem, charge)
            if needed is not None and needed <= 100:
                fix = _persist(f"vm.overcommit_ratio = {needed}")
            else:
                fix = "free committed memory (stop other services) or use a smaller plan"
            return Finding(
                fid,
                title,
                FAIL,
                f"mode 2 (strict): only {mib(headroom)} can still be committed, the plan "
                f"commits {mib(charge)}; model load will fail with ENOMEM",
                tuple(ev),
                fix,
            )
    if mode != k.overcommit_memory:
        fix = _persist(f"vm.overcommit_memory = {k.overcommit_memory}")
        if k.overcommit_memory == 2:
            fix += " && " + _persist(f"vm.overcommit_ratio = {k.overcommit_ratio}")
        return Finding(
            fid,
            title,
            WARN,
            f"vm.overcommit_memory is {mode}, planned {k.overcommit_memory}",
            tuple(ev),
            fix,
        )
    if mode == 2 and isinstance(ratio, int) and ratio != k.overcommit_ratio:
        return Finding(
            fid,
            title,
            WARN,
            f"vm.overcommit_ratio is {ratio}, planned {k.overcommit_ratio}",
            tuple(ev),
            _persist(f"vm.overcommit_ratio = {k.overcommit_ratio}"),
        )
    if mode == 2 and charge and headroom is None:
        return Finding(
            fid, title, UNKNOWN, "mode 2 but CommitLimit/Committed_AS unreadable", tuple(ev)
        )
    what = f"mode {mode}" + (f", {mib(headroom)} commit headroom" if mode == 2 and headroom else "")
    return Finding(fid, title, PASS, what, tuple(ev))


# ---------------------------------------------------------------- cgroups


V1_LOSSES = (
    "MemoryHigh= (throttle before the hard limit) is ignored on v1",
    "no per-cgroup memory.pressure (PSI) or memory.events",
    "MemorySwapMax= and memory.oom.group are v2 only",
)


def check_cgroup(s: HostSnapshot, plan: Plan | None) -> Finding:
    fid, title = "cgroup.v2-memory", "cgroup v2 with the memory controller"
    if isinstance(s.cgroup_layout, Unread):
        return _unknown(fid, title, s.cgroup_layout)
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
        return Finding(fid, title, PASS, "memory controller on cgroup v2", ev)
    fix = (
        "add `systemd.unified_cgroup_hierarchy=1 cgroup_no_v1=all` to the kernel arguments "
        "(boot file), then reboot"
    )
    if lay.memory_version == 1:
        return Finding(
            fid,
            title,
            WARN,
            "memory controller on cgroup v1: MemoryMax= works, but " + "; ".join(V1_LOSSES),
            ev,
            fix,
        )
    return Finding(
        fid,
        title,
        FAIL,
        "no memory cgroup controller: MemoryHigh=/MemoryMax= have no effect",
        ev,
        "add `cgroup_enable=memory` (Raspberry Pi: in /boot/firmware/cmdline.txt) and " + fix,
    )


# ---------------------------------------------------------------- CMA / NPU


def _boot_cma(s: HostSnapshot) -> tuple[int | None, str | None, str | None]:
    """(cma bytes, boot file path, problem) from the boot file, when there is one."""
    if isinstance(s.boot_args, Unread):
        return None, None, f"{s.boot_args.path}: {s.boot_args.reason}"
    if s.boot_args is None:
        return None, None, None
    path = str(getattr(s.boot_args, "path", "boot file"))
    try:
        value = getattr(s.boot_args, "cma_bytes", None)
    except ValueError as err:
        return None, path, str(err)
    return (value if isinstance(value, int) else None), path, None


def check_cma(s: HostSnapshot, plan: Plan | None) -> Finding:
    fid, title = "cma.size", "CMA pool fits the NPU reserve and the RAM"
    if isinstance(s.meminfo, Unread):
        return _unknown(fid, title, s.meminfo)
    mem = s.meminfo
    ev: list[Evidence] = [
        Evidence(
            "CmaTotal",
            mib(mem.cma_total_bytes)
            if mem.cma_total_bytes is not None
            else "absent (kernel without CONFIG_CMA)",
            str(s.root / "proc/meminfo"),
        ),
    ]
    cmd_cma: int | None = None
    if isinstance(s.cmdline, tuple):
        try:
            cmd_cma = procfs.cma_bytes_from_args(s.cmdline)
        except ValueError as err:
            ev.append(Evidence("cma= on /proc/cmdline", f"unparsable: {err}", "proc/cmdline"))
        ev.append(
            Evidence(
                "cma= on the running kernel",
                mib(cmd_cma) if cmd_cma else "not set",
                str(s.root / "proc/cmdline"),
            )
        )
    boot_cma, boot_path, boot_problem = _boot_cma(s)
    if boot_path or boot_problem:
        ev.append(
            Evidence(
                "cma= in the boot file",
                boot_problem or (mib(boot_cma) if boot_cma else "not set"),
                boot_path or "boot file",
            )
        )
    reserve = plan.board.npu_reserve_bytes if plan else 0
    want = (plan.kernel.cma_bytes if plan else None) or reserve
    boot_file = (plan.board.boot_file if plan else None) or boot_path or "the boot file"
    if want:
        ev.append(Evidence("planned CMA / NPU reserve", mib(want), "plan"))
    size_arg = f"cma={want // MIB}M" if want else ""
    fix_cma = f"add `{size_arg}` to the kernel arguments in {boot_file}, then reboot"
    total = mem.cma_total_bytes
    if want and (total is None or total < want):
        have = "no CMA" if total is None else f"CMA is {mib(total)}"
        return Finding(
            fid,
            title,
            FAIL,
            f"{have}; the plan reserves {mib(want)} for the NPU/GPU: the driver's "
            "contiguous allocations will fail",
            tuple(ev),
            fix_cma,
        )
    if total and total > mem.mem_total_bytes // 2:
        return Finding(
            fid,
            title,
            WARN,
            f"CMA is {mib(total)} of {mib(mem.mem_total_bytes)} RAM: only movable pages may "
            "use it, so unmovable kernel allocations run short",
            tuple(ev),
            fix_cma if want else "lower cma= in the boot file",
        )
    if boot_cma is not None and cmd_cma is not None and boot_cma != cmd_cma:
        return Finding(
            fid,
            title,
            WARN,
            f"boot file sets cma={mib(boot_cma)} but the running kernel has {mib(cmd_cma)}: "
            "reboot pending",
            tuple(ev),
            "reboot",
        )
    if boot_cma is not None and cmd_cma is None and total is not None and boot_cma != total:
        return Finding(
            fid,
            title,
            WARN,
            f"boot file sets cma={mib(boot_cma)}, running kernel has {mib(total)}: reboot "
            "pending (or the boot file is not the one that boots)",
            tuple(ev),
            "reboot",
        )
    what = f"CMA {mib(total)}" if total is not None else "no CMA and none needed"
    return Finding(fid, title, PASS, what, tuple(ev))


def check_accelerators(s: HostSnapshot, plan: Plan | None) -> Finding:
    fid, title = "npu.devices", "NPU/GPU device nodes"
    if isinstance(s.accelerators, Unread):
        return _unknown(fid, title, s.accelerators)
    acc = s.accelerators
    nodes = acc.all_nodes
    ev = [Evidence("nodes", " ".join(nodes) or "none", str(s.root / "dev"))]
    if acc.rknpu_version:
        ev.append(Evidence("rknpu driver", acc.rknpu_version, "/sys/kernel/debug/rknpu/version"))
    elif acc.rknpu_debugfs_problem and acc.rknpu:
        ev.append(Evidence("rknpu debugfs", acc.rknpu_debugfs_problem, "/sys/kernel/debug/rknpu"))
    wanted = plan.board.device_nodes if plan else ()
    present = [n for n in wanted if any(_node_matches(n, x) for x in nodes)]
    missing = [n for n in wanted if n not in present]
    if missing:
        ev.append(Evidence("planned but absent", " ".join(missing), "plan.board.device_nodes"))
    reserve = plan.board.npu_reserve_bytes if plan else 0
    if wanted and not present and reserve:
        return Finding(
            fid,
            title,
            FAIL,
            f"none of the planned device nodes ({' '.join(wanted)}) exists, yet the plan "
            f"reserves {mib(reserve)} for the NPU/GPU",
            tuple(ev),
            "load the NPU/GPU driver (vendor kernel) or re-plan for CPU only",
        )
    return Finding(
        fid, title, PASS, " ".join(nodes) if nodes else "no accelerator nodes (CPU only)", tuple(ev)
    )


def _node_matches(pattern: str, node: str) -> bool:
    """A planned node (a file, a directory such as /dev/dri, or a glob ending in *) is there."""
    if pattern.endswith("*"):
        return node.startswith(pattern[:-1])
    return node == pattern or node.startswith(pattern.rstrip("/") + "/")


def check_dmabuf(s: HostSnapshot, plan: Plan | None) -> Finding:
    fid, title = "dmabuf.total", "DMA-BUF memory outside the cgroup"
    if isinstance(s.dmabuf, Unread):
        return _unknown(fid, title, s.dmabuf, fix="run as root with debugfs mounted")
    d = s.dmabuf
    ev = (Evidence("DMA-BUF", f"{d.count} buffers, {mib(d.total_bytes)}", str(d.source)),)
    reserve = plan.board.npu_reserve_bytes if plan else 0
    if reserve and d.total_bytes > reserve:
        return Finding(
            fid,
            title,
            WARN,
            f"drivers hold {mib(d.total_bytes)} of DMA-BUF, more than the planned "
            f"{mib(reserve)} NPU reserve; no cgroup limit sees it",
            ev,
        )
    return Finding(fid, title, PASS, f"{mib(d.total_bytes)} in {d.count} buffers", ev)


# ---------------------------------------------------------------- memory


def check_free_memory(s: HostSnapshot, plan: Plan | None) -> Finding:
    fid, title = "memory.available", "Available memory covers the plan"
    if isinstance(s.meminfo, Unread):
        return _unknown(fid, title, s.meminfo)
    mem = s.meminfo
    src = str(s.root / "proc/meminfo")
    ev: list[Evidence] = [
        Evidence("MemTotal", mib(mem.mem_total_bytes), src),
        Evidence("MemAvailable", mib(mem.mem_available_bytes), src),
    ]
    if plan is None:
        return Finding(fid, title, UNKNOWN, "no plan to compare with (pass --plan FILE)", tuple(ev))
    if mem.mem_available_bytes is None:
        return Finding(fid, title, UNKNOWN, "no MemAvailable (kernel < 3.14)", tuple(ev))
    lim = plan.limits
    usable = mem.mem_available_bytes
    current = _int_or_none((s.unit_effective or {}).get("MemoryCurrent"))
    if current:
        usable += current
        ev.append(Evidence("service MemoryCurrent", mib(current), "systemctl show"))
    ev.append(
        Evidence(
            "planned MemoryHigh / MemoryMax",
            f"{mib(lim.memory_high_bytes)} / {mib(lim.memory_max_bytes)}",
            "plan",
        )
    )
    if mem.mem_total_bytes < plan.board.ram_bytes * 0.85:
        return Finding(
            fid,
            title,
            FAIL,
            f"this host has {mib(mem.mem_total_bytes)} RAM, the plan is for "
            f"{plan.board.name} with {mib(plan.board.ram_bytes)}",
            tuple(ev),
            "re-plan for this board: slmguard plan --board <this board>",
        )
    if usable >= lim.memory_max_bytes:
        return Finding(fid, title, PASS, f"{mib(usable)} available for the service", tuple(ev))
    sev = WARN if usable >= lim.memory_high_bytes else FAIL
    return Finding(
        fid,
        title,
        sev,
        f"only {mib(usable)} available, the service may grow to {mib(lim.memory_max_bytes)}: "
        "other processes use the rest",
        tuple(ev),
        "stop or limit other services, or re-plan with a smaller context",
    )


def _int_or_none(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:  # "[not set]", "infinity"
        return None


def check_memlock(s: HostSnapshot, plan: Plan | None) -> Finding:
    fid, title = "memlock.weights", "memlock limit covers locked weights"
    if plan is None:
        return Finding(fid, title, UNKNOWN, "no plan: whether weights are locked is unknown")
    if not plan.engine.use_mlock:
        return Finding(fid, title, PASS, "the plan does not lock weights (use_mlock false)")
    need = plan.model.file_bytes
    ev: list[Evidence] = [Evidence("locked weights", mib(need), "plan.model.file_bytes")]
    limit: int | None
    unit = s.unit if isinstance(s.unit, systemd.UnitFile) else None
    fix = f"set LimitMEMLOCK={need // MIB + 64}M in the [Service] section"
    if unit is not None:
        if _runs_as_root(unit):
            ev.append(Evidence("User", unit.get("Service", "User") or "(root)", str(unit.path)))
            return Finding(
                fid,
                title,
                PASS,
                "the service runs as root (CAP_IPC_LOCK ignores the limit)",
                tuple(ev),
            )
        raw = unit.get("Service", "LimitMEMLOCK")
        if raw is None:
            ev.append(Evidence("LimitMEMLOCK", "not set", str(unit.path)))
            return Finding(
                fid,
                title,
                FAIL,
                "the unit sets no LimitMEMLOCK=: the service gets systemd's default "
                "(a few MiB), mlock of the weights fails",
                tuple(ev),
                fix,
            )
        entry = unit.entry("Service", "LimitMEMLOCK")
        where = entry.where if entry else str(unit.path)
        try:
            limit = systemd.parse_size(raw.split(":")[0])
        except ValueError:
            return Finding(fid, title, UNKNOWN, f"LimitMEMLOCK={raw} unparsable", tuple(ev))
        ev.append(Evidence("LimitMEMLOCK", raw, where))
    elif isinstance(s.memlock, Unread):
        return _unknown(fid, title, s.memlock)
    else:
        limit = s.memlock.soft
        ev.append(
            Evidence("RLIMIT_MEMLOCK (this shell)", mib(limit), str(s.root / "proc/self/limits"))
        )
    if limit is None or limit >= need:
        return Finding(fid, title, PASS, f"memlock {mib(limit)} >= {mib(need)}", tuple(ev))
    return Finding(
        fid,
        title,
        FAIL,
        f"memlock limit {mib(limit)} is below the {mib(need)} of weights the plan locks",
        tuple(ev),
        fix,
    )


def check_psi(s: HostSnapshot, plan: Plan | None) -> Finding:
    fid, title = "psi.memory", "Memory pressure (PSI) available"
    if isinstance(s.pressure, Unread):
        return Finding(
            fid,
            title,
            WARN,
            f"no PSI ({s.pressure.reason}): the governor and watch lose their pressure signal",
            (Evidence("/proc/pressure/memory", s.pressure.reason, s.pressure.path),),
            "add `psi=1` to the kernel arguments (CONFIG_PSI_DEFAULT_DISABLED kernels)",
        )
    p = s.pressure
    return Finding(
        fid,
        title,
        PASS,
        f"some avg10 {p.some_avg10_pct:.2f}%, full avg10 {p.full_avg10_pct or 0:.2f}%",
        (
            Evidence(
                "memory pressure",
                f"some avg60 {p.some_avg60_pct:.2f}%",
                str(s.root / "proc/pressure/memory"),
            ),
        ),
    )


def check_board(s: HostSnapshot, plan: Plan | None) -> Finding:
    fid, title = "board.model", "Board identified"
    if isinstance(s.device_tree_model, Unread):
        return _unknown(fid, title, s.device_tree_model)
    src = str(s.root / "proc/device-tree/model")
    if s.device_tree_model is None:
        return Finding(
            fid,
            title,
            UNKNOWN,
            "no /proc/device-tree/model (not a device-tree board)",
            (Evidence("model", "absent", src),),
        )
    ev = (Evidence("model", s.device_tree_model, src),)
    return Finding(fid, title, PASS, s.device_tree_model, ev)


# ---------------------------------------------------------------- the unit


def _unit_or_unknown(s: HostSnapshot, fid: str, title: str) -> systemd.UnitFile | Finding:
    if isinstance(s.unit, Unread):
        return _unknown(fid, title, s.unit)
    if s.unit is None:
        return Finding(
            fid,
            title,
            UNKNOWN,
            "no unit to check: slmguard.service is not installed (pass --unit NAME|FILE)",
        )
    return s.unit


def _ram(s: HostSnapshot) -> int | None:
    return s.meminfo.mem_total_bytes if isinstance(s.meminfo, procfs.MemInfo) else None


def _unit_size(unit: systemd.UnitFile, key: str, ram: int | None) -> tuple[int | None, str] | None:
    raw = unit.get("Service", key)
    if raw is None:
        return None
    try:
        return systemd.parse_size(raw, ram), raw
    except ValueError:
        return None


def check_unit_memory(s: HostSnapshot, plan: Plan | None) -> Finding:
    fid, title = "unit.memory", "MemoryHigh/MemoryMax as planned"
    unit = _unit_or_unknown(s, fid, title)
    if isinstance(unit, Finding):
        return unit
    ram = _ram(s)
    ev: list[Evidence] = []
    for key in ("MemoryHigh", "MemoryMax"):
        e = unit.entry("Service", key)
        ev.append(Evidence(key, e.value if e else "not set", e.where if e else str(unit.path)))
    high = _unit_size(unit, "MemoryHigh", ram)
    maximum = _unit_size(unit, "MemoryMax", ram)
    eff = s.unit_effective or {}
    for key in ("MemoryHigh", "MemoryMax"):
        if key in eff:
            ev.append(Evidence(f"{key} (effective)", eff[key], "systemctl show"))
    lim = plan.limits if plan else None
    if lim:
        ev.append(
            Evidence(
                "planned",
                f"MemoryHigh={lim.memory_high_bytes // MIB}M "
                f"MemoryMax={lim.memory_max_bytes // MIB}M",
                "plan.limits",
            )
        )
    fix_max = (
        f"set MemoryMax={lim.memory_max_bytes // MIB}M in [Service]"
        if lim
        else ("set MemoryMax= in [Service] (slmguard plan prints the value)")
    )
    if maximum is None or maximum[0] is None:
        return Finding(
            fid,
            title,
            FAIL,
            "no MemoryMax=: nothing stops the service from taking the whole board",
            tuple(ev),
            fix_max,
        )
    max_b = maximum[0]
    if ram and max_b >= ram:
        return Finding(
            fid,
            title,
            FAIL,
            f"MemoryMax={maximum[1]} is not below the {mib(ram)} of RAM: no limit at all",
            tuple(ev),
            fix_max,
        )
    if lim and max_b > lim.memory_max_bytes * 1.01:
        return Finding(
            fid,
            title,
            FAIL,
            f"MemoryMax={maximum[1]} exceeds the planned "
            f"{mib(lim.memory_max_bytes)}: the OS reserve is not protected",
            tuple(ev),
            fix_max,
        )
    high_b = high[0] if high else None
    v1 = isinstance(s.cgroup_layout, cgroup.CgroupLayout) and s.cgroup_layout.memory_version == 1
    if v1 and high_b is not None:
        return Finding(
            fid,
            title,
            WARN,
            "MemoryHigh= is ignored on cgroup v1 (this host): only MemoryMax= applies",
            tuple(ev),
            "move the host to cgroup v2 (see cgroup.v2-memory)",
        )
    fix_high = (
        f"set MemoryHigh={lim.memory_high_bytes // MIB}M in [Service]"
        if lim
        else "set MemoryHigh= (about 93% of MemoryMax) in [Service]"
    )
    if high_b is None:
        return Finding(
            fid,
            title,
            WARN,
            "no MemoryHigh=: no throttling before the OOM kill",
            tuple(ev),
            fix_high,
        )
    if high_b >= max_b:
        return Finding(
            fid, title, WARN, "MemoryHigh >= MemoryMax: no throttling zone", tuple(ev), fix_high
        )
    if lim and max_b < lim.memory_max_bytes * 0.99:
        return Finding(
            fid,
            title,
            WARN,
            f"MemoryMax={maximum[1]} is below the planned "
            f"{mib(lim.memory_max_bytes)}: the model may be OOM-killed at load",
            tuple(ev),
            fix_max,
        )
    eff_max = eff.get("MemoryMax")
    if eff_max and eff_max.isdigit() and abs(int(eff_max) - max_b) > MIB:
        return Finding(
            fid,
            title,
            WARN,
            f"systemd runs with MemoryMax={eff_max}, the file "
            "says otherwise: daemon-reload and restart pending",
            tuple(ev),
            f"systemctl daemon-reload && systemctl restart {unit.name}",
        )
    return Finding(
        fid, title, PASS, f"MemoryHigh={high[1] if high else '?'} MemoryMax={maximum[1]}", tuple(ev)
    )


WORKER_OOM_SCORE_ADJ = 1000  # slmguard.serve.worker raises its own score to this


def _is_slmguard_serve(unit: systemd.UnitFile) -> bool:
    execs = unit.values("Service", "ExecStart")
    argv = systemd.exec_argv(execs[-1]) if execs else ()
    return len(argv) >= 2 and Path(argv[0]).name == "slmguard" and argv[1] == "serve"


def check_unit_oom_score(s: HostSnapshot, plan: Plan | None) -> Finding:
    fid, title = "unit.oom-score", "The model process is the OOM victim"
    unit = _unit_or_unknown(s, fid, title)
    if isinstance(unit, Finding):
        return unit
    e = unit.entry("Service", "OOMScoreAdjust")
    ev = [Evidence("OOMScoreAdjust", e.value if e else "not set", e.where if e else str(unit.path))]
    fix = "set OOMScoreAdjust=500 in [Service]"
    if e is not None:
        try:
            value = int(e.value)
        except ValueError:
            return Finding(
                fid, title, FAIL, f"OOMScoreAdjust={e.value} is not an integer", tuple(ev), fix
            )
    else:
        value = 0
    if value > 0:
        return Finding(fid, title, PASS, f"OOMScoreAdjust={value}", tuple(ev))
    if _is_slmguard_serve(unit):
        # The front may start low; its engine worker raises itself to 1000 (raising
        # needs no privilege), so the process holding the model dies first and the
        # front survives to restart it (with OOMPolicy=continue).
        policy = unit.get("Service", "OOMPolicy") or "stop"
        ev.append(
            Evidence(
                "engine worker oom_score_adj", str(WORKER_OOM_SCORE_ADJ), "slmguard.serve.worker"
            )
        )
        ev.append(Evidence("OOMPolicy", policy, str(unit.path)))
        if policy == "continue":
            return Finding(
                fid,
                title,
                PASS,
                f"front at {value}, engine worker at "
                f"{WORKER_OOM_SCORE_ADJ}: the worker is the victim",
                tuple(ev),
            )
        return Finding(
            fid,
            title,
            WARN,
            f"OOMPolicy={policy}: when the worker is OOM-killed "
            "systemd stops the whole unit instead of letting the front restart it",
            tuple(ev),
            "set OOMPolicy=continue in [Service]",
        )
    if e is None:
        return Finding(
            fid,
            title,
            WARN,
            "OOMScoreAdjust not set: under global pressure the "
            "kernel may kill sshd or the monitor first",
            tuple(ev),
            fix,
        )
    return Finding(
        fid,
        title,
        WARN,
        f"OOMScoreAdjust={value} protects the service instead of the shell and core daemons",
        tuple(ev),
        fix,
    )


def check_unit_sections(s: HostSnapshot, plan: Plan | None) -> Finding:
    fid, title = "unit.sections", "Every unit key in the section systemd reads it from"
    unit = _unit_or_unknown(s, fid, title)
    if isinstance(unit, Finding):
        return unit
    wrong = systemd.misplaced_keys(unit)
    if not wrong:
        return Finding(
            fid,
            title,
            PASS,
            "no key in the wrong section",
            (Evidence("unit", str(unit.path), str(unit.path)),),
        )
    ev = tuple(
        Evidence(
            f"{m.entry.key} in [{m.entry.section}]",
            "IGNORED by systemd" if m.ignored else "accepted for compatibility only",
            m.entry.where,
        )
        for m in wrong
    )
    fix = "; ".join(
        f"move `{m.entry.key}={m.entry.value}` from [{m.entry.section}] to [{m.belongs_in}]"
        for m in wrong
    )
    ignored = [m for m in wrong if m.ignored]
    if ignored:
        names = ", ".join(f"{m.entry.key} in [{m.entry.section}]" for m in ignored)
        return Finding(fid, title, FAIL, f"silently ignored by systemd: {names}", ev, fix)
    return Finding(fid, title, WARN, "keys in a deprecated section", ev, fix)


def _effective_start_limits(unit: systemd.UnitFile) -> tuple[float, int, list[Evidence]]:
    """(interval s, burst, evidence) as systemd would apply them (defaults 10 s / 5)."""
    interval, burst = 10.0, 5
    ev: list[Evidence] = []
    for section, key in (
        ("Service", "StartLimitInterval"),
        ("Unit", "StartLimitInterval"),
        ("Unit", "StartLimitIntervalSec"),
    ):
        e = unit.entry(section, key)
        if e:
            try:
                interval = systemd.parse_timespan_s(e.value)
                ev.append(Evidence(f"{key} [{section}]", e.value, e.where))
            except ValueError:
                ev.append(Evidence(f"{key} [{section}]", f"{e.value} (unparsable)", e.where))
    for section in ("Service", "Unit"):
        e = unit.entry(section, "StartLimitBurst")
        if e and e.value.isdigit():
            burst = int(e.value)
            ev.append(Evidence(f"StartLimitBurst [{section}]", e.value, e.where))
    return interval, burst, ev


def check_unit_start_limit(s: HostSnapshot, plan: Plan | None) -> Finding:
    fid, title = "unit.start-limit", "Restart rate limit that can trip"
    unit = _unit_or_unknown(s, fid, title)
    if isinstance(unit, Finding):
        return unit
    restart = unit.get("Service", "Restart") or "no"
    e = unit.entry("Service", "Restart")
    ev = [Evidence("Restart", restart, e.where if e else str(unit.path))]
    if restart == "no":
        return Finding(
            fid,
            title,
            FAIL,
            "Restart= is not set: after an OOM kill the service stays down",
            tuple(ev),
            "set Restart=on-failure in [Service]",
        )
    interval, burst, more = _effective_start_limits(unit)
    ev.extend(more)
    eff = s.unit_effective or {}
    if "StartLimitIntervalUSec" in eff and eff.get("StartLimitBurst", "").isdigit():
        # A running systemd is the authority (it has applied every drop-in and default).
        with contextlib.suppress(ValueError):
            interval = systemd.parse_timespan_s(eff["StartLimitIntervalUSec"])
            burst = int(eff["StartLimitBurst"])
            more.append(
                Evidence(
                    "StartLimit (effective)",
                    f"{eff['StartLimitBurst']} in {eff['StartLimitIntervalUSec']}",
                    "systemctl show",
                )
            )
            ev.append(more[-1])
    rs = unit.entry("Service", "RestartSec")
    restart_s = 0.1  # systemd's default RestartSec=100ms
    if rs:
        with contextlib.suppress(ValueError):
            restart_s = systemd.parse_timespan_s(rs.value)
        ev.append(Evidence("RestartSec", rs.value, rs.where))
    ev.append(
        Evidence(
            "effective limit",
            f"{burst} starts in {interval:g} s",
            "systemd (unset: 5 starts in 10 s)",
        )
    )
    fix = (
        "put StartLimitIntervalSec= and StartLimitBurst= in [Unit] with an interval longer "
        f"than (StartLimitBurst - 1) x RestartSec, e.g. StartLimitIntervalSec="
        f"{max(60, math.ceil((burst - 1) * restart_s * 2))}s"
    )
    if (burst - 1) * restart_s >= interval:
        return Finding(
            fid,
            title,
            FAIL,
            f"{burst} starts can never fall within {interval:g} s when each restart waits "
            f"{restart_s:g} s: the service restarts forever instead of failing",
            tuple(ev),
            fix,
        )
    if not more:
        return Finding(
            fid,
            title,
            WARN,
            "no start limit set: systemd's defaults (5 starts in 10 s) apply",
            tuple(ev),
            fix,
        )
    return Finding(fid, title, PASS, f"at most {burst} starts in {interval:g} s", tuple(ev))


def _runs_as_root(unit: systemd.UnitFile) -> bool:
    if (unit.get("Service", "DynamicUser") or "").lower() in ("yes", "true", "1", "on"):
        return False
    return (unit.get("Service", "User") or "root") in ("root", "0")


def check_unit_user(s: HostSnapshot, plan: Plan | None) -> Finding:
    fid, title = "unit.user", "Service does not run as root"
    unit = _unit_or_unknown(s, fid, title)
    if isinstance(unit, Finding):
        return unit
    e = unit.entry("Service", "User")
    ev = (Evidence("User", e.value if e else "not set (root)", e.where if e else str(unit.path)),)
    if _runs_as_root(unit):
        return Finding(
            fid,
            title,
            WARN,
            "runs as root: a compromised model server owns the board",
            ev,
            "set DynamicUser=yes in [Service] (what `slmguard render` writes), "
            "or User= a dedicated system user",
        )
    return Finding(fid, title, PASS, f"runs as {e.value if e else 'a dynamic user'}", ev)


LOOPBACK_NAMES = ("localhost", "ip6-localhost")
KEY_FLAGS = ("--api-key", "--api-key-file")
KEY_ENV = ("SLMGUARD_API_KEY", "SLMGUARD_API_KEY_FILE", "LLAMA_API_KEY")
HOST_ENV = ("SLMGUARD_HOST", "LLAMA_ARG_HOST")


def _flag(argv: Sequence[str], names: Sequence[str]) -> str | None:
    value = None
    for i, arg in enumerate(argv):
        for name in names:
            if arg == name and i + 1 < len(argv):
                value = argv[i + 1]
            elif arg.startswith(name + "="):
                value = arg.split("=", 1)[1]
    return value


def _environment(unit: systemd.UnitFile) -> dict[str, str]:
    env: dict[str, str] = {}
    for value in unit.values("Service", "Environment"):
        for item in systemd.exec_argv(value):
            key, sep, val = item.partition("=")
            if sep:
                env[key] = val
    return env


def is_public(host: str) -> bool:
    """True unless ``host`` is a loopback address or name (or a unix socket path)."""
    h = host.strip("[]")
    if h in LOOPBACK_NAMES or h.startswith(("/", "unix:")):
        return False
    try:
        return not ipaddress.ip_address(h).is_loopback
    except ValueError:
        return True  # a host name: assume it resolves to a reachable address


def check_unit_bind(s: HostSnapshot, plan: Plan | None) -> Finding:
    fid, title = "unit.bind", "No public address without an API key"
    unit = _unit_or_unknown(s, fid, title)
    if isinstance(unit, Finding):
        return unit
    execs = unit.values("Service", "ExecStart")
    e = unit.entry("Service", "ExecStart")
    if not execs or e is None:
        return Finding(fid, title, UNKNOWN, "no ExecStart= in [Service]")
    argv = systemd.exec_argv(execs[-1])
    env = _environment(unit)
    host = _flag(argv, ("--host",)) or next((env[k] for k in HOST_ENV if k in env), None)
    ev = [Evidence("listen address", host or "default (127.0.0.1)", e.where)]
    key = _flag(argv, KEY_FLAGS) or next((k for k in KEY_ENV if k in env), None)
    env_files = unit.values("Service", "EnvironmentFile")
    if key:
        ev.append(Evidence("API key", "configured", e.where))
    if env_files:
        ev.append(Evidence("EnvironmentFile", " ".join(env_files), str(unit.path)))
    if argv and Path(argv[0]).name == "llama-cli":
        ev.append(
            Evidence(
                "program",
                "llama-cli is the interactive client; serving with --host/--port is llama-server",
                e.where,
            )
        )
    if host is None or not is_public(host):
        return Finding(fid, title, PASS, f"listens on {host or '127.0.0.1'} (loopback)", tuple(ev))
    if key:
        return Finding(fid, title, PASS, f"listens on {host} with an API key", tuple(ev))
    fix = (
        "add `--api-key-file /etc/slmguard/api-key` to ExecStart= (file mode 0600), "
        "or listen on `--host 127.0.0.1` behind a proxy"
    )
    if env_files:
        return Finding(
            fid,
            title,
            WARN,
            f"listens on {host}; an API key can only come from "
            "the EnvironmentFile, which doctor did not verify",
            tuple(ev),
            fix,
        )
    return Finding(
        fid,
        title,
        FAIL,
        f"listens on {host} with no API key: anyone on the network can use (and exhaust) the model",
        tuple(ev),
        fix,
    )


def check_cpu_affinity(s: HostSnapshot, plan: Plan | None) -> Finding:
    fid, title = "cpu.affinity", "CPU affinity on the big cores"
    unit = _unit_or_unknown(s, fid, title)
    if isinstance(unit, Finding):
        return unit
    e = unit.entry("Service", "CPUAffinity")
    online = s.online_cpus if isinstance(s.online_cpus, tuple) else None
    ev: list[Evidence] = [
        Evidence("CPUAffinity", e.value if e else "not set", e.where if e else str(unit.path))
    ]
    if online is not None:
        ev.append(
            Evidence(
                "online CPUs",
                " ".join(map(str, online)),
                str(s.root / "sys/devices/system/cpu/online"),
            )
        )
    big: tuple[int, ...] = tuple(plan.board.big_cores) if plan else ()
    big_source = "plan.board.big_cores"
    if not big and isinstance(s.big_cores, tuple) and s.big_cores:
        big, big_source = s.big_cores, str(s.root / "sys/devices/system/cpu/cpu*/cpu_capacity")
    want = tuple(plan.cpu_affinity) if plan and plan.cpu_affinity else big
    if big:
        ev.append(Evidence("big cores", " ".join(map(str, big)), big_source))
    fix = (
        f"set CPUAffinity={' '.join(map(str, want))} in [Service]"
        if want
        else "set CPUAffinity= to the big cores in [Service]"
    )
    if e is None:
        if big and online and set(big) != set(online):
            return Finding(
                fid,
                title,
                WARN,
                "no CPUAffinity=: the scheduler may run the model on the little cores",
                tuple(ev),
                fix,
            )
        return Finding(
            fid, title, PASS, "no CPUAffinity= and no big/little split planned", tuple(ev)
        )
    try:
        cpus = systemd.parse_cpu_set(e.value)
    except ValueError:
        return Finding(fid, title, FAIL, f"CPUAffinity={e.value} is unparsable", tuple(ev), fix)
    if online is not None:
        absent = [c for c in cpus if c not in online]
        if absent and len(absent) == len(cpus):
            return Finding(
                fid,
                title,
                FAIL,
                f"none of CPUs {e.value} exists on this host "
                f"(online: {' '.join(map(str, online))}): the service fails to start",
                tuple(ev),
                fix,
            )
        if absent:
            return Finding(
                fid,
                title,
                WARN,
                f"CPUs {' '.join(map(str, absent))} do not exist here",
                tuple(ev),
                fix,
            )
    if big and not set(cpus) <= set(big):
        little = sorted(set(cpus) - set(big))
        return Finding(
            fid,
            title,
            WARN,
            f"affinity includes non-big cores {' '.join(map(str, little))}",
            tuple(ev),
            fix,
        )
    if not big:
        return Finding(
            fid, title, PASS, f"CPUAffinity={e.value} (no big cores known to compare)", tuple(ev)
        )
    return Finding(fid, title, PASS, f"pinned to big cores {e.value}", tuple(ev))


CHECKS: tuple[Callable[[HostSnapshot, Plan | None], Finding], ...] = (
    check_swap_off,
    check_swap_boot,
    check_zram_off,
    check_zram_boot,
    check_swappiness,
    check_overcommit,
    check_cgroup,
    check_cma,
    check_memlock,
    check_free_memory,
    check_psi,
    check_accelerators,
    check_dmabuf,
    check_board,
    check_unit_memory,
    check_unit_oom_score,
    check_unit_sections,
    check_unit_start_limit,
    check_unit_user,
    check_unit_bind,
    check_cpu_affinity,
)


def run_checks(snapshot: HostSnapshot, plan: Plan | None = None) -> Report:
    """Every check on one snapshot. Pure: same snapshot and plan, same report."""
    findings = tuple(check(snapshot, plan) for check in CHECKS)
    not_seen = tuple(str(u) for u in snapshot.unread)
    if snapshot.euid != 0:
        not_seen += ("not root: debugfs (rknpu, dma_buf) and other users' limits are hidden",)
    return Report(str(snapshot.root), snapshot.euid, findings, not_seen)
