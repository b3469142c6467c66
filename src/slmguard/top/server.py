"""The server's answers as a :class:`~slmguard.top.snapshot.ServerView`: pure, tolerant.

Owns reading ``/health``, ``/metrics`` and ``/api/v1/governor`` bodies into the snapshot
model (:func:`server_view`, :func:`engine_view`, :func:`models_view`,
:func:`governor_view`). Every field may be missing, of the wrong type or spelled as an
older server spells it (``worker_pid`` for ``engine.pid`` and the like); such a field is
``None`` (shown "n/a"), never an exception. ``docs/top.md`` (What it reads from the
server) lists every field and spelling accepted; keep the two in step. Speeds are kept
apart (prompt vs decode): the server's gauges, else llama.cpp's averages, else the
counters' rise since the last refresh, recorded in ``EngineView.speed_source``. On a
board the engine's gauges are the primary model's, the request counts every model's.

It must not fetch anything (:mod:`slmguard.top.sources`) nor draw anything.
"""

from __future__ import annotations

import calendar
import math
import time
from collections.abc import Mapping
from typing import Any

from slmguard.top.client import Fetch
from slmguard.top.promtext import Metrics, parse_metrics
from slmguard.top.snapshot import (
    EngineView,
    GovernorView,
    HeatView,
    ModelView,
    ResizeView,
    ServerView,
    SlotView,
    TransitionView,
)

MAX_SLOTS = 256
MAX_MODELS = 16
MAX_TRANSITIONS = 32
LEVELS = ("normal", "shed", "degrade", "critical")


# ---------------------------------------------------------------- tolerant getters


def _dict(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, dict) else {}


def _int(value: Any) -> int | None:
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    return None


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _str(value: Any, limit: int = 300) -> str | None:
    return value[:limit] if isinstance(value, str) else None


def _bool(value: Any) -> bool | None:
    return value if isinstance(value, bool) else None


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


def _count_map(value: Any) -> dict[str, int]:
    return {str(k)[:80]: n for k, v in _dict(value).items() if (n := _int(v)) is not None}


def _metric_int(m: Metrics | None, *names: str) -> int | None:
    if m is None:
        return None
    v = m.first(*names)
    return None if v is None else int(v)


# ---------------------------------------------------------------- slots


def _slot(raw: Any, m: Metrics | None) -> SlotView | None:
    d = _dict(raw)
    sid = _int(d.get("id"))
    if sid is None:
        return None
    decoded = _int(d.get("n_decoded"))
    nxt = d.get("next_token")
    if decoded is None and isinstance(nxt, list) and nxt:
        decoded = _int(_dict(nxt[0]).get("n_decoded"))
    prompt = _int(d.get("n_prompt_tokens"))
    processing = _bool(d.get("is_processing"))
    used = _int(d.get("kv_cells_used"))
    if used is None and m is not None:
        v = m.value("slmguard_kv_cells_used", slot=str(sid))
        used = None if v is None else int(v)
    if used is None and prompt is not None:
        # llama-server's n_prompt_tokens is the slot's whole token list: the prompt and
        # every token generated so far (kept after the generation for prompt reuse).
        used = prompt
    cells = _int(d.get("n_ctx"))
    if cells is None and m is not None:
        v = m.value("slmguard_kv_cells_total", slot=str(sid))
        cells = None if v is None else int(v)
    return SlotView(sid, processing, cells, prompt, decoded, used)


def _slots(health: Mapping[str, Any], m: Metrics | None) -> tuple[SlotView, ...]:
    raw = health.get("slots")
    out: list[SlotView] = []
    if isinstance(raw, list):
        for item in raw[:MAX_SLOTS]:
            s = _slot(item, m)
            if s is not None:
                out.append(s)
    if out or m is None:
        return tuple(out)
    # No slot list in /health: the per-slot KV gauges still say how full each is.
    totals = m.by_label("slmguard_kv_cells_total", "slot")
    used = m.by_label("slmguard_kv_cells_used", "slot")
    for key in sorted(set(totals) | set(used), key=lambda k: (len(k), k))[:MAX_SLOTS]:
        if key.isdigit():
            t, u = totals.get(key), used.get(key)
            out.append(
                SlotView(
                    int(key),
                    None,
                    None if t is None else int(t),
                    None,
                    None,
                    None if u is None else int(u),
                )
            )
    return tuple(out)


