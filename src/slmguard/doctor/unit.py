"""Doctor checks on the service's systemd unit (file, drop-ins, ``systemctl show``).

Owns ``unit.memory`` (MemoryHigh=/MemoryMax= against the plan and the RAM),
``unit.model`` (the unit serves the plan's model: its ``--model``, or the model
of the plan its ``--plan`` names, is the planned file),
``unit.oom-score`` (the model process is the OOM victim, including the
llama-server engine that slmguard serve starts with a high score),
``unit.sections`` (keys systemd ignores where they stand), ``unit.start-limit``
(a restart rate limit that can trip),
``unit.user`` (not root) and ``cpu.affinity`` (pinned to existing big cores).
Who can reach the server (``unit.bind``) is ``doctor.bind``'s. Every check says
``unknown`` when no unit is installed or given. Pure: reads only the snapshot.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path

from slmguard.doctor.findings import MIB, Check, CheckId, Evidence, Finding, mib
from slmguard.errors import ConfigError
from slmguard.host import cgroup, procfs, systemd
from slmguard.host.snapshot import HostSnapshot, ServeModelArgs, Unread, serve_model_args
from slmguard.plan.planfile import loads_plan
from slmguard.plan.schema import Limits, Plan

UnitCheck = Callable[[HostSnapshot, Plan | None, systemd.UnitFile, CheckId], Finding]


def unit_check(fid: str, title: str) -> Callable[[UnitCheck], Check]:
    """Make a check of the service's unit from ``body(s, plan, unit, check)``.

    The check is ``unknown`` when no unit was given and slmguard.service is not
    installed, or when the unit could not be read; ``body`` sees a parsed unit.
    """
    check = CheckId(fid, title)

    def decorate(body: UnitCheck) -> Check:
        @functools.wraps(body)
        def run(s: HostSnapshot, plan: Plan | None) -> Finding:
            if isinstance(s.unit, Unread):
                return check.unread(s.unit)
            if s.unit is None:
                return check.unknown(
                    "no unit to check: slmguard.service is not installed (pass --unit NAME|FILE)",
                )
            return body(s, plan, s.unit, check)

        return run

    return decorate


def service_key_evidence(unit: systemd.UnitFile, key: str, unset: str = "not set") -> Evidence:
    """A ``[Service]`` key's value and ``file:line``; ``unset`` and the unit file when absent."""
    e = unit.entry("Service", key)
    return Evidence(key, e.value if e else unset, e.where if e else str(unit.path))


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


def _memory_evidence(
    unit: systemd.UnitFile, effective: Mapping[str, str], lim: Limits | None
) -> list[Evidence]:
    """MemoryHigh/MemoryMax as written, as systemd runs them, and as planned."""
    ev = [service_key_evidence(unit, key) for key in ("MemoryHigh", "MemoryMax")]
    for key in ("MemoryHigh", "MemoryMax"):
        if key in effective:
            ev.append(Evidence(f"{key} (effective)", effective[key], "systemctl show"))
    if lim:
        planned = (
            f"MemoryHigh={lim.memory_high_bytes // MIB}M MemoryMax={lim.memory_max_bytes // MIB}M"
        )
        ev.append(Evidence("planned", planned, "plan.limits"))
    return ev


def _memory_max(
    check: CheckId,
    ev: list[Evidence],
    maximum: tuple[int | None, str] | None,
    ram: int | None,
    lim: Limits | None,
) -> tuple[int, str] | Finding:
    """MemoryMax= (bytes, as written), or the failure: missing, not below the RAM, above the plan.

    Any of those leaves the OS reserve unprotected.
    """
    fix = (
        f"set MemoryMax={lim.memory_max_bytes // MIB}M in [Service]"
        if lim
        else "set MemoryMax= in [Service] (slmguard plan prints the value)"
    )
    max_b, raw = maximum if maximum is not None else (None, "")
    if max_b is None:
        return check.fail(
            "no MemoryMax=: nothing stops the service from taking the whole board", ev, fix
        )
    if ram and max_b >= ram:
        return check.fail(
            f"MemoryMax={raw} is not below the {mib(ram)} of RAM: no limit at all", ev, fix
        )
    if lim and max_b > lim.memory_max_bytes * 1.01:
        return check.fail(
            f"MemoryMax={raw} exceeds the planned "
            f"{mib(lim.memory_max_bytes)}: the OS reserve is not protected",
            ev,
            fix,
        )
    return max_b, raw


