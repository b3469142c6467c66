"""What one refresh of ``slmguard top`` saw: frozen snapshots, units in field names.

Owns the data model between the sources (:mod:`slmguard.top.sources`,
:mod:`slmguard.top.server`, :mod:`slmguard.top.events`) and what shows it
(:mod:`slmguard.top.view`); also its JSON form (``top --once --json``,
schema ``slmguard.top/1``). ``None`` everywhere means "not said": the server
did not send the field, the file was not there, or top does not run on the
board. ``*_error`` fields say why something is missing when there is a
reason worth showing (``needs root``, ``HTTP 401``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

SCHEMA = "slmguard.top/1"


# ---------------------------------------------------------------- the server


@dataclass(frozen=True)
class SlotView:
    """One llama-server slot (a sequence the engine decodes concurrently)."""

    id: int
    processing: bool | None = None
    n_ctx_cells: int | None = None  # the slot's share of the KV cache
    prompt_tokens: int | None = None
    decoded_tokens: int | None = None
    kv_cells_used: int | None = None  # slmguard_kv_cells_used, else prompt + decoded

    @property
    def state(self) -> str:
        if self.processing is None:
            return "n/a"
        return "busy" if self.processing else "idle"


@dataclass(frozen=True)
class EngineView:
    """The engine as /health and /metrics describe it."""

    state: str | None = None  # ready | degraded | loading | restarting | stalled | parked ...
    model: str | None = None
    model_path: str | None = None
    version: str | None = None
    pid: int | None = None
    restarts: int | None = None
    stalls: int | None = None
    n_ctx_cells: int | None = None
    n_parallel: int | None = None
    n_ctx_slot_cells: int | None = None
    queue_depth: int | None = None
    busy: int | None = None
    slots: tuple[SlotView, ...] = ()
    rss_bytes: int | None = None
    rss_anon_bytes: int | None = None
    rss_file_bytes: int | None = None
    front_rss_bytes: int | None = None
    prompt_tokens_per_s: float | None = None
    decode_tokens_per_s: float | None = None
    speed_source: str | None = None  # "server" gauges, "engine" (llamacpp:*), "counters"
    prompt_tokens_total: float | None = None  # counters, for the rate when no gauge says it
    decoded_tokens_total: float | None = None
    requests_ok: int | None = None
    rejected_429: int | None = None  # outcome rejected_queue_full
    unavailable_503: int | None = None  # outcome unavailable (shed, parked, restarting)
    degraded_reasons: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class TransitionView:
    """One governor level change; ``at_unix_s`` None when the server gave no time."""

    from_level: str
    to_level: str
    reason: str | None = None
    pressure_pct: float | None = None
    at_unix_s: float | None = None
    seen_by: str = "server"  # "server" (status JSON) or "top" (observed between refreshes)


@dataclass(frozen=True)
class ResizeView:
    n_ctx_from_cells: int
    n_ctx_to_cells: int
    predicted_delta_bytes: int | None = None
    measured_delta_bytes: int | None = None
    ok: bool | None = None


@dataclass(frozen=True)
class HeatView:
    """The heat the governor acts on (``thermal`` of /api/v1/governor)."""

    level: str | None = None  # cool | warm | hot | limit
    level_for_s: float | None = None
    slots: int | None = None  # admitted at once now
    planned_slots: int | None = None
    max_tokens_cap: int | None = None
    shedding: bool | None = None
    zone: str | None = None  # the watched zone with the least room
    temp_c: float | None = None
    limit_c: float | None = None
    firmware: str | None = None  # a Pi's throttle flags, when set
    zones_missing: tuple[str, ...] = ()
    watched: int = 0  # zones watched


@dataclass(frozen=True)
class GovernorView:
    """The memory governor. ``source``: the richest answer it came from."""

    source: str | None = None  # "status" | "health" | "metrics"
    enabled: bool | None = None
    level: str | None = None  # normal | shed | degrade | critical
    level_for_s: float | None = None
    pressure_pct: float | None = None
    n_ctx_cells: int | None = None
    n_ctx_full_cells: int | None = None
    n_ctx_floor_cells: int | None = None
    parked: bool | None = None
    working_set_bytes: int | None = None
    # The engine's device memory its cgroup does not count (DMA-BUF, nvmap, the GPU
    # driver's), which the governor adds to the working set; ``device_source`` says where
    # it was read ("devmem", "NvMapMemUsed"; None: not counted, or only the metric said).
    device_bytes: int | None = None
    device_source: str | None = None
    limit_bytes: int | None = None
    limit_source: str | None = None
    psi_some_avg10_pct: float | None = None
    shed_pct: float | None = None
    degrade_pct: float | None = None
    critical_pct: float | None = None
    recover_pct: float | None = None
    max_tokens_cap: int | None = None
    rejections: Mapping[str, int] = field(default_factory=dict)
    degradations: Mapping[str, int] = field(default_factory=dict)
    transitions_total: Mapping[str, int] = field(default_factory=dict)  # "normal->shed": n
    recent: tuple[TransitionView, ...] = ()
    last_resize: ResizeView | None = None
    heat: HeatView | None = None  # None: a server without the heat input
    # Leak-aware recycling (issue 40): engines recycled, the drifts and the bound.
    recycles: int | None = None
    engine_drift_bytes: int | None = None
    front_drift_bytes: int | None = None
    drift_bound_bytes: int | None = None
    last_recycle: str | None = None  # what the last recycle was for, in words


@dataclass(frozen=True)
class ModelView:
    """One model of a board (a server of several models): /health's ``models[]``, with
    the governor's context and parking of it from ``/api/v1/governor`` when read."""

    name: str
    state: str | None = None  # ready | loading | unloaded (on demand, out of memory) ...
    residency: str | None = None  # pinned | on_demand
    priority: int | None = None
    pid: int | None = None
    restarts: int | None = None
    rss_bytes: int | None = None
    rss_anon_bytes: int | None = None
    queue_depth: int | None = None
    in_flight: int | None = None
    n_ctx_slot_cells: int | None = None
    n_parallel: int | None = None
    n_ctx_cells: int | None = None  # the governor's context for it now
    n_ctx_full_cells: int | None = None
    parked: bool | None = None  # stopped by the governor


