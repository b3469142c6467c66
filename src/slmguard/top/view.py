"""The view model: a snapshot turned into panes of fields, tables, bars and flags. Pure.

Owns every decision about what is shown and how it is judged: which numbers
go in which pane, their wording and units, "n/a" for what was not said, and
the flag of each value (``ok``, ``warn``, ``crit``, ``dim``). The terminal UI
(:mod:`slmguard.top.app`) and the plain-text printer (:mod:`slmguard.top.text`)
only draw a :class:`Screen`; neither judges anything, so ``top --once``
and the live screen always agree.

The memory bar's scale is MemoryMax (else MemoryHigh, the plan's
MemoryMax, the governor's limit, MemTotal); its marks are MemoryHigh (``H``),
MemoryMax (``M``) and the governor's watermarks (``s`` shed, ``d`` degrade,
``c`` critical) placed at their percentage of the governor's effective limit,
which is what the governor compares the working set with. Where the governor counts
the engine's device memory outside the cgroup (DMA-BUF, nvmap, the GPU driver's) its
line follows the bar, and the bar's percentage of that limit includes it, as the
governor's pressure does (its limit then carries the plan's device allowance).

"Measured" beside a planned part is what can be measured for it: the
engine's file-backed RSS for the mapped weights, its anonymous RSS for the
anonymous engine parts together, the front's RSS for the front, CMA in use
for the NPU reserve, the cgroup's usage for the service; the KV cache is
computed (the context the engine has now x the plan's bytes per cell), since
llama.cpp allocates it whole at load.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from slmguard.top.snapshot import (
    AccelView,
    BoardView,
    CoreView,
    EngineView,
    Event,
    GovernorView,
    HeatView,
    MemoryView,
    ModelView,
    PlannedPart,
    PlanView,
    ResizeView,
    ServerView,
    SlotView,
    TopSnapshot,
    TuningView,
    ZoneView,
)

NA = "n/a"
OK, WARN, CRIT, DIM = "ok", "warn", "crit", "dim"
_RANK = {None: 0, DIM: 0, OK: 0, WARN: 1, CRIT: 2}
EVENT_FLAGS = {"info": None, "warning": WARN, "critical": CRIT}
LEVEL_FLAGS = {"normal": OK, "shed": WARN, "degrade": WARN, "critical": CRIT}
STATE_FLAGS = {
    "ready": OK,
    "degraded": WARN,
    "loading": WARN,
    "restarting": WARN,
    "parked": WARN,
    "stalled": CRIT,
    "failed": CRIT,
    "stopped": CRIT,
}
ENGINE_ANON_PARTS = (
    "weights_repacked",
    "weights_loaded",
    "kv_cache",
    "output_buffer",
    "compute_buffer",
    "slot_state",
    "ctx_checkpoints",
    "prompt_cache",
    "server_runtime",
)
ENGINE_FILE_PARTS = (
    "weights_mapped",
    "weights_mapped_cold",
    "server_binary",
)
FRONT_PARTS = ("front_runtime", "front_libraries")


@dataclass(frozen=True)
class Cell:
    text: str
    flag: str | None = None


@dataclass(frozen=True)
class Field:
    label: str
    value: Cell


@dataclass(frozen=True)
class Table:
    headers: tuple[str, ...]
    rows: tuple[tuple[Cell, ...], ...]
    title: str | None = None


@dataclass(frozen=True)
class Mark:
    at: float  # 0..1 of the bar's scale
    label: str  # one character


@dataclass(frozen=True)
class Bar:
    label: str
    fill: float | None  # 0..1 of the scale; None: unknown
    text: str  # the numbers, beside the bar
    flag: str | None = None
    marks: tuple[Mark, ...] = ()


@dataclass(frozen=True)
class Note:
    text: str
    flag: str | None = None


Line = Field | Table | Bar | Note


@dataclass(frozen=True)
class Pane:
    key: str  # memory | governor | engine | board | events
    title: str
    lines: tuple[Line, ...]

    @property
    def flag(self) -> str | None:
        """The worst flag in the pane."""
        worst: str | None = None
        for line in self.lines:
            for f in _flags(line):
                worst = worse(worst, f)
        return worst


@dataclass(frozen=True)
class Screen:
    title: Cell
    panes: tuple[Pane, ...]

    def pane(self, key: str) -> Pane:
        return next(p for p in self.panes if p.key == key)


def worse(a: str | None, b: str | None) -> str | None:
    return b if _RANK[b] > _RANK[a] else a


def _flags(line: Line) -> Iterable[str | None]:
    if isinstance(line, Field):
        yield line.value.flag
    elif isinstance(line, Table):
        for row in line.rows:
            for c in row:
                yield c.flag
    else:
        yield line.flag


# ---------------------------------------------------------------- formatting


def fmt_bytes(n: int | float | None) -> str:
    if n is None:
        return NA
    value = float(n)
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if abs(value) >= 1 << shift:
            scaled = value / (1 << shift)
            return f"{scaled:.2f} {unit}" if unit == "GiB" else f"{scaled:.0f} {unit}"
    return f"{value:.0f} B"


def fmt_pct(p: float | None, digits: int = 1) -> str:
    return NA if p is None else f"{p:.{digits}f}%"


def fmt_int(n: int | float | None) -> str:
    return NA if n is None else f"{int(n)}"


def fmt_rate(r: float | None) -> str:
    return NA if r is None else f"{r:.1f} tok/s"


def fmt_mhz(khz: int | None) -> str:
    return NA if khz is None else f"{khz / 1000:.0f}"


def fmt_ago(seconds: float) -> str:
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s ago"
    if s < 3600:
        return f"{s // 60}m ago"
    if s < 86400:
        return f"{s // 3600}h ago"
    return f"{s // 86400}d ago"


def fmt_clock(unix_s: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(unix_s))


def _pct_flag(pct: float | None, warn: float | None, crit: float | None) -> str | None:
    if pct is None:
        return None
    if crit is not None and pct >= crit:
        return CRIT
    if warn is not None and pct >= warn:
        return WARN
    return OK


# ---------------------------------------------------------------- memory


def _scale(mem: MemoryView | None, gov: GovernorView, plan: PlanView | None) -> int | None:
    candidates = []
    if mem is not None:
        candidates += [mem.max_bytes, mem.high_bytes]
    candidates += [plan.memory_max_bytes if plan else None, gov.limit_bytes]
    if mem is not None:
        candidates.append(mem.mem_total_bytes)
    return next((c for c in candidates if c), None)


def _counted_device_bytes(gov: GovernorView) -> int | None:
    """The device memory the governor adds to the working set; None where it is not shown:
    not counted (no source in the status, and 0 or nothing in the metric)."""
    if gov.device_bytes is None or (gov.device_source is None and gov.device_bytes == 0):
        return None
    return gov.device_bytes


def _device_field(gov: GovernorView) -> Field | None:
    """The engine's device memory outside its cgroup, and where the governor read it."""
    device = _counted_device_bytes(gov)
    if device is None:
        return None
    where = gov.device_source or "slmguard_governor_device_bytes"
    return Field("device memory", Cell(f"{fmt_bytes(device)} outside the cgroup ({where})"))