def _memory_high_warning(
    s: HostSnapshot,
    check: CheckId,
    ev: list[Evidence],
    high_b: int | None,
    max_b: int,
    lim: Limits | None,
) -> Finding | None:
    """No throttling zone before the OOM kill: MemoryHigh= missing, ignored or not below max."""
    v1 = isinstance(s.cgroup_layout, cgroup.CgroupLayout) and s.cgroup_layout.memory_version == 1
    if v1 and high_b is not None:
        return check.warn(
            "MemoryHigh= is ignored on cgroup v1 (this host): only MemoryMax= applies",
            ev,
            "move the host to cgroup v2 (see cgroup.v2-memory)",
        )
    fix = (
        f"set MemoryHigh={lim.memory_high_bytes // MIB}M in [Service]"
        if lim
        else "set MemoryHigh= (about 93% of MemoryMax) in [Service]"
    )
    if high_b is None:
        return check.warn("no MemoryHigh=: no throttling before the OOM kill", ev, fix)
    if high_b >= max_b:
        return check.warn("MemoryHigh >= MemoryMax: no throttling zone", ev, fix)
    return None


def _memory_drift_warning(
    check: CheckId,
    ev: list[Evidence],
    unit: systemd.UnitFile,
    maximum: tuple[int, str],
    effective: Mapping[str, str],
    lim: Limits | None,
) -> Finding | None:
    """MemoryMax= below the plan (OOM at load), or systemd running another value than the file."""
    max_b, raw = maximum
    if lim and max_b < lim.memory_max_bytes * 0.99:
        return check.warn(
            f"MemoryMax={raw} is below the planned "
            f"{mib(lim.memory_max_bytes)}: the model may be OOM-killed at load",
            ev,
            f"set MemoryMax={lim.memory_max_bytes // MIB}M in [Service]",
        )
    eff_max = effective.get("MemoryMax")
    if eff_max and eff_max.isdigit() and abs(int(eff_max) - max_b) > MIB:
        return check.warn(
            f"systemd runs with MemoryMax={eff_max}, the file "
            "says otherwise: daemon-reload and restart pending",
            ev,
            f"systemctl daemon-reload && systemctl restart {unit.name}",
        )
    return None


@unit_check("unit.memory", "MemoryHigh/MemoryMax as planned")
def check_unit_memory(
    s: HostSnapshot, plan: Plan | None, unit: systemd.UnitFile, check: CheckId
) -> Finding:
    ram = _ram(s)
    lim = plan.limits if plan else None
    effective = s.unit_effective or {}
    ev = _memory_evidence(unit, effective, lim)
    high = _unit_size(unit, "MemoryHigh", ram)
    maximum = _unit_size(unit, "MemoryMax", ram)
    checked = _memory_max(check, ev, maximum, ram, lim)
    if isinstance(checked, Finding):
        return checked
    warning = _memory_high_warning(
        s, check, ev, high[0] if high else None, checked[0], lim
    ) or _memory_drift_warning(check, ev, unit, checked, effective, lim)
    if warning is not None:
        return warning
    return check.passed(f"MemoryHigh={high[1] if high else '?'} MemoryMax={checked[1]}", ev)


def _planned(plan: Plan) -> str:
    m = plan.model
    return m.path or f"preset {m.preset} {m.quant or ''}".rstrip()


def _same_file(a: str, b: str) -> bool:
    return os.path.normpath(a) == os.path.normpath(b)