@dataclass(frozen=True)
class ServerView:
    url: str
    reachable: bool = False  # /health answered at all (any status)
    health_status: int | None = None
    error: str | None = None  # why /health did not answer
    metrics_error: str | None = None
    governor_error: str | None = None
    latency_ms: float | None = None
    engine: EngineView = field(default_factory=EngineView)  # the primary model's
    governor: GovernorView = field(default_factory=GovernorView)
    models: tuple[ModelView, ...] = ()  # a board's models (none: one model)


# ---------------------------------------------------------------- the board


@dataclass(frozen=True)
class ZramView:
    name: str
    disksize_bytes: int
    mem_used_bytes: int | None = None


@dataclass(frozen=True)
class MemoryView:
    """The service's cgroup and the host's memory, read on the board."""

    cgroup_path: str | None = None
    cgroup_version: int | None = None
    usage_bytes: int | None = None
    working_set_bytes: int | None = None  # usage - inactive_file (the kubelet's)
    anon_bytes: int | None = None
    file_bytes: int | None = None
    high_bytes: int | None = None  # MemoryHigh (v2 memory.high); None: not set
    max_bytes: int | None = None  # MemoryMax (v2 memory.max, v1 limit_in_bytes)
    events: Mapping[str, int] = field(default_factory=dict)  # high, max, oom, oom_kill ...
    events_delta: Mapping[str, int] = field(default_factory=dict)  # since the last refresh
    mem_total_bytes: int | None = None
    mem_available_bytes: int | None = None
    psi_source: str | None = None  # "cgroup" or "host"
    psi_some_avg10_pct: float | None = None
    psi_full_avg10_pct: float | None = None
    swap_total_bytes: int | None = None
    swap_used_bytes: int | None = None
    zram: tuple[ZramView, ...] = ()
    cma_total_bytes: int | None = None
    cma_free_bytes: int | None = None
    errors: tuple[str, ...] = ()