def _memory_bar(mem: MemoryView | None, gov: GovernorView, plan: PlanView | None) -> Bar:
    ws = mem.working_set_bytes if mem is not None else None
    source = "cgroup"
    if ws is None:
        ws, source = gov.working_set_bytes, "governor"
        if ws is None:
            source = "no cgroup read and no number from the governor"
    scale = _scale(mem, gov, plan)
    high = mem.high_bytes if mem else None
    maximum = mem.max_bytes if mem else None
    if high is None and maximum is None and plan is not None:
        high, maximum = plan.memory_high_bytes, plan.memory_max_bytes
        source += ", limits from the plan"
    marks: list[Mark] = []
    limit = gov.limit_bytes or high or maximum
    shed = gov.shed_pct if gov.shed_pct is not None else (plan.shed_pct if plan else None)
    degrade = (
        gov.degrade_pct if gov.degrade_pct is not None else (plan.degrade_pct if plan else None)
    )
    critical = (
        gov.critical_pct if gov.critical_pct is not None else (plan.critical_pct if plan else None)
    )
    if scale:
        for pct, label in ((shed, "s"), (degrade, "d"), (critical, "c")):
            if pct is not None and limit:
                marks.append(Mark(min(1.0, pct / 100.0 * limit / scale), label))
        if high:
            marks.append(Mark(min(1.0, high / scale), "H"))
        if maximum:
            marks.append(Mark(min(1.0, maximum / scale), "M"))
    # The governor's limit covers the device memory it counts: so does the percentage.
    device = _counted_device_bytes(gov) if gov.limit_bytes else None
    used = None if ws is None else ws + (device or 0)
    used_pct = 100.0 * used / limit if used is not None and limit else None
    flag = _pct_flag(used_pct, shed, critical)
    parts = [fmt_bytes(ws)]
    if high:
        parts.append(f"high {fmt_bytes(high)}")
    if maximum:
        parts.append(f"max {fmt_bytes(maximum)}")
    if used_pct is not None:
        with_device = " with the device memory" if device else ""
        parts.append(f"{used_pct:.1f}% of the limit{with_device}")
    text = " / ".join(parts) + f" ({source})"
    fill = None if ws is None or not scale else min(1.0, ws / scale)
    return Bar("working set", fill, text, flag, tuple(sorted(marks, key=lambda m: m.at)))


