"""A bench run as a record: its figures and, beside them, the state of the board and what ran.

Owns the record (schema ``slmguard.bench/1``, plain JSON): the settings of the run, what
ran (model sha256, plan hash and source, engine binary, version and CPU profile, the CPU
features, the engine's flags), the figures, and the board's state before and after
(:meth:`slmguard.host.boardstate.BoardState.as_dict`: governors, clocks, devfreq, power
mode, temperatures, throttle flags) with the load of the other processes while it ran
(:class:`LoadWindow`: ``/proc/stat`` minus the engine's and the bench's own CPU time).
:func:`missing_state` names the state fields this host could not give. :func:`load_record`
reads a record back for ``--compare``: a file from elsewhere, hostile until validated
(bounded, its schema and every field compare reads checked, errors naming the file).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slmguard import regularfile
from slmguard.errors import ConfigError, HostReadError
from slmguard.host import process
from slmguard.host.boardstate import BoardState
from slmguard.host.cpu import read_proc_stat

SCHEMA = "slmguard.bench/1"
MAX_RECORD_BYTES = 4 << 20


@dataclass(frozen=True)
class CpuMark:
    """CPU time so far: every core's (busy, total) and two processes' own, in ticks."""

    busy_ticks: int
    total_ticks: int
    cpus: int
    engine_ticks: int | None
    self_ticks: int | None


def cpu_mark(root: Path, engine_pid: int | None) -> CpuMark | None:
    """This moment's marks; None where ``/proc/stat`` cannot be read."""
    try:
        stat = read_proc_stat(root)
    except HostReadError:
        return None
    total = stat.get(None)
    if total is None:
        return None
    cpus = sum(1 for k in stat if k is not None) or 1
    engine = process.read_cpu_ticks(root, engine_pid) if engine_pid is not None else None
    return CpuMark(total.busy_ticks, total.total_ticks, cpus, engine, process.read_cpu_ticks(root))


@dataclass(frozen=True)
class LoadWindow:
    """The CPU use between two marks, in cores (1.0: one core busy the whole time)."""

    cpus: int
    busy_cores: float
    engine_cores: float | None
    bench_cores: float | None
    others_cores: float | None  # everything but the engine and the bench itself


def load_window(before: CpuMark | None, after: CpuMark | None) -> LoadWindow | None:
    if before is None or after is None:
        return None
    total = after.total_ticks - before.total_ticks
    if total <= 0:
        return None
    wall = total / after.cpus  # ticks of one core over the window

    def cores(a: int | None, b: int | None) -> float | None:
        return None if a is None or b is None else max(0.0, (b - a) / wall)

    busy = max(0.0, (after.busy_ticks - before.busy_ticks) / wall)
    engine = cores(before.engine_ticks, after.engine_ticks)
    bench = cores(before.self_ticks, after.self_ticks)
    others = None if engine is None or bench is None else max(0.0, busy - engine - bench)
    return LoadWindow(after.cpus, busy, engine, bench, others)


def missing_state(state: BoardState) -> list[str]:
    """The board-state fields this host gave nothing for (a VM lacks most)."""
    lacks = []
    if not any(f.governor or f.hw_max_khz for f in state.cpufreq):
        lacks.append("cpufreq (governors and clocks)")
    if not state.devfreq:
        lacks.append("devfreq (DDR controller, NPU, GPU)")
    if not state.zones:
        lacks.append("thermal zones (temperatures, trip points)")
    if not state.cooling:
        lacks.append("cooling devices")
    if state.power_modes is None:
        lacks.append("power mode (nvpmodel: not a Jetson)")
    if state.pi_flags is None:
        lacks.append("firmware throttle flags (not a Raspberry Pi)")
    if not state.compatible:
        lacks.append("device tree (board identity)")
    return lacks


def planned_engine_bytes(plan_budget: list[dict[str, Any]]) -> int:
    """What the plan budgets for the engine process's resident memory: its anonymous and
    file parts (the front's, named ``front_*``, are another process's)."""
    return sum(
        int(p["bytes"])
        for p in plan_budget
        if p.get("kind") in ("anon", "file") and not str(p.get("name", "")).startswith("front_")
    )


def dumps(record: dict[str, Any]) -> str:
    return json.dumps(record, indent=2, sort_keys=False) + "\n"


# ---------------------------------------------------------------- reading one back


def _get(data: Any, dotted: str, kind: type | tuple[type, ...], where: Path) -> Any:
    value = data
    for key in dotted.split("."):
        if not isinstance(value, dict) or key not in value:
            raise ConfigError(f"not a bench record: no {dotted}", path=where)
        value = value[key]
    if value is not None and not isinstance(value, kind):
        raise ConfigError(f"not a bench record: {dotted} is not a {kind}", path=where)
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"not a bench record: {dotted} is not a finite number", path=where)
    return value


#: What --compare reads, with its type (None allowed where the host said nothing).
FIELDS: dict[str, type | tuple[type, ...]] = {
    "started_unix_s": (int, float),
    "settings.prompt_tokens": int,
    "settings.decode_tokens": int,
    "settings.slots": int,
    "identity.model.sha256": str,
    "identity.plan.sha256": str,
    "identity.engine.version": str,
    "identity.engine.profile": str,
    "identity.engine.flags": list,
    "figures.one_stream.prefill_tokens_per_s": (int, float),
    "figures.one_stream.decode_tokens_per_s": (int, float),
    "figures.one_stream.first_token_s": (int, float),
    "figures.all_slots": dict,
    "figures.memory.engine_peak_bytes": int,
    "figures.memory.planned_engine_bytes": int,
    "state.before": dict,
    "state.after": dict,
    "state.load": dict,
}


def validate(data: Any, where: Path) -> dict[str, Any]:
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise ConfigError(f"not a bench record (schema {SCHEMA} expected)", path=where)
    for dotted, kind in FIELDS.items():
        _get(data, dotted, kind, where)
    return data


def load_record(path: Path) -> dict[str, Any]:
    """A record written by ``slmguard bench --out`` / ``--json``, validated."""
    try:
        raw = regularfile.read_bounded(path, MAX_RECORD_BYTES)
    except OSError as err:
        raise ConfigError(err.strerror or str(err), path=path) from err
    if raw is None:
        raise ConfigError(
            f"larger than {MAX_RECORD_BYTES >> 20} MiB: not a bench record", path=path
        )
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as err:
        raise ConfigError(f"not JSON: {err}", path=path) from err
    return validate(data, path)