@dataclass(frozen=True)
class CoreView:
    cpu: int
    busy_pct: float | None = None
    big: bool | None = None  # None: all cores alike, or not known
    capacity: int | None = None
    cur_khz: int | None = None
    scaling_max_khz: int | None = None
    hw_max_khz: int | None = None
    throttled: bool = False
    capped: bool = False
    freq_error: str | None = None


@dataclass(frozen=True)
class ZoneView:
    name: str
    type: str
    temp_c: float | None = None
    passive_c: float | None = None
    critical_c: float | None = None
    hot: bool = False
    error: str | None = None


@dataclass(frozen=True)
class AccelView:
    name: str
    kind: str  # npu | gpu
    load_pct: tuple[float, ...] = ()
    cur_freq_hz: int | None = None
    max_freq_hz: int | None = None
    error: str | None = None


@dataclass(frozen=True)
class TuningView:
    """One of :mod:`slmguard.tuning`'s notes on the board."""

    id: str
    severity: str  # pass | warn | fail | unknown
    summary: str
    fix: str | None = None


@dataclass(frozen=True)
class BoardView:
    cores: tuple[CoreView, ...] = ()
    zones: tuple[ZoneView, ...] = ()
    accels: tuple[AccelView, ...] = ()
    errors: tuple[str, ...] = ()
    tuning: tuple[TuningView, ...] = ()


# ---------------------------------------------------------------- plan, events


@dataclass(frozen=True)
class PlannedPart:
    name: str
    bytes: int
    kind: str  # anon | file | device | reserve
    when: str  # load | use


@dataclass(frozen=True)
class PlanView:
    path: str
    model: str
    board: str
    n_ctx_cells: int
    n_parallel: int
    memory_high_bytes: int
    memory_max_bytes: int
    shed_pct: float
    degrade_pct: float
    critical_pct: float
    kv_bytes_per_cell: int | None = None
    parts: tuple[PlannedPart, ...] = ()


@dataclass(frozen=True)
class Event:
    """One line of the timeline."""

    unix_s: float
    severity: str  # info | warning | critical
    kind: str  # oom-kill, engine-restart, stall, level, crash-bundle, server-down ...
    message: str
    source: str  # "watch" (alerts.jsonl), "bundle" (crashes/), "top" (seen between refreshes)


@dataclass(frozen=True)
class WatchView:
    state_dir: str
    kills_reported: int | None = None
    alert_log: bool = False  # alerts.jsonl exists
    bundles: int = 0


@dataclass(frozen=True)
class TopSnapshot:
    taken_unix_s: float
    server: ServerView
    interval_s: float | None = None  # since the previous refresh
    memory: MemoryView | None = None  # None: top does not read the board here
    board: BoardView | None = None
    plan: PlanView | None = None
    watch: WatchView | None = None
    events: tuple[Event, ...] = ()
    errors: tuple[str, ...] = ()


def snapshot_to_dict(snap: TopSnapshot) -> dict[str, Any]:
    """The JSON form of a snapshot (``top --once --json``): the fields as they are."""

    def conv(value: Any) -> Any:
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return {f.name: conv(getattr(value, f.name)) for f in dataclasses.fields(value)}
        if isinstance(value, Mapping):
            return {str(k): conv(v) for k, v in value.items()}
        if isinstance(value, tuple | list):
            return [conv(v) for v in value]
        return value

    out: dict[str, Any] = {"schema": SCHEMA}
    out.update(conv(snap))
    return out