def _events_text(mem: MemoryView) -> Cell:
    if not mem.events:
        return Cell(NA if mem.cgroup_path is None else "none reported", DIM)
    keys = [
        k
        for k in ("low", "high", "max", "oom", "oom_kill", "oom_group_kill", "under_oom", "failcnt")
        if k in mem.events
    ]
    words = []
    flag: str | None = OK
    for k in keys:
        d = mem.events_delta.get(k, 0)
        words.append(f"{k} {mem.events[k]}" + (f" (+{d})" if d else ""))
        if k in ("oom_kill", "under_oom") and mem.events[k]:
            flag = worse(flag, CRIT if d or k == "under_oom" else WARN)
        elif k in ("high", "max", "oom") and d:
            flag = worse(flag, WARN)
    return Cell("  ".join(words), flag)


Row = tuple[Cell, ...]


def _planned_bytes(plan: PlanView, names: Iterable[str]) -> int:
    return sum(p.bytes for p in plan.parts if p.name in names)


def _measured_row(name: str, kind: str, plan_bytes: int, measured: int | None, how: str) -> Row:
    """A planned figure beside its measure: a warning when that is over the plan by > 10 %."""
    flag = None
    if measured is not None and plan_bytes:
        flag = WARN if measured > plan_bytes * 1.10 else OK
    return (
        Cell(name),
        Cell(kind),
        Cell(fmt_bytes(plan_bytes)),
        Cell(fmt_bytes(measured) if measured is not None else NA, flag),
        Cell(how, DIM),
    )


def _unmeasured_row(part: PlannedPart, note: str) -> Row:
    """A planned part nothing measures on its own: its bytes and a note where "measured" goes."""
    return (
        Cell(part.name),
        Cell(part.kind),
        Cell(fmt_bytes(part.bytes)),
        Cell(""),
        Cell(note, DIM),
    )


def _kv_row(kv: PlannedPart, plan: PlanView, eng: EngineView, gov: GovernorView) -> Row:
    """The KV cache: the context the engine has now x the plan's bytes per cell."""
    n_ctx = gov.n_ctx_cells or eng.n_ctx_cells
    now = n_ctx * plan.kv_bytes_per_cell if n_ctx and plan.kv_bytes_per_cell else None
    how = f"{n_ctx} cells now x plan's bytes/cell" if now else ""
    return _measured_row("kv_cache", "anon", kv.bytes, now, how)


def _engine_anon_rows(
    plan: PlanView, names: set[str], eng: EngineView, gov: GovernorView
) -> list[Row]:
    """The KV cache, the engine's other anonymous parts, and their total beside the anon RSS."""
    rows: list[Row] = []
    kv = next((p for p in plan.parts if p.name == "kv_cache"), None)
    if kv is not None:
        rows.append(_kv_row(kv, plan, eng, gov))
    anon_parts = [p for p in ENGINE_ANON_PARTS if p in names]
    for p in plan.parts:
        if p.name in anon_parts and p.name != "kv_cache":
            rows.append(_unmeasured_row(p, f"({p.when})"))
    if anon_parts:
        total = _planned_bytes(plan, anon_parts)
        rows.append(
            _measured_row("engine anon total", "anon", total, eng.rss_anon_bytes, "engine anon RSS")
        )
    return rows


def _npu_row(npu: PlannedPart, mem: MemoryView | None) -> Row:
    """The NPU reserve beside the host's CMA in use."""
    cma = None
    if mem is not None and mem.cma_total_bytes and mem.cma_free_bytes is not None:
        cma = mem.cma_total_bytes - mem.cma_free_bytes
    return _measured_row(npu.name, "device", npu.bytes, cma, "CMA in use (host)")