def _same_model(unit_plan: Plan, plan: Plan) -> bool:
    """Two plans' models are one: same sha256 and size when both record them (a copy
    at another path is the same model), else the same path, or the same preset."""
    a, b = unit_plan.model, plan.model
    if a.sha256 and b.sha256:
        return a.sha256 == b.sha256 and a.file_bytes == b.file_bytes
    if a.path and b.path:
        return _same_file(a.path, b.path)
    if b.path is None and b.preset is not None:  # a preset plan: the same preset's model
        return (a.preset, a.arch, a.n_layer) == (b.preset, b.arch, b.n_layer)
    return False


def _model_evidence(args: ServeModelArgs, plan: Plan) -> list[Evidence]:
    """What the unit's ExecStart= names, and the model the plan is for."""
    ev = [
        Evidence("--plan", args.plan or "not given", args.where),
        Evidence("--model", args.model or "not given", args.where),
        Evidence("planned model", _planned(plan), "plan.model"),
    ]
    if plan.model.sha256:
        ev.append(Evidence("planned sha256", plan.model.sha256, "plan.model.sha256"))
    return ev


def _served_by_model_flag(
    check: CheckId, model: str, plan: Plan, ev: list[Evidence], fix: str
) -> Finding:
    """The unit names --model: the planned file (a preset plan's is checked by serve)."""
    m = plan.model
    if m.path is None:
        return check.passed(
            f"serves {model}; serve checks it against preset {m.preset} at start", ev
        )
    if _same_file(model, m.path):
        return check.passed(f"serves the planned file {m.path}", ev)
    return check.fail(f"the unit serves {model} (--model), the plan is for {m.path}", ev, fix)


def _served_by_unit_plan(
    s: HostSnapshot, check: CheckId, plan_arg: str, plan: Plan, ev: list[Evidence], fix: str
) -> Finding:
    """The unit names only --plan: the model of the plan it reads must be the planned one."""
    planfile = s.unit_plan
    if isinstance(planfile, Unread):
        return check.unknown(f"cannot read the unit's plan: {planfile.reason}", ev)
    if planfile is None:  # pragma: no cover - collect() reads it whenever --plan is given
        return check.unknown(f"the unit's plan {plan_arg} was not read", ev)
    try:
        up = loads_plan(planfile.raw, plan_arg)
    except ConfigError as err:
        return check.fail(f"the unit's plan is invalid, serve refuses to start: {err}", ev, fix)
    ev.append(Evidence("the unit's plan's model", _planned(up), plan_arg))
    if up.model.sha256:
        ev.append(Evidence("its sha256", up.model.sha256, plan_arg))
    if up.model.path is None:
        return check.fail(
            f"the unit's plan {plan_arg} is for preset {up.model.preset} and the unit gives "
            "no --model: serve refuses to start (exit 78)",
            ev,
            fix,
        )
    if not _same_model(up, plan):
        return check.fail(
            f"the unit serves {up.model.path} (from {plan_arg}), the plan is for {_planned(plan)}",
            ev,
            fix,
        )
    return check.passed(f"serves {up.model.path}, the planned model (from {plan_arg})", ev)


@unit_check("unit.model", "The unit serves the planned model")
def check_unit_model(
    s: HostSnapshot, plan: Plan | None, unit: systemd.UnitFile, check: CheckId
) -> Finding:
    if plan is None:
        return check.unknown("no plan to compare with (pass --plan FILE)")
    args = serve_model_args(unit)
    if args is None:
        return check.unknown(
            "ExecStart= is not `slmguard serve`: which model it serves is not known"
        )
    ev = _model_evidence(args, plan)
    fix = (
        "render the unit from this plan: slmguard render --plan PLAN"
        + (" --model FILE" if plan.model.path is None else "")
        + " (or slmguard apply)"
    )
    if args.model is not None:
        return _served_by_model_flag(check, args.model, plan, ev, fix)
    if args.plan is None:
        return check.fail(
            "the unit names neither --plan nor --model: it serves the embedded default "
            f"model, the plan is for {_planned(plan)}",
            ev,
            fix,
        )
    return _served_by_unit_plan(s, check, args.plan, plan, ev, fix)


