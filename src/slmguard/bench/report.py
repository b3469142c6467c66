"""A bench record for people: the figures with the board's state, and two records compared.

Owns :func:`table` (one run: what ran, the figures, the state before and after, what
this host could not read) and :func:`compare` (two runs side by side, the ratio of each
figure, and the recorded state that differs between them: what ran, the settings,
governors, clocks, devfreq, power mode, throttle flags, the hottest zone, the other
processes' load). Both read the plain record (:mod:`slmguard.bench.record`), which may
come from another machine: every value is taken defensively and shortened, never trusted
to have a shape. Pure: text in, text out.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from slmguard.tuning.notes import cpu_list

#: A difference in these is noise, not a different state.
TEMP_SAME_C = 5.0
LOAD_SAME_CORES = 0.5


def _get(data: Any, dotted: str) -> Any:
    for key in dotted.split("."):
        if not isinstance(data, dict):
            return None
        data = data.get(key)
    return data


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _s(value: Any, limit: int = 60) -> str:
    text = "-" if value is None else str(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _rate(value: Any) -> str:
    v = _num(value)
    return "-" if v is None else f"{v:.1f} tok/s"


def _secs(value: Any) -> str:
    v = _num(value)
    return "-" if v is None else f"{v:.2f} s"


def _gib(value: Any) -> str:
    v = _num(value)
    return "-" if v is None else f"{v / (1 << 30):.2f} GiB"


FIGURES: tuple[tuple[str, str, Any], ...] = (
    ("engine load", "figures.load_s", _secs),
    ("one stream: prefill", "figures.one_stream.prefill_tokens_per_s", _rate),
    ("one stream: decode", "figures.one_stream.decode_tokens_per_s", _rate),
    ("one stream: first token", "figures.one_stream.first_token_s", _secs),
    ("all slots: prefill (mean)", "figures.all_slots.prefill_tokens_per_s_mean", _rate),
    ("all slots: decode (mean)", "figures.all_slots.decode_tokens_per_s_mean", _rate),
    ("all slots: tokens/s (wall)", "figures.all_slots.tokens_per_s", _rate),
    ("all slots: first token (max)", "figures.all_slots.first_token_s_max", _secs),
    ("engine peak memory", "figures.memory.engine_peak_bytes", _gib),
    ("  the plan's for the engine", "figures.memory.planned_engine_bytes", _gib),
)


# ---------------------------------------------------------------- the state, as facts


def _cpus(cores: list[int]) -> str:
    return cpu_list(c for c in cores if 0 <= c < 4096)


def _by_policy(cpufreq: Any, key: str) -> dict[str, str]:
    """``key`` of each cpufreq policy (the cores sharing a clock): {"cpu4-5": "schedutil"}."""
    out: dict[str, str] = {}
    for f in cpufreq if isinstance(cpufreq, list) else []:
        if not isinstance(f, dict) or not isinstance(f.get("cpu"), int) or f.get(key) is None:
            continue
        policy = f.get("policy_cpus")
        cores = [c for c in policy if isinstance(c, int)] if isinstance(policy, list) else []
        out.setdefault(f"cpu{_cpus(cores or [f['cpu']])}", _s(f.get(key), 24))
    return out


def _hottest(zones: Any) -> tuple[float | None, str]:
    best: tuple[float | None, str] = (None, "-")
    for z in zones if isinstance(zones, list) else []:
        t = _num(z.get("temp_c")) if isinstance(z, dict) else None
        if t is not None and (best[0] is None or t > best[0]):
            best = (t, _s(z.get("type"), 32))
    return best


def state_facts(state: Any) -> dict[str, str]:
    """One board state (``BoardState.as_dict``) as named, comparable facts."""
    facts: dict[str, str] = {}
    for cpus, gov in _by_policy(_get(state, "cpufreq"), "governor").items():
        facts[f"governor {cpus}"] = gov
    for cpus, khz in _by_policy(_get(state, "cpufreq"), "scaling_max_khz").items():
        facts[f"max clock {cpus}"] = f"{int(khz) / 1000:g} MHz" if khz.isdigit() else khz
    for d in _get(state, "devfreq") or []:
        if isinstance(d, dict):
            hz = _num(d.get("max_hz"))
            mhz = "-" if hz is None else f"{hz / 1e6:.0f} MHz"
            facts[f"devfreq {_s(d.get('name'), 32)}"] = f"{_s(d.get('governor'), 24)}, {mhz}"
    mode = _get(state, "power_mode")
    if isinstance(mode, dict):
        facts["power mode"] = f"{_s(mode.get('id'), 8)} {_s(mode.get('name'), 24)}"
    flags = _get(state, "pi_flags")
    if isinstance(flags, dict):
        facts["Pi throttle flags"] = _s(flags.get("hex"), 12)
    throttled = _get(state, "throttled_cpus")
    if isinstance(throttled, list) and throttled:
        facts["throttled cores"] = _cpus([c for c in throttled if isinstance(c, int)])
    return facts


def _load(record: Any) -> str:
    load = _get(record, "state.load")
    others, cpus = _num(_get(load, "others_cores")), _get(load, "cpus")
    engine = _num(_get(load, "engine_cores"))
    before, after = _get(load, "loadavg_before"), _get(load, "loadavg_after")
    text = "-" if others is None else f"{others:.2f} cores of {_s(cpus, 6)}"
    if engine is not None:
        text += f", the engine {engine:.2f}"
    if isinstance(before, list) and isinstance(after, list) and before and after:
        text += f" (load average {_s(before[0], 8)} -> {_s(after[0], 8)})"
    return text


def identity_facts(record: Any) -> dict[str, str]:
    return {
        "model sha256": _s(_get(record, "identity.model.sha256"), 16),
        "plan sha256": _s(_get(record, "identity.plan.sha256"), 16),
        "plan": _s(_get(record, "identity.plan.source")),
        "engine": _s(_get(record, "identity.engine.version")),
        "engine profile": _s(_get(record, "identity.engine.profile")),
        "engine flags": _s(" ".join(map(str, _get(record, "identity.engine.flags") or [])), 400),
        "prompt, generated tokens": (
            f"{_s(_get(record, 'settings.prompt_tokens'))}, "
            f"{_s(_get(record, 'settings.decode_tokens'))}"
        ),
        "slots": _s(_get(record, "settings.slots")),
    }


# ---------------------------------------------------------------- one run


def _rows(rows: Iterable[tuple[str, ...]]) -> list[str]:
    rows = list(rows)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]


def table(record: Any) -> str:
    """One run for people."""
    ident = identity_facts(record)
    lines = [
        f"slmguard bench: {_s(_get(record, 'identity.plan.board'))} board plan, "
        f"model {ident['model sha256']}, {ident['engine']} ({ident['engine profile']})",
        f"{ident['slots']} slot(s) x {_s(_get(record, 'settings.n_ctx_slot'))} tokens, "
        f"{_s(_get(record, 'settings.threads'))} threads; each stream "
        f"{ident['prompt, generated tokens']} (prompt, generated) tokens",
        "",
    ]
    lines += _rows([("figure", "value"), *((n, f(_get(record, k))) for n, k, f in FIGURES)])
    pct = _num(_get(record, "figures.memory.peak_of_plan_pct"))
    if pct is not None:
        lines.append(f"  (the peak is {pct:.1f} % of the plan's)")
    before = state_facts(_get(record, "state.before"))
    after = state_facts(_get(record, "state.after"))
    t0, z0 = _hottest(_get(record, "state.before.zones"))
    t1, z1 = _hottest(_get(record, "state.after.zones"))
    rows = [("board state", "before", "after")]
    rows += [(k, before.get(k, "-"), after.get(k, "-")) for k in sorted(set(before) | set(after))]
    rows.append(("hottest zone", _temp(t0, z0), _temp(t1, z1)))
    lines += ["", *_rows(rows), f"other processes while it ran: {_load(record)}"]
    lacks = _get(record, "state.lacks")
    if isinstance(lacks, list) and lacks:
        lines.append("this host shows no " + "; no ".join(_s(x) for x in lacks))
    return "\n".join(lines) + "\n"


def _temp(t: float | None, zone: str) -> str:
    return "-" if t is None else f"{t:.1f} °C {zone}"


# ---------------------------------------------------------------- two runs


def differences(a: Any, b: Any) -> list[str]:
    """The recorded state and identity that differ between two records."""
    out = []
    fa = {**identity_facts(a), **state_facts(_get(a, "state.before"))}
    fb = {**identity_facts(b), **state_facts(_get(b, "state.before"))}
    for key in sorted(set(fa) | set(fb), key=lambda k: (k not in identity_facts(a), k)):
        if fa.get(key, "-") != fb.get(key, "-"):
            out.append(f"{key}: {fa.get(key, '-')} | {fb.get(key, '-')}")
    (ta, za), (tb, zb) = (
        _hottest(_get(a, "state.before.zones")),
        _hottest(_get(b, "state.before.zones")),
    )
    if (ta is None) != (tb is None) or (
        ta is not None and tb is not None and abs(ta - tb) >= TEMP_SAME_C
    ):
        out.append(f"hottest zone before: {_temp(ta, za)} | {_temp(tb, zb)}")
    la, lb = _num(_get(a, "state.load.others_cores")), _num(_get(b, "state.load.others_cores"))
    if la is not None and lb is not None and abs(la - lb) >= LOAD_SAME_CORES:
        out.append(f"other processes' load: {la:.2f} | {lb:.2f} cores")
    return out


def compare(a: Any, b: Any, names: tuple[str, str] = ("A", "B")) -> str:
    """Two runs side by side, and the state that differs."""
    rows = [("figure", names[0], names[1], "B/A")]
    for name, key, fmt in FIGURES:
        va, vb = _get(a, key), _get(b, key)
        na, nb = _num(va), _num(vb)
        ratio = f"{nb / na:.2f}" if na and nb is not None else "-"
        rows.append((name, fmt(va), fmt(vb), ratio))
    rows.append(("other processes", _load(a), _load(b), ""))
    diff = differences(a, b)
    lines = [*_rows(rows), ""]
    if diff:
        lines.append("the state that differs (A | B):")
        lines += [f"  - {d}" for d in diff]
    else:
        lines.append("no recorded state differs")
    return "\n".join(lines) + "\n"