def _plan_rows(plan: PlanView, mem: MemoryView | None, eng: EngineView, gov: GovernorView) -> Table:
    rows: list[Row] = []
    names = {p.name for p in plan.parts}
    file_parts = [p for p in ENGINE_FILE_PARTS if p in names]
    if file_parts:
        mapped = _planned_bytes(plan, file_parts)
        rows.append(
            _measured_row("weights (mapped)", "file", mapped, eng.rss_file_bytes, "engine file RSS")
        )
    rows += _engine_anon_rows(plan, names, eng, gov)
    front = [p for p in FRONT_PARTS if p in names]
    if front:
        front_bytes = _planned_bytes(plan, front)
        rows.append(
            _measured_row("front", "anon+file", front_bytes, eng.front_rss_bytes, "front RSS")
        )
    npu = next((p for p in plan.parts if p.kind == "device"), None)
    if npu is not None:
        rows.append(_npu_row(npu, mem))
    service = _planned_bytes(plan, [p.name for p in plan.parts if p.kind in ("anon", "file")])
    usage = mem.usage_bytes if mem else None
    rows.append(_measured_row("service total", "anon+file", service, usage, "cgroup usage"))
    rows += [_unmeasured_row(p, "outside the service") for p in plan.parts if p.kind == "reserve"]
    return Table(
        ("part", "kind", "planned", "measured", "from"), tuple(rows), title=f"plan {plan.path}"
    )


def _cgroup_field(mem: MemoryView) -> Field:
    return Field(
        "cgroup",
        Cell(
            f"{mem.cgroup_path} (v{mem.cgroup_version})"
            if mem.cgroup_path and mem.cgroup_version
            else (mem.cgroup_path or "not found (give --cgroup or --unit)"),
            None if mem.cgroup_version else WARN,
        ),
    )


def _available_field(mem: MemoryView) -> Field:
    """MemAvailable of MemTotal: critical under 5 %, a warning under 10 %."""
    avail_flag = None
    if mem.mem_available_bytes is not None and mem.mem_total_bytes:
        share = mem.mem_available_bytes / mem.mem_total_bytes
        avail_flag = CRIT if share < 0.05 else WARN if share < 0.10 else OK
    text = f"{fmt_bytes(mem.mem_available_bytes)} of {fmt_bytes(mem.mem_total_bytes)}"
    return Field("MemAvailable", Cell(text, avail_flag))


def _psi_field(mem: MemoryView) -> Field:
    """PSI avg10: critical at full >= 20 %, a warning at some >= 10 %."""
    psi = f"some {fmt_pct(mem.psi_some_avg10_pct, 2)}  full {fmt_pct(mem.psi_full_avg10_pct, 2)}"
    psi_flag = None
    if mem.psi_some_avg10_pct is not None:
        full = mem.psi_full_avg10_pct or 0.0
        psi_flag = CRIT if full >= 20 else WARN if mem.psi_some_avg10_pct >= 10 else OK
    return Field(f"PSI avg10 ({mem.psi_source or NA})", Cell(psi, psi_flag))


def _swap_fields(mem: MemoryView) -> list[Line]:
    """Swap and each active zram device: a warning each, as they should be off."""
    lines: list[Line] = []
    if mem.swap_total_bytes:
        text = (
            f"{fmt_bytes(mem.swap_total_bytes)}, {fmt_bytes(mem.swap_used_bytes)} used "
            "(should be off)"
        )
        lines.append(Field("swap", Cell(text, WARN)))
    elif mem.swap_total_bytes == 0:
        lines.append(Field("swap", Cell("off", OK)))
    for z in mem.zram:
        text = (
            f"zram {fmt_bytes(z.disksize_bytes)}, "
            f"{fmt_bytes(z.mem_used_bytes)} RAM used (should be off)"
        )
        lines.append(Field(z.name, Cell(text, WARN)))
    return lines


def _board_memory_lines(mem: MemoryView) -> list[Line]:
    """What was read on the board: the cgroup, host memory, PSI, events, swap, CMA."""
    lines: list[Line] = [_cgroup_field(mem)]
    if mem.anon_bytes is not None or mem.file_bytes is not None:
        text = f"{fmt_bytes(mem.anon_bytes)} / {fmt_bytes(mem.file_bytes)}"
        lines.append(Field("anon / file", Cell(text)))
    lines += [_available_field(mem), _psi_field(mem), Field("memory.events", _events_text(mem))]
    lines += _swap_fields(mem)
    if mem.cma_total_bytes:
        text = f"{fmt_bytes(mem.cma_free_bytes)} of {fmt_bytes(mem.cma_total_bytes)}"
        lines.append(Field("CMA free", Cell(text)))
    return lines


def memory_pane(snap: TopSnapshot) -> Pane:
    mem, gov, eng, plan = snap.memory, snap.server.governor, snap.server.engine, snap.plan
    lines: list[Line] = [_memory_bar(mem, gov, plan)]
    device = _device_field(gov)
    if device is not None:
        lines.append(device)
    if mem is None:
        lines.append(Note("not on the board: host memory, PSI and cgroup events not read", DIM))
    else:
        lines += _board_memory_lines(mem)
    if plan is not None:
        lines.append(_plan_rows(plan, mem, eng, gov))
    else:
        lines.append(Note("no plan (give --plan FILE to compare planned parts)", DIM))
    return Pane("memory", "Memory", tuple(lines))