ENGINE_OOM_SCORE_ADJ = 1000  # serve starts its engine with this (--engine-oom-score-adj)


def _is_slmguard_serve(unit: systemd.UnitFile) -> bool:
    execs = unit.values("Service", "ExecStart")
    argv = systemd.exec_argv(execs[-1]) if execs else ()
    return len(argv) >= 2 and Path(argv[0]).name == "slmguard" and argv[1] == "serve"


@unit_check("unit.oom-score", "The model process is the OOM victim")
def check_unit_oom_score(
    s: HostSnapshot, plan: Plan | None, unit: systemd.UnitFile, check: CheckId
) -> Finding:
    e = unit.entry("Service", "OOMScoreAdjust")
    ev = [service_key_evidence(unit, "OOMScoreAdjust")]
    fix = "set OOMScoreAdjust=500 in [Service]"
    if e is not None:
        try:
            value = int(e.value)
        except ValueError:
            return check.fail(f"OOMScoreAdjust={e.value} is not an integer", ev, fix)
    else:
        value = 0
    if value > 0:
        return check.passed(f"OOMScoreAdjust={value}", ev)
    if _is_slmguard_serve(unit):
        # The front may start low; it starts its engine at 1000 (raising needs no
        # privilege), so the process holding the model dies first and the front
        # survives to restart it (with OOMPolicy=continue).
        policy = unit.get("Service", "OOMPolicy") or "stop"
        ev.append(
            Evidence("engine oom_score_adj", str(ENGINE_OOM_SCORE_ADJ), "slmguard serve's default")
        )
        ev.append(Evidence("OOMPolicy", policy, str(unit.path)))
        if policy == "continue":
            return check.passed(
                f"front at {value}, engine at {ENGINE_OOM_SCORE_ADJ}: the engine is the victim",
                ev,
            )
        return check.warn(
            f"OOMPolicy={policy}: when the engine is OOM-killed "
            "systemd stops the whole unit instead of letting the front restart it",
            ev,
            "set OOMPolicy=continue in [Service]",
        )
    if e is None:
        return check.warn(
            "OOMScoreAdjust not set: under global pressure the "
            "kernel may kill sshd or the monitor first",
            ev,
            fix,
        )
    return check.warn(
        f"OOMScoreAdjust={value} protects the service instead of the shell and core daemons",
        ev,
        fix,
    )


