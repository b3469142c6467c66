"""Doctor checks on the board's hardware: CMA, NPU/GPU nodes, DMA-BUF, the model name.

Owns ``cma.size`` (the CMA pool against the plan's NPU reserve and the RAM, and
a boot file whose ``cma=`` differs from the running kernel's), ``npu.devices``
(planned device nodes present), ``dmabuf.total`` (driver buffers no cgroup
limit sees), ``board.model`` (/proc/device-tree/model) and ``board.hardware``
(the host is the plan's board: its device tree's board family, its RAM and its
CPUs; a fleet's inventory can put a board in the wrong group, and a plan for
another board would size its limits wrongly). Pure: reads only the snapshot.
"""

from __future__ import annotations

from slmguard.doctor.findings import MIB, CheckId, Evidence, Finding, mib
from slmguard.host import kernelargs
from slmguard.host.snapshot import HostSnapshot, Unread
from slmguard.plan.boards import PROFILES, family_from_device_tree, pick_variant
from slmguard.plan.schema import Plan

#: A plan's RAM (MemTotal when made with --board auto) and the host's differing by more
#: than this share is another board.
RAM_SLACK = 0.05


def _boot_cma(s: HostSnapshot) -> tuple[int | None, str | None, str | None]:
    """(cma bytes, boot file path, problem) from the boot file, when there is one."""
    if isinstance(s.boot_args, Unread):
        return None, None, f"{s.boot_args.path}: {s.boot_args.reason}"
    if s.boot_args is None:
        return None, None, None
    path = str(s.boot_args.path)
    try:
        return s.boot_args.cma_bytes, path, None
    except ValueError as err:
        return None, path, str(err)


def _cmdline_cma(s: HostSnapshot, ev: list[Evidence]) -> int | None:
    """cma= of the running kernel (None: not set or unreadable), its evidence added to ``ev``."""
    if not isinstance(s.cmdline, tuple):
        return None
    cma: int | None = None
    try:
        cma = kernelargs.cma_bytes(s.cmdline)
    except ValueError as err:
        ev.append(Evidence("cma= on /proc/cmdline", f"unparsable: {err}", "proc/cmdline"))
    ev.append(
        Evidence(
            "cma= on the running kernel",
            mib(cma) if cma else "not set",
            str(s.root / "proc/cmdline"),
        )
    )
    return cma


def _cma_reboot_pending(
    check: CheckId,
    ev: list[Evidence],
    boot_cma: int | None,
    cmd_cma: int | None,
    total: int | None,
) -> Finding | None:
    """The boot file's cma= is not what the running kernel has: a reboot is pending."""
    if boot_cma is not None and cmd_cma is not None and boot_cma != cmd_cma:
        return check.warn(
            f"boot file sets cma={mib(boot_cma)} but the running kernel has {mib(cmd_cma)}: "
            "reboot pending",
            ev,
            "reboot",
        )
    if boot_cma is not None and cmd_cma is None and total is not None and boot_cma != total:
        return check.warn(
            f"boot file sets cma={mib(boot_cma)}, running kernel has {mib(total)}: reboot "
            "pending (or the boot file is not the one that boots)",
            ev,
            "reboot",
        )
    return None