# ---------------------------------------------------------------- engine


def _rate(now: float | None, before: float | None, dt_s: float | None) -> float | None:
    if now is None or before is None or not dt_s or dt_s <= 0 or now < before:
        return None
    return (now - before) / dt_s


def _own(m: Metrics, model: str | None, name: str) -> float | None:
    """``name``'s value for ``model`` on a board (its ``model`` label), else the first."""
    if model is not None:
        v = m.value(name, model=model)
        if v is not None:
            return v
    return m.first(name)


def _speeds(
    m: Metrics | None,
    totals: tuple[float | None, float | None],
    prev: EngineView | None,
    dt_s: float | None,
    primary: str | None = None,
) -> tuple[float | None, float | None, str | None]:
    """Prompt and decode speeds and their source: see the module's docstring for the order."""
    if m is None:
        return None, None, None
    prompt = _own(m, primary, "slmguard_prompt_tokens_per_second")
    decode = _own(m, primary, "slmguard_decode_tokens_per_second")
    if prompt is not None or decode is not None:
        return prompt, decode, "server"
    prompt = m.first("llamacpp:prompt_tokens_seconds")
    decode = m.first("llamacpp:predicted_tokens_seconds")
    if prompt is not None or decode is not None:
        return prompt, decode, "engine"
    if prev is not None:
        prompt = _rate(totals[0], prev.prompt_tokens_total, dt_s)
        decode = _rate(totals[1], prev.decoded_tokens_total, dt_s)
        if prompt is not None or decode is not None:
            return prompt, decode, "counters"
    return None, None, None


def _outcomes(m: Metrics | None) -> tuple[int | None, int | None, int | None]:
    """Requests answered, refused with 429 and with 503 (None: the server counts none)."""
    if m is None or not m.has("slmguard_requests_total"):
        return None, None, None
    # Declared: no samples yet means none counted.
    outcomes = m.by_label("slmguard_requests_total", "outcome")
    return (
        int(outcomes.get("ok", 0)),
        int(outcomes.get("rejected_queue_full", 0)),
        int(outcomes.get("unavailable", 0)),
    )


def _rss(mem: Mapping[str, Any], name: str) -> int | None:
    """``memory.engine_<name>``, else the older ``memory.worker_<name>``."""
    return _int(_first(mem.get(f"engine_{name}"), mem.get(f"worker_{name}")))


def engine_view(
    health: Mapping[str, Any],
    m: Metrics | None,
    prev: EngineView | None = None,
    dt_s: float | None = None,
) -> EngineView:
    eng = _dict(health.get("engine"))
    mem = _dict(health.get("memory"))
    # The prompt and decoded token counters: llama.cpp's, else the server's.
    prompt_total = decoded_total = None
    if m is not None:
        prompt_total = m.first("llamacpp:prompt_tokens_total", "slmguard_prompt_tokens_total")
        decoded_total = m.first(
            "llamacpp:tokens_predicted_total", "slmguard_completion_tokens_total"
        )
    model = _str(health.get("model"))
    speeds = _speeds(m, (prompt_total, decoded_total), prev, dt_s, model)
    prompt_speed, decode_speed, source = speeds
    busy = health.get("busy")
    busy_n = int(busy) if isinstance(busy, bool) else _int(busy)
    ok, r429, r503 = _outcomes(m)
    reasons = {str(k)[:40]: str(v)[:300] for k, v in _dict(health.get("degraded_reasons")).items()}
    return EngineView(
        state=_str(health.get("state"), 40),
        model=_str(health.get("model")),
        model_path=_str(health.get("model_path"), 1000),
        version=_str(eng.get("version")),
        pid=_int(_first(eng.get("pid"), health.get("worker_pid"))),
        restarts=_first(
            _int(_first(eng.get("restarts"), health.get("worker_restarts"))),
            _metric_int(m, "slmguard_engine_restarts_total", "slmguard_worker_restarts_total"),
        ),
        stalls=_first(_int(eng.get("stalls")), _metric_int(m, "slmguard_engine_stalls_total")),
        n_ctx_cells=_int(_first(eng.get("n_ctx"), health.get("n_ctx"))),
        n_parallel=_int(eng.get("n_parallel")),
        n_ctx_slot_cells=_int(eng.get("n_ctx_slot")),
        queue_depth=_first(_int(health.get("queue_depth")), _metric_int(m, "slmguard_queue_depth")),
        busy=busy_n if busy_n is not None else _metric_int(m, "llamacpp:requests_processing"),
        slots=_slots(health, m),
        rss_bytes=_rss(mem, "rss_bytes"),
        rss_anon_bytes=_rss(mem, "rss_anon_bytes"),
        rss_file_bytes=_rss(mem, "rss_file_bytes"),
        front_rss_bytes=_int(mem.get("front_rss_bytes")),
        prompt_tokens_per_s=prompt_speed,
        decode_tokens_per_s=decode_speed,
        speed_source=source,
        prompt_tokens_total=prompt_total,
        decoded_tokens_total=decoded_total,
        requests_ok=ok,
        rejected_429=r429,
        unavailable_503=r503,
        degraded_reasons=reasons,
    )


