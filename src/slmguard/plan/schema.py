"""The plan: one versioned schema, written by ``plan``, read by everyone else.

``slmguard plan --json`` writes a :class:`Plan`; ``render``, ``apply``,
``serve``, ``doctor`` and ``watch`` read it with ``--plan FILE``. This module
owns the schema (frozen dataclasses, byte counts in ``*_bytes`` fields) and its
JSON form; it does no arithmetic (that is ``budget`` and ``planner``).

Versioning: ``schema`` is ``"slmguard.plan/<major>"``. A reader accepts its own
major version and ignores unknown keys (minor additions); a different major is
refused with a :class:`ConfigError` naming both versions.

Example::

    plan = load_plan(Path("plan.json"))
    plan.engine.n_ctx, plan.limits.memory_max_bytes
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from slmguard.errors import ConfigError

SCHEMA_MAJOR = 1
SCHEMA = f"slmguard.plan/{SCHEMA_MAJOR}"


@dataclass(frozen=True)
class ModelSpec:
    """What was planned for: a GGUF file (``path``, with its size and ``sha256``) or a
    preset (no file yet: ``render``/``apply`` need ``--model FILE``)."""

    name: str
    arch: str
    file_bytes: int
    n_layer: int
    n_ctx_train: int
    path: str | None = None
    preset: str | None = None
    quant: str | None = None
    sha256: str | None = None


@dataclass(frozen=True)
class BoardSpec:
    """The target board as the plan saw it."""

    name: str
    ram_bytes: int
    cpus: tuple[int, ...]
    big_cores: tuple[int, ...]
    npu_reserve_bytes: int = 0
    device_nodes: tuple[str, ...] = ()
    device_groups: tuple[str, ...] = ()
    boot_file: str | None = None  # e.g. /boot/armbianEnv.txt where cma= goes


@dataclass(frozen=True)
class EngineSettings:
    """The llama-server parameters the server must start its engine with.

    ``n_ctx`` is the whole KV cache in cells (llama-server's ``-c``): with
    ``kv_unified`` the ``n_parallel`` slots share it, otherwise each slot gets
    ``n_ctx // n_parallel``. ``cache_ram_mib`` is ``--cache-ram`` (0: no prompt
    cache in RAM; llama-server's own default of 8192 MiB grows RSS silently).
    ``llama_server`` is the engine binary to run (None: the one slmguard finds).
    """

    n_ctx: int
    n_batch: int
    n_ubatch: int
    n_threads: int
    kv_type: str = "f16"  # f16 | q8_0 | q4_0
    use_mmap: bool = True
    use_mlock: bool = False
    swa_full: bool = True  # the budget assumes full-size SWA layers unless told otherwise
    n_parallel: int = 1  # llama-server -np: slots decoding concurrently
    kv_unified: bool = False  # --kv-unified: one KV buffer shared by the slots
    flash_attn: bool = False  # -fa on|off (a quantized V cache needs it on)
    cache_ram_mib: int = 0  # --cache-ram
    llama_server: str | None = None


@dataclass(frozen=True)
class BudgetPart:
    """One named part of the memory budget.

    ``when`` is ``"load"`` for memory resident as soon as the model and context
    exist, ``"use"`` for memory that becomes resident as work touches it.
    ``kind`` is ``"anon"`` (counts against the cgroup as anonymous memory),
    ``"file"`` (page cache of the mapped GGUF, reclaimable), ``"device"``
    (NPU/DMA-BUF/CMA, outside the process) or ``"reserve"`` (memory kept for
    the OS or the business zone, outside the service's cgroup).
    """

    name: str
    bytes: int
    when: str = "load"
    kind: str = "anon"
    note: str = ""


@dataclass(frozen=True)
class Limits:
    """cgroup limits for the inference zone and the reserves beside it."""

    memory_high_bytes: int
    memory_max_bytes: int
    os_reserve_bytes: int
    business_reserve_bytes: int = 0


@dataclass(frozen=True)
class Watermarks:
    """Governor thresholds, as percent of the effective memory limit."""

    shed_pct: float = 85.0
    degrade_pct: float = 92.0
    critical_pct: float = 97.0
    recover_pct: float = 80.0


@dataclass(frozen=True)
class KernelSettings:
    """sysctl and boot settings the plan asks for."""

    swappiness: int = 0
    overcommit_memory: int = 2
    overcommit_ratio: int = 80
    commit_charge_bytes: int = 0
    cma_bytes: int | None = None


@dataclass(frozen=True)
class Plan:
    model: ModelSpec
    board: BoardSpec
    engine: EngineSettings
    limits: Limits
    budget: tuple[BudgetPart, ...] = ()
    watermarks: Watermarks = field(default_factory=Watermarks)
    kernel: KernelSettings = field(default_factory=KernelSettings)
    cpu_affinity: tuple[int, ...] = ()
    reasons: dict[str, str] = field(default_factory=dict)
    schema: str = SCHEMA

    def part(self, name: str) -> BudgetPart | None:
        return next((p for p in self.budget if p.name == name), None)


T = TypeVar("T")


def plan_to_dict(plan: Plan) -> dict[str, Any]:
    def conv(v: Any) -> Any:
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            return {f.name: conv(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, tuple | list):
            return [conv(x) for x in v]
        if isinstance(v, dict):
            return {k: conv(x) for k, x in v.items()}
        return v

    out: dict[str, Any] = conv(plan)
    out = {"schema": plan.schema, **{k: v for k, v in out.items() if k != "schema"}}
    return out


def dumps_plan(plan: Plan) -> str:
    return json.dumps(plan_to_dict(plan), indent=2, sort_keys=False) + "\n"


def _build(tp: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _build(a, value, where)
            except ConfigError as err:
                errors.append(err)
        raise errors[0] if errors else ConfigError(f"{where}: unexpected null")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected an object, got {type(value).__name__}")
        hints = typing.get_type_hints(tp)
        kwargs = {}
        for f in dataclasses.fields(tp):
            if f.name in value:
                kwargs[f.name] = _build(hints[f.name], value[f.name], f"{where}.{f.name}")
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigError(f"{where}: missing field {f.name!r}")
        return tp(**kwargs)  # type: ignore[operator]
    if origin is tuple:
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {type(value).__name__}")
        (item,) = typing.get_args(tp)[:1]
        return tuple(_build(item, x, f"{where}[{i}]") for i, x in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected an object")
        _, vt = typing.get_args(tp)
        return {str(k): _build(vt, v, f"{where}.{k}") for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{where}: unsupported type {tp!r}")  # pragma: no cover


def plan_from_dict(data: Any) -> Plan:
    if not isinstance(data, dict):
        raise ConfigError("plan: expected a JSON object")
    schema = data.get("schema")
    if not isinstance(schema, str) or not schema.startswith("slmguard.plan/"):
        raise ConfigError(f"not an slmguard plan (schema {schema!r}, expected {SCHEMA!r})")
    try:
        major = int(schema.rsplit("/", 1)[1].split(".")[0])
    except ValueError as err:
        raise ConfigError(f"unreadable plan schema {schema!r}") from err
    if major != SCHEMA_MAJOR:
        raise ConfigError(
            f"plan schema {schema!r} is not supported (this slmguard reads {SCHEMA!r})",
            hint="re-run `slmguard plan --json` with this version",
        )
    plan: Plan = _build(Plan, {**data, "schema": SCHEMA}, "plan")
    _check(plan)
    return plan


def _check(plan: Plan) -> None:
    e, lim, w = plan.engine, plan.limits, plan.watermarks
    if e.n_ctx <= 0 or e.n_batch <= 0 or e.n_ubatch <= 0 or e.n_threads <= 0:
        raise ConfigError("plan.engine: n_ctx, n_batch, n_ubatch and n_threads must be > 0")
    if e.kv_type not in ("f16", "q8_0", "q4_0"):
        raise ConfigError(f"plan.engine.kv_type: {e.kv_type!r} is not f16, q8_0 or q4_0")
    if not 0 < lim.memory_high_bytes <= lim.memory_max_bytes:
        raise ConfigError("plan.limits: need 0 < memory_high_bytes <= memory_max_bytes")
    if not 0 < w.recover_pct < w.shed_pct <= w.degrade_pct <= w.critical_pct <= 100:
        raise ConfigError(
            "plan.watermarks: need 0 < recover_pct < shed_pct <= degrade_pct <= critical_pct <= 100"
        )


def load_plan(path: Path) -> Plan:
    """Read and validate a plan file; errors name the file."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError as err:
        raise ConfigError("plan file not found", path=path) from err
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"cannot read plan file: {err}", path=path) from err
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ConfigError(f"not valid JSON (line {err.lineno}: {err.msg})", path=path) from err
    try:
        return plan_from_dict(data)
    except ConfigError as err:
        raise ConfigError(err.message, path=path, hint=err.hint) from err