def check_cma(s: HostSnapshot, plan: Plan | None) -> Finding:
    check = CheckId("cma.size", "CMA pool fits the NPU reserve and the RAM")
    if isinstance(s.meminfo, Unread):
        return check.unread(s.meminfo)
    mem, total = s.meminfo, s.meminfo.cma_total_bytes
    ev = [
        Evidence(
            "CmaTotal",
            mib(total) if total is not None else "absent (kernel without CONFIG_CMA)",
            str(s.root / "proc/meminfo"),
        )
    ]
    cmd_cma = _cmdline_cma(s, ev)
    boot_cma, boot_path, boot_problem = _boot_cma(s)
    if boot_path or boot_problem:
        ev.append(
            Evidence(
                "cma= in the boot file",
                boot_problem or (mib(boot_cma) if boot_cma else "not set"),
                boot_path or "boot file",
            )
        )
    # The plan's CMA size; None where the board's memory for the accelerator is not a
    # CMA pool (Jetson: nvmap carves it), so there is nothing to ask of cma= there.
    want = plan.kernel.cma_bytes if plan else None
    boot_file = (plan.board.boot_file if plan else None) or boot_path or "the boot file"
    if want:
        ev.append(Evidence("planned CMA / NPU reserve", mib(want), "plan"))
    fix_cma = (
        f"add `cma={want // MIB}M` to the kernel arguments in {boot_file}, then reboot"
        if want
        else "lower cma= in the boot file"
    )
    if want and (total is None or total < want):
        have = "no CMA" if total is None else f"CMA is {mib(total)}"
        return check.fail(
            f"{have}; the plan reserves {mib(want)} for the NPU/GPU: the driver's "
            "contiguous allocations will fail",
            ev,
            fix_cma,
        )
    if total and total > mem.mem_total_bytes // 2:
        return check.warn(
            f"CMA is {mib(total)} of {mib(mem.mem_total_bytes)} RAM: only movable pages may "
            "use it, so unmovable kernel allocations run short",
            ev,
            fix_cma,
        )
    pending = _cma_reboot_pending(check, ev, boot_cma, cmd_cma, total)
    if pending is not None:
        return pending
    what = f"CMA {mib(total)}" if total is not None else "no CMA and none needed"
    return check.passed(what, ev)


def check_accelerators(s: HostSnapshot, plan: Plan | None) -> Finding:
    check = CheckId("npu.devices", "NPU/GPU device nodes")
    if isinstance(s.accelerators, Unread):
        return check.unread(s.accelerators)
    acc = s.accelerators
    nodes = acc.all_nodes
    ev = [Evidence("nodes", " ".join(nodes) or "none", str(s.root / "dev"))]
    if acc.rknpu_version:
        ev.append(Evidence("rknpu driver", acc.rknpu_version, "/sys/kernel/debug/rknpu/version"))
    elif acc.rknpu_debugfs_problem and acc.rknpu:
        ev.append(Evidence("rknpu debugfs", acc.rknpu_debugfs_problem, "/sys/kernel/debug/rknpu"))
    wanted = plan.board.device_nodes if plan else ()
    present = [n for n in wanted if any(node_matches(n, x) for x in nodes)]
    missing = [n for n in wanted if n not in present]
    if missing:
        ev.append(Evidence("planned but absent", " ".join(missing), "plan.board.device_nodes"))
    reserve = plan.board.npu_reserve_bytes if plan else 0
    if wanted and not present and reserve:
        return check.fail(
            f"none of the planned device nodes ({' '.join(wanted)}) exists, yet the plan "
            f"reserves {mib(reserve)} for the NPU/GPU",
            ev,
            "load the NPU/GPU driver (vendor kernel) or re-plan for CPU only",
        )
    return check.passed(" ".join(nodes) if nodes else "no accelerator nodes (CPU only)", ev)


def node_matches(pattern: str, node: str) -> bool:
    """A planned node (a file, a directory such as /dev/dri, or a glob ending in *) is there."""
    if pattern.endswith("*"):
        return node.startswith(pattern[:-1])
    return node == pattern or node.startswith(pattern.rstrip("/") + "/")


def check_dmabuf(s: HostSnapshot, plan: Plan | None) -> Finding:
    check = CheckId("dmabuf.total", "DMA-BUF memory outside the cgroup")
    if isinstance(s.dmabuf, Unread):
        return check.unread(s.dmabuf, fix="run as root with debugfs mounted")
    d = s.dmabuf
    ev = (Evidence("DMA-BUF", f"{d.count} buffers, {mib(d.total_bytes)}", str(d.source)),)
    reserve = plan.board.npu_reserve_bytes if plan else 0
    if reserve and d.total_bytes > reserve:
        return check.warn(
            f"drivers hold {mib(d.total_bytes)} of DMA-BUF, more than the planned "
            f"{mib(reserve)} NPU reserve; no cgroup limit sees it",
            ev,
        )
    return check.passed(f"{mib(d.total_bytes)} in {d.count} buffers", ev)