def models_view(
    health: Mapping[str, Any], status: Mapping[str, Any] | None
) -> tuple[ModelView, ...]:
    """A board's models from /health's ``models[]`` (none for one model), each with the
    governor's context and parking of it from its status."""
    raw = health.get("models")
    if not isinstance(raw, list):
        return ()
    governed = {
        str(g.get("model")): g for g in (status or {}).get("models") or () if isinstance(g, dict)
    }
    out = []
    for item in raw[:MAX_MODELS]:
        d = _dict(item)
        name = _str(d.get("model"), 256)
        if name is None:
            continue
        eng, mem, gov = _dict(d.get("engine")), _dict(d.get("memory")), _dict(governed.get(name))
        out.append(
            ModelView(
                name=name, state=_str(d.get("state"), 40), residency=_str(d.get("residency"), 20),
                priority=_int(d.get("priority")), pid=_int(eng.get("pid")),
                restarts=_int(eng.get("restarts")), rss_bytes=_rss(mem, "rss_bytes"),
                rss_anon_bytes=_rss(mem, "rss_anon_bytes"),
                queue_depth=_int(d.get("queue_depth")), in_flight=_int(d.get("in_flight")),
                n_ctx_slot_cells=_int(eng.get("n_ctx_slot")),
                n_parallel=_int(eng.get("n_parallel")), n_ctx_cells=_int(gov.get("n_ctx")),
                n_ctx_full_cells=_int(gov.get("n_ctx_full")), parked=_bool(gov.get("parked")),
            )
        )  # fmt: skip
    return tuple(out)


# ---------------------------------------------------------------- governor


def _when(value: Any) -> float | None:
    """A transition's time: unix seconds, or an ISO-8601 UTC string ``...Z``."""
    n = _num(value)
    if n is not None:
        return n
    if isinstance(value, str):
        try:
            parsed = time.strptime(value[:19], "%Y-%m-%dT%H:%M:%S")
        except ValueError:
            return None
        return float(calendar.timegm(parsed))
    return None


def _transitions(status: Mapping[str, Any]) -> tuple[TransitionView, ...]:
    raw = _first(status.get("transitions"), status.get("recent_transitions"))
    if not isinstance(raw, list):
        return ()
    out = []
    for item in raw[-MAX_TRANSITIONS:]:
        d = _dict(item)
        a, b = (
            _str(_first(d.get("from_level"), d.get("from")), 20),
            _str(_first(d.get("to_level"), d.get("to")), 20),
        )
        if a is None or b is None:
            continue
        out.append(
            TransitionView(
                from_level=a,
                to_level=b,
                reason=_str(d.get("reason")),
                pressure_pct=_num(d.get("pressure_pct")),
                at_unix_s=_when(_first(d.get("at_unix_s"), d.get("unix_s"), d.get("time"))),
            )
        )
    return tuple(out)


def _resize(value: Any) -> ResizeView | None:
    d = _dict(value)
    a, b = _int(d.get("n_ctx_from")), _int(d.get("n_ctx_to"))
    if a is None or b is None:
        return None
    return ResizeView(
        a,
        b,
        _int(d.get("predicted_delta_bytes")),
        _int(d.get("measured_delta_bytes")),
        _bool(d.get("ok")),
    )


def _metric_level(m: Metrics) -> str | None:
    levels = m.by_label("slmguard_governor_level", "level")
    return next((k for k, v in levels.items() if v >= 1.0), None)


