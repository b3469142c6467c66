"""Tuning checks on the CPU: the clocks of the service's cores, and which cores those are.

Owns ``tuning.cpufreq`` (each cpufreq policy of the cores the service runs on: a
governor that holds the clock down, ``powersave`` or ``userspace`` below the top, is a
failure; a ``scaling_max_freq`` below ``cpuinfo_max_freq`` a warning, as is a cooling
device slowing those cores now) and ``tuning.affinity`` (those cores are the big ones,
and the plan's threads fit on them: ``-t 4`` on RK3588's four A76 runs about twice as
fast as on all eight, llama.cpp issue 7176). Pure: reads only the
:class:`~slmguard.host.boardstate.BoardState`.
"""

from __future__ import annotations

from slmguard.host.boardstate import BoardState
from slmguard.host.cpu import CpuFreq
from slmguard.tuning.notes import Evidence, Note, NoteId, Target, cpu_list, mhz

CPU_DIR = "sys/devices/system/cpu"
#: Governors that raise the clock under load (the rest hold it where they are told).
SCALING = ("performance", "schedutil", "ondemand", "conservative", "interactive")


def policies(state: BoardState, cpus: tuple[int, ...]) -> list[tuple[tuple[int, ...], CpuFreq]]:
    """The cpufreq policies covering ``cpus``: (the policy's cores among them, its facts)."""
    seen: set[int] = set()
    out = []
    for cpu in sorted(cpus):
        if cpu in seen:
            continue
        f = state.freq(cpu)
        if f is None:
            continue
        members = tuple(c for c in (f.policy_cpus or (cpu,)) if c in cpus) or (cpu,)
        seen.update(members)
        out.append((members, f))
    return out


def _policy_dir(f: CpuFreq) -> str:
    first = min(f.policy_cpus) if f.policy_cpus else f.cpu
    return f"/{CPU_DIR}/cpufreq/policy{first}"


def _evidence(members: tuple[int, ...], f: CpuFreq) -> Evidence:
    value = (
        f"{f.governor or '?'}, now {mhz(f.cur_khz)}, max {mhz(f.scaling_max_khz)} "
        f"(hardware {mhz(f.hw_max_khz)})"
    )
    return Evidence(f"cpu{cpu_list(members)}", value, f"{CPU_DIR}/cpu{f.cpu}/cpufreq")


def _pinned_low(f: CpuFreq) -> bool:
    top = f.hw_max_khz
    if top is None:
        return False
    if f.governor == "powersave":
        return f.scaling_min_khz is None or f.scaling_min_khz < top
    if f.governor == "userspace":
        return f.cur_khz is not None and f.cur_khz < top
    return False


def check_cpufreq(state: BoardState, target: Target) -> Note:
    check = NoteId("tuning.cpufreq", "CPU clocks of the service's cores")
    found = policies(state, target.cpus)
    with_freq = [(m, f) for m, f in found if f.governor is not None or f.hw_max_khz is not None]
    if not with_freq:
        return check.passed(
            f"no cpufreq for cpu{cpu_list(target.cpus)}: the clock is fixed (a VM, or no "
            "cpufreq driver)"
        )
    ev = [_evidence(m, f) for m, f in with_freq]
    ev.append(Evidence("cores", cpu_list(target.cpus), target.cpus_from))
    low = [(m, f) for m, f in with_freq if _pinned_low(f)]
    if low:
        m, f = low[0]
        return check.fail(
            f"cpu{cpu_list(m)} held at {mhz(f.cur_khz)} by the {f.governor} governor "
            f"(hardware maximum {mhz(f.hw_max_khz)})",
            ev,
            f"echo schedutil | sudo tee {_policy_dir(f)}/scaling_governor (performance holds "
            "the top clock; make it stick with a udev rule or cpufrequtils' GOVERNOR=)",
        )
    mode = state.power_modes.active if state.power_modes is not None else None
    by_mode = mode.cpu_max_khz if mode is not None else None
    capped = [(m, f) for m, f in with_freq if f.capped and f.scaling_max_khz != by_mode]
    if capped:
        m, f = capped[0]
        return check.warn(
            f"cpu{cpu_list(m)} capped at {mhz(f.scaling_max_khz)} (scaling_max_freq) below "
            f"the hardware's {mhz(f.hw_max_khz)}",
            ev,
            f"echo {f.hw_max_khz} | sudo tee {_policy_dir(f)}/scaling_max_freq (on a Jetson "
            "the power mode sets it: see tuning.power_mode)",
        )
    slowed = sorted(set(target.cpus) & set(state.throttled_cpus))
    if slowed:
        return check.warn(
            f"cpu{cpu_list(slowed)} slowed by a thermal cooling device now",
            ev,
            "cool the board (heatsink, fan) or lower its load; see tuning.thermal",
        )
    odd = [f.governor for _, f in with_freq if f.governor and f.governor not in SCALING]
    if odd:
        return check.warn(
            f"governor {odd[0]}: not one that raises the clock under load",
            ev,
            "echo schedutil | sudo tee /sys/devices/system/cpu/cpufreq/policy*/scaling_governor",
        )
    govs = sorted({f.governor or "?" for _, f in with_freq})
    tail = ""
    if mode is not None and any(f.capped for _, f in with_freq):
        tail = f" (the cap of power mode {mode.name}: tuning.power_mode)"
    return check.passed(
        f"cpu{cpu_list(target.cpus)}: {', '.join(govs)}, up to "
        f"{mhz(max(f.scaling_max_khz or 0 for _, f in with_freq))}{tail}",
        ev,
    )


def check_affinity(state: BoardState, target: Target) -> Note:
    check = NoteId("tuning.affinity", "The service's cores are the big ones")
    big = set(state.big_cores)
    ev = [
        Evidence("cores", cpu_list(target.cpus), target.cpus_from),
        Evidence("big cores", cpu_list(state.big_cores) or "?", f"{CPU_DIR}/cpu*/cpu_capacity"),
    ]
    if target.threads is not None:
        ev.append(Evidence("engine threads", str(target.threads), "the plan's engine.n_threads"))
    if not big or big == set(state.online):
        return check.passed("one kind of core: any of them will do", ev)
    little = sorted(set(target.cpus) - big)
    mine = sorted(set(target.cpus) & big)
    fix = f"pin the service to the big cores: CPUAffinity={cpu_list(state.big_cores)}"
    if little:
        return check.warn(
            f"the service may run on little cores cpu{cpu_list(little)} (big: "
            f"{cpu_list(state.big_cores)}): a thread there holds back every token",
            ev,
            fix + f", and serve with --n-threads {len(big)}",
        )
    if target.threads is not None and target.threads > len(mine):
        return check.warn(
            f"{target.threads} threads on {len(mine)} big cores: they take turns on each core",
            ev,
            f"serve with --n-threads {len(mine)} (one per big core), or re-plan on this "
            "board: slmguard plan --board auto",
        )
    return check.passed(f"on big cores cpu{cpu_list(mine)}", ev)
