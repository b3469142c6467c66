"""Doctor check that a plan's neighbours are there, protected and within their memory.

Owns ``neighbours`` (issue 39): each neighbour the plan names with a unit must be
installed (else fail), carry what ``apply`` gives it (a ``Slice=`` outside slmguard's and
``MemoryMin=``/``MemoryLow=`` of at least its declared memory; else warn: apply has not
run), and, where systemd says, hold no more than the plan declared (its MemoryPeak, else
MemoryCurrent: a warning above it, a failure more than :data:`OVER_FAIL` above it, since
the plan's budget then under-counts the board). ``pass`` without neighbours; ``unknown``
without a plan. Pure: reads only the snapshot (``collect(neighbour_units=...)``).
"""

from __future__ import annotations

from slmguard.doctor.findings import (
    FAIL,
    PASS,
    SEVERITIES,
    UNKNOWN,
    WARN,
    CheckId,
    Evidence,
    Finding,
    mib,
)
from slmguard.host import systemd
from slmguard.host.snapshot import HostSnapshot, NeighbourUnit, Unread
from slmguard.plan.schema import Neighbour, Plan

#: A neighbour holding more than this over its declared memory fails the check.
OVER_FAIL = 0.10
INFERENCE_SLICE = "slmguard.slice"

CHECK = CheckId("neighbours", "The board's other services are installed, protected and fit")


def _effective_bytes(value: str | None) -> int | None:
    return systemd.parse_memory_property(value)


def _protection_bytes(n: Neighbour, unit: systemd.UnitFile, live: dict[str, str]) -> int | None:
    """What the unit's MemoryMin=/MemoryLow= (as the plan asks) gives it: live, else its
    files; None when unset."""
    key = "MemoryMin" if n.protection == "min" else "MemoryLow"
    if key in live and _effective_bytes(live[key]):
        return _effective_bytes(live[key])
    value = unit.get("Service", key)
    try:
        return systemd.parse_size(value) if value is not None else None
    except ValueError:
        return None


def _one(n: Neighbour, found: NeighbourUnit | None) -> tuple[str, str, list[Evidence]]:
    """(severity, what is wrong or "", evidence) for one neighbour with a unit."""
    unit_name = n.unit or ""
    ev = [Evidence(f"{n.name} declared", mib(n.memory_bytes), "plan.neighbours")]
    if found is None or isinstance(found.unit, Unread):
        why = found.unit.reason if found is not None and isinstance(found.unit, Unread) else ""
        return UNKNOWN, f"{unit_name} could not be read {why}".strip(), ev
    if found.unit is None:
        return FAIL, f"{unit_name} is not installed", ev
    unit, live = found.unit, dict(found.effective or {})
    ev.append(Evidence(f"{unit_name}", str(unit.path), "unit file"))
    slice_name = live.get("Slice") or unit.get("Service", "Slice")
    protected = _protection_bytes(n, unit, live)
    ev.append(
        Evidence(f"{unit_name} Slice / Memory{n.protection.capitalize()}",
                 f"{slice_name or '(default)'} / {mib(protected) if protected else '(none)'}",
                 "systemctl show" if live else "unit files")
    )  # fmt: skip
    held = _effective_bytes(live.get("MemoryPeak")) or _effective_bytes(live.get("MemoryCurrent"))
    if held is not None:
        ev.append(Evidence(f"{unit_name} MemoryPeak (or Current)", mib(held), "systemctl show"))
        if held > n.memory_bytes * (1 + OVER_FAIL):
            return FAIL, f"{n.name} holds {mib(held)}, above its declared {mib(n.memory_bytes)}", ev
    if slice_name in (None, "", INFERENCE_SLICE, "system.slice") or not protected:
        return WARN, f"{unit_name} is not in the business slice with its protection yet", ev
    if protected < n.memory_bytes:
        return WARN, f"{unit_name} is protected for {mib(protected)} only", ev
    if held is not None and held > n.memory_bytes:
        return WARN, f"{n.name} holds {mib(held)}, above its declared {mib(n.memory_bytes)}", ev
    return PASS, "", ev


def check_neighbours(s: HostSnapshot, plan: Plan | None) -> Finding:
    if plan is None:
        return CHECK.unknown("no plan: its neighbours are unknown (pass --plan FILE)")
    if not plan.neighbours:
        return CHECK.passed("the plan declares no neighbours")
    found = {n.name: n for n in s.neighbours}
    worst, problems, evidence = PASS, [], []
    for n in plan.neighbours:
        if n.unit is None:
            evidence.append(
                Evidence(f"{n.name} declared", f"{mib(n.memory_bytes)}, no unit", "plan")
            )
            continue
        severity, problem, ev = _one(n, found.get(n.unit))
        evidence += ev
        if problem:
            problems.append(problem)
        if SEVERITIES.index(severity) > SEVERITIES.index(worst):
            worst = severity
    if worst == PASS:
        total = sum(n.memory_bytes for n in plan.neighbours)
        return CHECK.passed(
            f"{len(plan.neighbours)} neighbour(s), {mib(total)}: installed, protected, within "
            "their memory",
            evidence,
        )
    fix = (
        "slmguard apply --plan PLAN (moves each into the business slice with its MemoryMin=); "
        "re-plan a neighbour that holds more: slmguard plan ... --neighbour NAME,unit=UNIT"
    )
    return CHECK.finding(worst, "; ".join(problems), evidence, None if worst == UNKNOWN else fix)