def _governor_from_status(status: Mapping[str, Any]) -> GovernorView:
    """Everything ``/api/v1/governor`` says."""
    sig = _dict(status.get("signal"))
    th = _dict(status.get("thresholds"))
    counters = _dict(status.get("counters"))
    return GovernorView(
        source="status",
        enabled=_bool(status.get("enabled")),
        **_summary_fields(status),
        level_for_s=_num(status.get("level_for_s")),
        n_ctx_floor_cells=_int(status.get("n_ctx_floor")),
        parked=_bool(status.get("parked")),
        working_set_bytes=_int(sig.get("working_set_bytes")),
        device_bytes=_int(sig.get("device_bytes")),
        device_source=_str(sig.get("device_source"), 40),
        limit_bytes=_int(sig.get("limit_bytes")),
        limit_source=_str(sig.get("limit_source"), 40),
        psi_some_avg10_pct=_num(sig.get("psi_some_avg10_pct")),
        shed_pct=_num(th.get("shed_pct")),
        degrade_pct=_num(th.get("degrade_pct")),
        critical_pct=_num(th.get("critical_pct")),
        recover_pct=_num(th.get("recover_pct")),
        max_tokens_cap=_int(status.get("max_tokens_cap")),
        rejections=_count_map(counters.get("rejections")),
        degradations=_count_map(counters.get("degradations")),
        transitions_total=_count_map(counters.get("transitions")),
        recent=_transitions(status),
        last_resize=_resize(status.get("last_resize")),
        heat=_heat(status.get("thermal")),
        **_recycle_fields(_dict(status.get("leaks"))),
    )


def _heat(value: Any) -> HeatView | None:
    """``thermal`` of /api/v1/governor: the level, what it admits, the hottest zone."""
    t = _dict(value)
    if not t:
        return None
    listed = t.get("zones")
    zones = [z for z in (listed if isinstance(listed, list) else [])[:64] if isinstance(z, dict)]
    rooms = [(r, z) for z in zones if (r := _num(z.get("room_c"))) is not None]
    hottest = min(rooms, key=lambda rz: rz[0])[1] if rooms else {}
    missing = t.get("zones_missing")
    return HeatView(
        level=_str(t.get("level"), 20),
        level_for_s=_num(t.get("level_for_s")),
        slots=_int(t.get("slots")),
        planned_slots=_int(t.get("planned_slots")),
        max_tokens_cap=_int(t.get("max_tokens_cap")),
        shedding=_bool(t.get("shedding")),
        zone=_str(hottest.get("type"), 64),
        temp_c=_num(hottest.get("temp_c")),
        limit_c=_num(hottest.get("limit_c")),
        firmware=_str(t.get("firmware"), 120),
        zones_missing=tuple(
            s for m in (missing if isinstance(missing, list) else [])[:16] if (s := _str(m, 64))
        ),
        watched=len(zones),
    )


def _summary_fields(d: Mapping[str, Any]) -> dict[str, Any]:
    """What /api/v1/governor and /health's governor summary both say, by the same keys."""
    return {
        "level": _str(d.get("level"), 20),
        "pressure_pct": _num(d.get("pressure_pct")),
        "n_ctx_cells": _int(d.get("n_ctx")),
        "n_ctx_full_cells": _int(d.get("n_ctx_full")),
    }


def _recycle_fields(rec: Mapping[str, Any]) -> dict[str, Any]:
    """The leak check's summary (/api/v1/governor's ``leaks``, /health's ``recycle``)."""
    last = _dict(rec.get("last"))
    said = None
    if last:
        drift, bound = _int(last.get("drift_bytes")), _int(last.get("bound_bytes"))
        said = (
            f"engine recycled for a leak: drift {(drift or 0) / (1 << 20):.1f} MiB over "
            f"{_int(last.get('requests'))} requests (bound {(bound or 0) / (1 << 20):.1f} MiB), "
            f"pid {_int(last.get('pid_before'))} -> {_int(last.get('pid_after'))}"
        )
    return {
        "recycles": _int(rec.get("count")),
        "engine_drift_bytes": _int(rec.get("engine_drift_bytes")),
        "front_drift_bytes": _int(rec.get("front_drift_bytes")),
        "drift_bound_bytes": _int(rec.get("bound_bytes")),
        "last_recycle": said,
    }


