"""Doctor checks that the planned service fits this host's memory.

Owns ``memory.available`` (MemAvailable, plus what the running service already
holds, against the plan's MemoryHigh/MemoryMax) and ``memlock.weights`` (the
unit's LimitMEMLOCK=, or this shell's RLIMIT_MEMLOCK, against the weights the
plan locks). Both say ``unknown`` without a plan. Pure: reads only the snapshot.
"""

from __future__ import annotations

from slmguard.doctor.findings import FAIL, MIB, WARN, CheckId, Evidence, Finding, mib
from slmguard.doctor.unit import runs_as_root
from slmguard.host import systemd
from slmguard.host.snapshot import HostSnapshot, Unread
from slmguard.plan.schema import Plan


def check_free_memory(s: HostSnapshot, plan: Plan | None) -> Finding:
    check = CheckId("memory.available", "Available memory covers the plan")
    if isinstance(s.meminfo, Unread):
        return check.unread(s.meminfo)
    mem = s.meminfo
    src = str(s.root / "proc/meminfo")
    ev: list[Evidence] = [
        Evidence("MemTotal", mib(mem.mem_total_bytes), src),
        Evidence("MemAvailable", mib(mem.mem_available_bytes), src),
    ]
    if plan is None:
        return check.unknown("no plan to compare with (pass --plan FILE)", ev)
    if mem.mem_available_bytes is None:
        return check.unknown("no MemAvailable (kernel < 3.14)", ev)
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
        return check.fail(
            f"this host has {mib(mem.mem_total_bytes)} RAM, the plan is for "
            f"{plan.board.name} with {mib(plan.board.ram_bytes)}",
            ev,
            "re-plan for this board: slmguard plan --board <this board>",
        )
    if usable >= lim.memory_max_bytes:
        return check.passed(f"{mib(usable)} available for the service", ev)
    sev = WARN if usable >= lim.memory_high_bytes else FAIL
    return check.finding(
        sev,
        f"only {mib(usable)} available, the service may grow to {mib(lim.memory_max_bytes)}: "
        "other processes use the rest",
        ev,
        "stop or limit other services, or re-plan with a smaller context",
    )


def _int_or_none(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:  # "[not set]", "infinity"
        return None


def check_memlock(s: HostSnapshot, plan: Plan | None) -> Finding:
    check = CheckId("memlock.weights", "memlock limit covers locked weights")
    if plan is None:
        return check.unknown("no plan: whether weights are locked is unknown")
    if not plan.engine.use_mlock:
        return check.passed("the plan does not lock weights (use_mlock false)")
    need = plan.model.file_bytes
    ev: list[Evidence] = [Evidence("locked weights", mib(need), "plan.model.file_bytes")]
    limit: int | None
    unit = s.unit if isinstance(s.unit, systemd.UnitFile) else None
    fix = f"set LimitMEMLOCK={need // MIB + 64}M in the [Service] section"
    if unit is not None:
        if runs_as_root(unit):
            ev.append(Evidence("User", unit.get("Service", "User") or "(root)", str(unit.path)))
            return check.passed(
                "the service runs as root (CAP_IPC_LOCK ignores the limit)",
                ev,
            )
        raw = unit.get("Service", "LimitMEMLOCK")
        if raw is None:
            ev.append(Evidence("LimitMEMLOCK", "not set", str(unit.path)))
            return check.fail(
                "the unit sets no LimitMEMLOCK=: the service gets systemd's default "
                "(a few MiB), mlock of the weights fails",
                ev,
                fix,
            )
        entry = unit.entry("Service", "LimitMEMLOCK")
        where = entry.where if entry else str(unit.path)
        try:
            limit = systemd.parse_size(raw.split(":")[0])
        except ValueError:
            return check.unknown(f"LimitMEMLOCK={raw} unparsable", ev)
        ev.append(Evidence("LimitMEMLOCK", raw, where))
    elif isinstance(s.memlock, Unread):
        return check.unread(s.memlock)
    else:
        limit = s.memlock.soft
        ev.append(
            Evidence("RLIMIT_MEMLOCK (this shell)", mib(limit), str(s.root / "proc/self/limits"))
        )
    if limit is None or limit >= need:
        return check.passed(f"memlock {mib(limit)} >= {mib(need)}", ev)
    return check.fail(
        f"memlock limit {mib(limit)} is below the {mib(need)} of weights the plan locks",
        ev,
        fix,
    )