@unit_check("unit.sections", "Every unit key in the section systemd reads it from")
def check_unit_sections(
    s: HostSnapshot, plan: Plan | None, unit: systemd.UnitFile, check: CheckId
) -> Finding:
    wrong = systemd.misplaced_keys(unit)
    if not wrong:
        return check.passed(
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
        return check.fail(f"silently ignored by systemd: {names}", ev, fix)
    return check.warn("keys in a deprecated section", ev, fix)


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


@unit_check("unit.start-limit", "Restart rate limit that can trip")
def check_unit_start_limit(
    s: HostSnapshot, plan: Plan | None, unit: systemd.UnitFile, check: CheckId
) -> Finding:
    restart = unit.get("Service", "Restart") or "no"
    e = unit.entry("Service", "Restart")
    ev = [Evidence("Restart", restart, e.where if e else str(unit.path))]
    if restart == "no":
        return check.fail(
            "Restart= is not set: after an OOM kill the service stays down",
            ev,
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
        return check.fail(
            f"{burst} starts can never fall within {interval:g} s when each restart waits "
            f"{restart_s:g} s: the service restarts forever instead of failing",
            ev,
            fix,
        )
    if not more:
        return check.warn(
            "no start limit set: systemd's defaults (5 starts in 10 s) apply",
            ev,
            fix,
        )
    return check.passed(f"at most {burst} starts in {interval:g} s", ev)


def runs_as_root(unit: systemd.UnitFile) -> bool:
    if (unit.get("Service", "DynamicUser") or "").lower() in ("yes", "true", "1", "on"):
        return False
    return (unit.get("Service", "User") or "root") in ("root", "0")


@unit_check("unit.user", "Service does not run as root")
def check_unit_user(
    s: HostSnapshot, plan: Plan | None, unit: systemd.UnitFile, check: CheckId
) -> Finding:
    e = unit.entry("Service", "User")
    ev = (service_key_evidence(unit, "User", unset="not set (root)"),)
    if runs_as_root(unit):
        return check.warn(
            "runs as root: a compromised model server owns the board",
            ev,
            "set DynamicUser=yes in [Service] (what `slmguard render` writes), "
            "or User= a dedicated system user",
        )
    return check.passed(f"runs as {e.value if e else 'a dynamic user'}", ev)


def _big_cores(s: HostSnapshot, plan: Plan | None) -> tuple[tuple[int, ...], str]:
    """The big cores and where they come from: the plan's board, else this host's sysfs."""
    big: tuple[int, ...] = tuple(plan.board.big_cores) if plan else ()
    if not big and isinstance(s.big_cores, tuple) and s.big_cores:
        return s.big_cores, str(s.root / "sys/devices/system/cpu/cpu*/cpu_capacity")
    return big, "plan.board.big_cores"


def _affinity_outside(
    check: CheckId,
    ev: list[Evidence],
    value: str,
    cpus: tuple[int, ...],
    online: tuple[int, ...] | None,
    big: tuple[int, ...],
    fix: str,
) -> Finding | None:
    """CPUAffinity= naming CPUs this host does not have, or cores that are not big."""
    absent = [c for c in cpus if online is not None and c not in online]
    if online is not None and absent and len(absent) == len(cpus):
        return check.fail(
            f"none of CPUs {value} exists on this host "
            f"(online: {' '.join(map(str, online))}): the service fails to start",
            ev,
            fix,
        )
    if absent:
        return check.warn(f"CPUs {' '.join(map(str, absent))} do not exist here", ev, fix)
    if big and not set(cpus) <= set(big):
        little = sorted(set(cpus) - set(big))
        return check.warn(f"affinity includes non-big cores {' '.join(map(str, little))}", ev, fix)
    return None


@unit_check("cpu.affinity", "CPU affinity on the big cores")
def check_cpu_affinity(
    s: HostSnapshot, plan: Plan | None, unit: systemd.UnitFile, check: CheckId
) -> Finding:
    e = unit.entry("Service", "CPUAffinity")
    online = s.online_cpus if isinstance(s.online_cpus, tuple) else None
    ev: list[Evidence] = [service_key_evidence(unit, "CPUAffinity")]
    if online is not None:
        cpu_online = str(s.root / "sys/devices/system/cpu/online")
        ev.append(Evidence("online CPUs", " ".join(map(str, online)), cpu_online))
    big, big_source = _big_cores(s, plan)
    if big:
        ev.append(Evidence("big cores", " ".join(map(str, big)), big_source))
    want = tuple(plan.cpu_affinity) if plan and plan.cpu_affinity else big
    fix = (
        f"set CPUAffinity={' '.join(map(str, want))} in [Service]"
        if want
        else "set CPUAffinity= to the big cores in [Service]"
    )
    if e is None:
        if big and online and set(big) != set(online):
            return check.warn(
                "no CPUAffinity=: the scheduler may run the model on the little cores", ev, fix
            )
        return check.passed("no CPUAffinity= and no big/little split planned", ev)
    try:
        cpus = systemd.parse_cpu_set(e.value)
    except ValueError:
        return check.fail(f"CPUAffinity={e.value} is unparsable", ev, fix)
    problem = _affinity_outside(check, ev, e.value, cpus, online, big, fix)
    if problem is not None:
        return problem
    if not big:
        return check.passed(f"CPUAffinity={e.value} (no big cores known to compare)", ev)
    return check.passed(f"pinned to big cores {e.value}", ev)