def _with_metrics(view: GovernorView, m: Metrics) -> GovernorView:
    """/health's governor summary completed by the ``slmguard_governor_*`` metrics."""
    transitions = {
        f"{s.label('from_level')}->{s.label('to_level')}": int(s.value)
        for s in m.all("slmguard_governor_transitions_total")
        if s.label("from_level") and s.label("to_level")
    }
    parked = m.first("slmguard_governor_parked")
    ws = m.first("slmguard_governor_working_set_bytes")
    device = m.first("slmguard_governor_device_bytes")
    limit = m.first("slmguard_governor_limit_bytes")
    n_ctx = m.first("slmguard_governor_n_ctx")
    pressure = m.first("slmguard_governor_pressure_pct")
    return GovernorView(
        source=view.source,
        level=view.level or _metric_level(m),
        pressure_pct=view.pressure_pct if view.pressure_pct is not None else pressure,
        n_ctx_cells=view.n_ctx_cells if view.n_ctx_cells is not None else _int(n_ctx),
        n_ctx_full_cells=view.n_ctx_full_cells,
        parked=None if parked is None else parked >= 1.0,
        working_set_bytes=_int(ws),
        device_bytes=_int(device),
        limit_bytes=_int(limit),
        psi_some_avg10_pct=m.first("slmguard_governor_psi_some_avg10_pct"),
        rejections={
            k: int(v) for k, v in m.by_label("slmguard_governor_rejections_total", "reason").items()
        },
        degradations={
            k: int(v) for k, v in m.by_label("slmguard_governor_degradations_total", "kind").items()
        },
        transitions_total=transitions,
        recycles=view.recycles
        if view.recycles is not None
        else _int(m.first("slmguard_governor_recycles_total")),
        engine_drift_bytes=view.engine_drift_bytes,
        front_drift_bytes=view.front_drift_bytes,
        drift_bound_bytes=view.drift_bound_bytes,
        last_recycle=view.last_recycle,
    )


def governor_view(
    status: Mapping[str, Any] | None, health: Mapping[str, Any], m: Metrics | None
) -> GovernorView:
    """From the status JSON when we have it, else /health's summary, else the metrics."""
    hg = _dict(_dict(health.get("extra")).get("governor"))
    if status:
        return _governor_from_status(status)
    if not hg and m is None:
        return GovernorView()
    view = GovernorView(
        source="health" if hg else "metrics",
        **_summary_fields(hg),
        **_recycle_fields(_dict(hg.get("recycle"))),
    )
    return view if m is None else _with_metrics(view, m)


# ---------------------------------------------------------------- all of it


def _answer(
    fetch: Fetch | None, kind: type, not_kind: str, key_flag: str
) -> tuple[Any, str | None]:
    """A call's body if it answered 2xx with a ``kind`` (else None), and what went wrong
    (None: nothing, or the call was not made); a 401 names the flag that gives the key."""
    if fetch is None:
        return None, None
    if fetch.ok and isinstance(fetch.body, kind):
        return fetch.body, None
    error = fetch.problem() or not_kind
    if fetch.status == 401:
        error += f" (give {key_flag})"
    return None, error


def server_view(
    url: str,
    health: Fetch,
    metrics: Fetch | None,
    governor: Fetch | None,
    prev: ServerView | None = None,
    dt_s: float | None = None,
) -> ServerView:
    """One ServerView from the three answers (``None``: that call was not made)."""
    if not health.answered:
        return ServerView(url=url, reachable=False, error=health.problem())
    body = _dict(health.body)
    text, metrics_error = _answer(metrics, str, "not Prometheus text", "--api-key-file")
    m = None if text is None else parse_metrics(text)
    status, governor_error = _answer(governor, dict, "not a JSON object", "--admin-token-file")
    return ServerView(
        url=url,
        reachable=True,
        health_status=health.status,
        error=None if body else f"/health: {health.problem() or 'not a JSON object'}",
        metrics_error=metrics_error,
        governor_error=governor_error,
        latency_ms=round(health.elapsed_s * 1000.0, 1),
        engine=engine_view(body, m, prev.engine if prev else None, dt_s),
        governor=governor_view(status, body, m),
        models=models_view(body, status),
    )