# ---------------------------------------------------------------- governor


def _sum(counts: Mapping[str, int], *keys: str) -> int:
    return sum(v for k, v in counts.items() if not keys or k in keys)


def _counts(counts: Mapping[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in counts.items())


def _level_fields(g: GovernorView) -> list[Line]:
    """The level (and for how long), and the pressure judged by the shed and critical marks."""
    level = g.level or NA
    since = f" for {g.level_for_s:.0f}s" if g.level_for_s is not None else ""
    pressure_flag = _pct_flag(g.pressure_pct, g.shed_pct, g.critical_pct)
    return [
        Field("level", Cell(level.upper() + since, LEVEL_FLAGS.get(level))),
        Field("pressure", Cell(fmt_pct(g.pressure_pct), pressure_flag)),
    ]


HEAT_FLAGS = {"cool": OK, "warm": WARN, "hot": WARN, "limit": CRIT}


def _heat_field(h: HeatView) -> Field:
    """The heat the governor acts on: its level, what it admits, and why."""
    level = h.level or NA
    parts = [level.upper()]
    if h.zone is not None and h.temp_c is not None:
        limit = f", limit {h.limit_c:.0f} C" if h.limit_c is not None else ""
        parts.append(f"{h.zone} {h.temp_c:.1f} C{limit}")
    elif not h.watched:
        parts.append("no zone watched")
    if h.firmware:
        parts.append(f"firmware {h.firmware}")
    if h.slots is not None and h.planned_slots is not None:
        parts.append(f"{h.slots} of {h.planned_slots} slots")
    if h.max_tokens_cap is not None:
        parts.append(f"max_tokens {h.max_tokens_cap}")
    if h.shedding:
        parts.append("new work shed")
    if h.zones_missing:
        parts.append(f"plan's zones missing: {', '.join(h.zones_missing)}")
    return Field("heat", Cell("; ".join(parts), HEAT_FLAGS.get(level)))


def _n_ctx_field(g: GovernorView, plan: PlanView | None) -> Field:
    """The context now of the full one (and the plan's): a warning while it is shrunk."""
    full = g.n_ctx_full_cells
    now = g.n_ctx_cells
    planned = plan.n_ctx_cells if plan else None
    ctx = f"{fmt_int(now)} of {fmt_int(full)}"
    if planned is not None:
        ctx += f" (plan {planned})"
    ctx_flag = (
        WARN
        if now is not None and full is not None and now < full
        else (OK if now is not None else None)
    )
    return Field("n_ctx now", Cell(ctx, ctx_flag))


def _count_cell(counts: Mapping[str, int]) -> Cell:
    """Counts by reason ("0" for none): a warning once any is counted."""
    return Cell(_counts(counts) or "0", WARN if _sum(counts) else OK)


def _refusal_fields(g: GovernorView) -> list[Line]:
    """What the governor refused and degraded, by reason, and the max_tokens cap it set."""
    lines: list[Line] = [
        Field("shed (refused)", _count_cell(g.rejections)),
        Field("degraded", _count_cell(g.degradations)),
    ]
    if g.max_tokens_cap is not None:
        lines.append(Field("max_tokens cap", Cell(str(g.max_tokens_cap), WARN)))
    return lines


def _resize_field(r: ResizeView) -> Field:
    """The last context resize: the bytes it freed beside the bytes predicted."""
    return Field(
        "last resize",
        Cell(
            f"{r.n_ctx_from_cells} -> {r.n_ctx_to_cells}, "
            f"freed {fmt_bytes(r.measured_delta_bytes)} "
            f"(predicted {fmt_bytes(r.predicted_delta_bytes)})",
            None if r.ok is not False else CRIT,
        ),
    )


def _transition_lines(g: GovernorView, taken_unix_s: float) -> list[Line]:
    """The last eight level changes, newest first; else the server's totals by transition."""
    if g.recent:
        rows = []
        for t in reversed(g.recent[-8:]):
            when = fmt_ago(taken_unix_s - t.at_unix_s) if t.at_unix_s else NA
            rows.append(
                (
                    Cell(when, DIM),
                    Cell(f"{t.from_level} -> {t.to_level}", LEVEL_FLAGS.get(t.to_level)),
                    Cell(fmt_pct(t.pressure_pct)),
                    Cell((t.reason or NA) + (" [seen by top]" if t.seen_by == "top" else "")),
                )
            )
        headers = ("when", "transition", "pressure", "reason")
        return [Table(headers, tuple(rows), title="last transitions")]
    if g.transitions_total:
        return [Field("transitions", Cell(_counts(g.transitions_total)))]
    return []


def _drift_field(g: GovernorView) -> Field:
    """The leak check: the engine's and the front's drift against the bound, recycles."""
    bound = g.drift_bound_bytes or 0
    engine, front = g.engine_drift_bytes, g.front_drift_bytes
    near = max(engine or 0, front or 0) >= 0.75 * bound > 0
    text = (
        f"engine {fmt_bytes(engine)}, front {fmt_bytes(front)} of {fmt_bytes(bound)}; "
        f"{fmt_int(g.recycles)} recycled"
    )
    return Field("leak drift", Cell(text, WARN if near else None))


def governor_pane(snap: TopSnapshot) -> Pane:
    server, plan = snap.server, snap.plan
    g, eng = server.governor, server.engine
    if not server.reachable:
        return Pane("governor", "Governor", (Note("server unreachable", CRIT),))
    if g.source is None:
        note = server.governor_error or "the server reports no governor"
        return Pane("governor", "Governor", (Note(note, WARN),))
    lines = _level_fields(g)
    if g.limit_bytes is not None:
        lines.append(Field("limit", Cell(f"{fmt_bytes(g.limit_bytes)} ({g.limit_source or NA})")))
    lines.append(_n_ctx_field(g, plan))
    if g.parked is not None:
        lines.append(
            Field("engine", Cell("PARKED" if g.parked else "running", WARN if g.parked else OK))
        )
    busy = sum(1 for s in eng.slots if s.processing)
    slots = (
        f"{busy} busy of {len(eng.slots)}"
        if eng.slots
        else (f"{eng.n_parallel} (no detail)" if eng.n_parallel else NA)
    )
    lines.append(Field("slots", Cell(slots)))
    lines += _refusal_fields(g)
    if g.heat is not None:
        lines.append(_heat_field(g.heat))
    if g.drift_bound_bytes is not None:
        lines.append(_drift_field(g))
    if g.last_resize is not None:
        lines.append(_resize_field(g.last_resize))
    lines += _transition_lines(g, snap.taken_unix_s)
    if server.governor_error:
        lines.append(Note(f"status: {server.governor_error}", DIM))
    return Pane("governor", "Governor", tuple(lines))


# ---------------------------------------------------------------- engine


def _traffic_fields(e: EngineView) -> list[Line]:
    """The queue, and the requests answered, refused (429) and unavailable (503)."""
    queue = f"{fmt_int(e.queue_depth)} waiting, {fmt_int(e.busy)} running"
    requests = (
        f"ok {fmt_int(e.requests_ok)}  429 {fmt_int(e.rejected_429)}  "
        f"503 {fmt_int(e.unavailable_503)}"
    )
    return [
        Field("queue", Cell(queue, WARN if e.queue_depth else None)),
        Field("requests", Cell(requests, WARN if (e.rejected_429 or e.unavailable_503) else None)),
    ]


def _speed_fields(e: EngineView) -> list[Line]:
    """Prompt and decode speeds kept apart, each with where it came from."""
    source = f" ({e.speed_source})" if e.speed_source else ""
    return [
        Field("prompt speed", Cell(fmt_rate(e.prompt_tokens_per_s) + source)),
        Field("decode speed", Cell(fmt_rate(e.decode_tokens_per_s) + source)),
    ]


def _slot_table(slots: Iterable[SlotView]) -> Table:
    """One row a slot: its KV cells used of its share, a warning at 90 %, critical at 99 %."""
    rows = []
    for s in slots:
        cells = s.n_ctx_cells
        used = s.kv_cells_used
        pct = 100.0 * used / cells if used is not None and cells else None
        rows.append(
            (
                Cell(str(s.id)),
                Cell(s.state, WARN if s.processing else None),
                Cell(f"{fmt_int(used)} / {fmt_int(cells)}", _pct_flag(pct, 90.0, 99.0)),
                Cell(fmt_int(s.prompt_tokens)),
                Cell(fmt_int(s.decoded_tokens)),
            )
        )
    return Table(("slot", "state", "KV cells used", "prompt", "decoded"), tuple(rows))


def engine_pane(snap: TopSnapshot) -> Pane:
    server = snap.server
    if not server.reachable:
        return Pane("engine", "Engine", (Note(f"server unreachable: {server.error}", CRIT),))
    e = server.engine
    stalls_flag = CRIT if e.stalls else (OK if e.stalls is not None else None)
    lines: list[Line] = [
        Field("state", Cell(e.state or NA, STATE_FLAGS.get(e.state or ""))),
        Field("version", Cell(e.version or NA, None if e.version else DIM)),
        Field("pid", Cell(fmt_int(e.pid))),
        Field("restarts", Cell(fmt_int(e.restarts), WARN if e.restarts else OK)),
        Field("stalls", Cell(fmt_int(e.stalls), stalls_flag)),
        *_traffic_fields(e),
        *_speed_fields(e),
        Field(
            "RSS",
            Cell(
                f"engine {fmt_bytes(e.rss_bytes)} (anon {fmt_bytes(e.rss_anon_bytes)}, "
                f"file {fmt_bytes(e.rss_file_bytes)}), front {fmt_bytes(e.front_rss_bytes)}"
            ),
        ),
    ]
    for name, why in e.degraded_reasons.items():
        lines.append(Field(f"degraded ({name})", Cell(why, WARN)))
    if e.slots:
        lines.append(_slot_table(e.slots))
    elif e.n_ctx_cells is not None:
        lines.append(Field("n_ctx", Cell(str(e.n_ctx_cells))))
    if server.models:
        lines.append(_models_table(server.models))
    if server.metrics_error:
        lines.append(Note(f"metrics: {server.metrics_error}", DIM))
    return Pane("engine", "Engine", tuple(lines))


def _models_table(models: Iterable[ModelView]) -> Table:
    """A board's models, one row each: how it is kept, its state (an on-demand model out
    of memory is ``unloaded``, not a fault), its engine, the context the governor left
    it (a warning while reduced or parked) and its queue."""
    rows = []
    for m in models:
        kept = NA if m.residency is None else m.residency.replace("_", "-")
        state_flag = None if m.state == "unloaded" else STATE_FLAGS.get(m.state or "")
        ctx = fmt_int(m.n_ctx_cells if m.n_ctx_cells is not None else m.n_ctx_slot_cells)
        reduced = m.n_ctx_cells is not None and m.n_ctx_full_cells not in (None, m.n_ctx_cells)
        if m.parked:
            ctx, reduced = "PARKED", True
        rows.append(
            (
                Cell(m.name),
                Cell(f"{kept} {fmt_int(m.priority)}"),
                Cell(m.state or NA, state_flag),
                Cell(fmt_int(m.pid)),
                Cell(fmt_bytes(m.rss_bytes)),
                Cell(ctx, WARN if reduced else None),
                Cell(f"{fmt_int(m.in_flight)} / {fmt_int(m.queue_depth)}"),
            )
        )
    headers = ("model", "kept, priority", "state", "pid", "RSS", "n_ctx", "running / waiting")
    return Table(headers, tuple(rows), title="models")


# ---------------------------------------------------------------- board


def _core_table(cores: Iterable[CoreView]) -> Table:
    """One row a core: busy (a warning at 90 %), frequency, throttled or capped."""
    rows = []
    for c in cores:
        kind = "" if c.big is None else ("big" if c.big else "little")
        freq = NA if c.cur_khz is None else f"{fmt_mhz(c.cur_khz)} / {fmt_mhz(c.hw_max_khz)} MHz"
        if c.freq_error:
            freq = c.freq_error
        flag_text = (
            "THROTTLED"
            if c.throttled
            else (f"capped {fmt_mhz(c.scaling_max_khz)} MHz" if c.capped else "")
        )
        busy_flag = _pct_flag(c.busy_pct, 90.0, None) if c.busy_pct is not None else None
        rows.append(
            (
                Cell(f"cpu{c.cpu}"),
                Cell(kind, DIM),
                Cell(fmt_pct(c.busy_pct, 0), busy_flag),
                Cell(freq, DIM if c.cur_khz is None else None),
                Cell(flag_text, CRIT if c.throttled else (WARN if c.capped else None)),
            )
        )
    return Table(("core", "type", "busy", "freq", ""), tuple(rows))


def _zone_table(zones: Iterable[ZoneView]) -> Table:
    """One row a thermal zone: its temperature, passive trip, and HOT when it is cooling."""
    rows = []
    for z in zones:
        temp = f"{z.temp_c:.1f} C" if z.temp_c is not None else (z.error or NA)
        flag = CRIT if z.hot else (OK if z.temp_c is not None else DIM)
        trip = f"passive {z.passive_c:.0f} C" if z.passive_c is not None else ""
        hot = Cell("HOT: cooling by slowing the CPU" if z.hot else "", CRIT if z.hot else None)
        rows.append((Cell(z.type), Cell(temp, flag), Cell(trip, DIM), hot))
    return Table(("thermal zone", "temp", "trip", ""), tuple(rows))


def _accel_table(accels: Iterable[AccelView]) -> Table:
    """One row an NPU or GPU: its load (or why it was not read) and its frequency."""
    rows = []
    for a in accels:
        if a.error:
            load = Cell(a.error, WARN)
        elif a.load_pct:
            load = Cell(" ".join(f"{x:.0f}%" for x in a.load_pct))
        else:
            load = Cell(NA, DIM)
        freq = NA if a.cur_freq_hz is None else f"{a.cur_freq_hz / 1e6:.0f} MHz"
        rows.append((Cell(a.name), Cell(a.kind.upper()), load, Cell(freq, DIM)))
    return Table(("accelerator", "kind", "load", "freq"), tuple(rows))


_TUNING_FLAGS = {"fail": CRIT, "warn": WARN, "unknown": DIM}


def _tuning_lines(notes: Iterable[TuningView]) -> list[Line]:
    """The tuning notes that are not a pass (each with its fix), and how many pass."""
    notes = list(notes)
    if not notes:
        return []
    rows = tuple(
        (Cell(n.id.removeprefix("tuning."), _TUNING_FLAGS.get(n.severity)),
         Cell(n.severity.upper(), _TUNING_FLAGS.get(n.severity)), Cell(n.summary),
         Cell(n.fix or "", DIM))
        for n in notes
        if n.severity != "pass"
    )  # fmt: skip
    passed = sum(1 for n in notes if n.severity == "pass")
    lines: list[Line] = []
    if rows:
        lines.append(Table(("tuning", "", "finding", "fix"), rows))
    lines.append(Note(f"tuning: {passed} of {len(notes)} checks pass (slmguard doctor)", DIM))
    return lines


def board_pane(snap: TopSnapshot) -> Pane:
    b: BoardView | None = snap.board
    if b is None:
        why = "not read here (--no-local, or --server is not a loopback address)"
        return Pane("board", "Board", (Note(why, DIM),))
    lines: list[Line] = []
    if b.cores:
        lines.append(_core_table(b.cores))
    if b.zones:
        lines.append(_zone_table(b.zones))
    else:
        lines.append(Note("no thermal zones (a VM, or a kernel without thermal)", DIM))
    if b.accels:
        lines.append(_accel_table(b.accels))
    else:
        lines.append(Note("no NPU or GPU load source found", DIM))
    lines += _tuning_lines(b.tuning)
    for err in b.errors:
        lines.append(Note(err, WARN))
    return Pane("board", "Board", tuple(lines))


# ---------------------------------------------------------------- events


def events_pane(snap: TopSnapshot, limit: int = 12) -> Pane:
    lines: list[Line] = []
    w = snap.watch
    if w is not None:
        if w.alert_log or w.kills_reported is not None:
            lines.append(
                Note(
                    f"watch: {fmt_int(w.kills_reported)} OOM kills reported, "
                    f"{w.bundles} crash bundles ({w.state_dir})",
                    DIM,
                )
            )
        else:
            lines.append(Note(f"no watch alert log in {w.state_dir}", DIM))
    events: tuple[Event, ...] = snap.events[-limit:] if limit else snap.events
    if events:
        rows = tuple(
            (
                Cell(fmt_clock(e.unix_s), DIM),
                Cell(e.kind, EVENT_FLAGS.get(e.severity)),
                Cell(e.message),
                Cell(e.source, DIM),
            )
            for e in reversed(events)
        )
        lines.append(Table(("time", "event", "what", "from"), rows))
    else:
        lines.append(Note("nothing yet", DIM))
    return Pane("events", "Events", tuple(lines))


# ---------------------------------------------------------------- the screen


def title(server: ServerView, taken_unix_s: float) -> Cell:
    if not server.reachable:
        return Cell(f"slmguard top  {server.url}  UNREACHABLE: {server.error}", CRIT)
    e = server.engine
    state = e.state or NA
    return Cell(
        f"slmguard top  {server.url}  {state}  {e.model or NA}  {fmt_clock(taken_unix_s)}",
        STATE_FLAGS.get(state),
    )


def build_screen(snap: TopSnapshot, events_limit: int = 12) -> Screen:
    return Screen(
        title(snap.server, snap.taken_unix_s),
        (
            memory_pane(snap),
            governor_pane(snap),
            engine_pane(snap),
            board_pane(snap),
            events_pane(snap, events_limit),
        ),
    )