def check_board(s: HostSnapshot, plan: Plan | None) -> Finding:
    check = CheckId("board.model", "Board identified")
    if isinstance(s.device_tree_model, Unread):
        return check.unread(s.device_tree_model)
    src = str(s.root / "proc/device-tree/model")
    if s.device_tree_model is None:
        return check.unknown(
            "no /proc/device-tree/model (not a device-tree board)",
            (Evidence("model", "absent", src),),
        )
    ev = (Evidence("model", s.device_tree_model, src),)
    return check.passed(s.device_tree_model, ev)


def _plan_family(plan: Plan) -> str | None:
    """The board family of the plan's named profile (``rk3588-8g`` -> ``rk3588``)."""
    name = plan.board.name
    if name not in PROFILES or name == "generic":
        return None
    return name.rsplit("-", 1)[0]


def _hardware_facts(s: HostSnapshot) -> tuple[str | None, int, tuple[int, ...]] | Unread:
    """(device-tree family, MemTotal, online CPUs) of the host, or what could not be read."""
    meminfo, cpus, model, compatible = (
        s.meminfo,
        s.online_cpus,
        s.device_tree_model,
        s.device_tree_compatible,
    )
    if isinstance(meminfo, Unread):
        return meminfo
    if isinstance(cpus, Unread):
        return cpus
    if isinstance(model, Unread):
        return model
    if isinstance(compatible, Unread):
        return compatible
    return family_from_device_tree(model, compatible or ()), meminfo.mem_total_bytes, cpus


def _hardware_problems(
    plan: Plan, family: str | None, mem_total: int, cpus: tuple[int, ...]
) -> list[str]:
    board = plan.board
    planned = _plan_family(plan)
    problems = []
    if planned is not None and family != planned:
        what = f"a {family} board" if family else "no board the device tree names"
        problems.append(f"this host is {what}; the plan is for {board.name}")
    elif planned is not None and pick_variant(planned, mem_total).name != board.name:
        found = pick_variant(planned, mem_total).name
        problems.append(
            f"MemTotal {mib(mem_total)} makes this a {found}; the plan is for {board.name} "
            f"({mib(board.ram_bytes)})"
        )
    elif planned is None and abs(mem_total - board.ram_bytes) > RAM_SLACK * board.ram_bytes:
        problems.append(
            f"MemTotal {mib(mem_total)}; the plan was made for {mib(board.ram_bytes)} "
            f"(more than {RAM_SLACK:.0%} apart)"
        )
    if len(cpus) != len(board.cpus):
        problems.append(f"{len(cpus)} CPUs online; the plan's board has {len(board.cpus)}")
    return problems


def check_board_hardware(s: HostSnapshot, plan: Plan | None) -> Finding:
    check = CheckId("board.hardware", "The hardware is the plan's board")
    if plan is None:
        return check.unknown("no plan to compare the hardware with")
    facts = _hardware_facts(s)
    if isinstance(facts, Unread):
        return check.unread(facts)
    family, mem_total, cpus = facts
    ev = (
        Evidence("device-tree family", family or "none", str(s.root / "proc/device-tree")),
        Evidence("MemTotal", mib(mem_total), str(s.root / "proc/meminfo")),
        Evidence("online CPUs", str(len(cpus)), str(s.root / "sys/devices/system/cpu/online")),
        Evidence("plan board", plan.board.name, "plan"),
    )
    problems = _hardware_problems(plan, family, mem_total, cpus)
    if problems:
        return check.fail(
            "; ".join(problems),
            ev,
            fix="plan for this board (slmguard plan --board auto), or deploy the plan of its "
            "kind (in a fleet: move the host to its kind's group)",
        )
    return check.passed(f"a {plan.board.name}: board family, RAM and CPUs match the plan", ev)
