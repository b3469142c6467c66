"""The plan: one versioned schema, written by ``plan``, read by everyone else.

``slmguard plan --json`` writes a :class:`Plan`; ``render``, ``apply``,
``serve``, ``doctor`` and ``watch`` read it with ``--plan FILE`` through
:func:`load_plan`, the one reader. This module owns the schema (frozen
dataclasses, byte counts in ``*_bytes`` fields), its JSON form and its
validation; it does no arithmetic (that is ``budget`` and ``planner``).

Validation is declared once, next to each field, as its :func:`rule` (range,
choices, pattern, path, length, items), plus the few relations between
fields (:data:`RELATIONS`: memory limits ordered and within the board's RAM,
watermarks ordered, n_ubatch <= n_batch, CPU lists within board.cpus). A plan
file is untrusted input: the JSON reader bounds the file size, nesting depth
and integer size, refuses NaN and duplicate keys, and every violation is a
:class:`ConfigError` (exit 78) naming the file and the field path, e.g.
``plan.engine.n_threads: 1000000 is above 4096``. No string may hold a
control character; the deploy code escapes what remains for each format.

Versioning: ``schema`` is ``"slmguard.plan/<major>"``. A reader accepts its own
major version and ignores unknown keys (minor additions); a different major is
refused with a :class:`ConfigError` naming both versions. Version 2 (this one)
records a planned file's absolute path, ``file_bytes`` and ``sha256``, which
``serve`` checks at start; a version 1 plan is refused: re-run ``slmguard plan``.
``first_start`` (the parts only a cold first start holds, :data:`FIRST_START_PARTS`)
and ``budget_inputs`` (what the budget was computed from, :class:`BudgetInputs`) are
such minor additions: a plan without them has none.

Example::

    plan = load_plan(Path("plan.json"))
    plan.engine.n_ctx, plan.limits.memory_max_bytes
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from slmguard import regularfile
from slmguard.errors import ConfigError
from slmguard.plan.bounds import BOUNDS, MAX_NAME_CHARS
from slmguard.plan.planjson import parse_plan_json
from slmguard.plan.text import problem, shown

SCHEMA_MAJOR = 2
SCHEMA = f"slmguard.plan/{SCHEMA_MAJOR}"

# The ranges the fields below declare. Bytes: up to 1 PiB; CPUs: Linux's
# NR_CPUS is at most 8192 on arm64, 4096 covers every board and server here.
MAX_BYTES = 1 << 50
MIN_RAM_BYTES = 16 << 20
MAX_CPU = 4095
MAX_THREADS = 4096
MAX_BATCH = 1 << 16
MAX_PARALLEL = 256
MAX_PATH_CHARS = 4096  # PATH_MAX
KV_TYPES = ("f16", "q8_0", "q4_0")
ARCH_PATTERN = r"[a-z0-9][a-z0-9_.-]{0,63}"
SHA256_PATTERN = r"[0-9a-f]{64}"
GROUP_PATTERN = r"[A-Za-z_][A-Za-z0-9_.-]{0,31}"  # useradd's portable group names
BACKENDS = ("cpu", "vulkan", "cuda")
#: The instruction-set families the CPU backend repacks weights for (allocation.REPACK_RULES).
ISAS = ("x86_avx2", "x86_avx512", "arm_dotprod", "arm_i8mm", "none")
# llama-server's device names (`--list-devices`: Vulkan0, CUDA0) or "none" (no device)
DEVICE_PATTERN = r"[A-Za-z][A-Za-z0-9_]{0,31}"
#: The parts only a cold first start holds (``Plan.first_start``), never in ``Plan.budget``:
#: a Vulkan engine's shader compilation when Mesa's shader cache is empty or unwritable.
FIRST_START_PARTS = ("gpu_shader_compile",)

# The plan reader's own bound: a plan is a few KB (the JSON's: plan.planjson).
MAX_PLAN_FILE_BYTES = 1 << 20


@dataclass(frozen=True)
class Rule:
    """What a plan field may hold beyond its type, declared next to the field.

    Numbers: ``lo``/``hi`` (inclusive). Strings: ``choices``, ``pattern`` (the
    whole string), ``path`` (absolute, no ``..``; ``under`` a prefix), else
    printable text of at most ``max_chars`` (``empty_ok`` to allow ""); no
    string may hold a control character. Tuples and dicts: ``min_items``,
    ``max_items``, ``unique``; their elements (dict values) follow the rest.
    """

    lo: float | None = None
    hi: float | None = None
    choices: tuple[str, ...] | None = None
    pattern: str | None = None
    path: bool = False
    under: str | None = None
    max_chars: int = 256
    empty_ok: bool = False
    min_items: int = 0
    max_items: int = MAX_CPU + 1
    unique: bool = False


def rule(**limits: Any) -> dict[str, Rule]:
    """Field metadata: ``field(metadata=rule(lo=1, hi=4096))``."""
    return {"rule": Rule(**limits)}


@dataclass(frozen=True)
class ModelSpec:
    """What was planned for: a GGUF file (``path``, absolute, with its ``file_bytes`` and
    ``sha256``, checked by ``serve`` at start) or a preset (no file yet: ``render``,
    ``apply`` and ``serve`` need ``--model FILE``, checked against the preset)."""

    name: str = field(metadata=rule(max_chars=MAX_NAME_CHARS))
    arch: str = field(metadata=rule(pattern=ARCH_PATTERN))
    file_bytes: int = field(metadata=rule(lo=0, hi=MAX_BYTES))
    n_layer: int = field(metadata=rule(lo=1, hi=BOUNDS["n_layer"].hi))
    n_ctx_train: int = field(metadata=rule(lo=1, hi=BOUNDS["n_ctx_train"].hi))
    path: str | None = field(default=None, metadata=rule(path=True))
    preset: str | None = field(default=None, metadata=rule(max_chars=128))
    quant: str | None = field(default=None, metadata=rule(max_chars=32))
    sha256: str | None = field(default=None, metadata=rule(pattern=SHA256_PATTERN))


@dataclass(frozen=True)
class BoardSpec:
    """The target board as the plan saw it."""

    name: str = field(metadata=rule(max_chars=128))
    ram_bytes: int = field(metadata=rule(lo=MIN_RAM_BYTES, hi=MAX_BYTES))
    cpus: tuple[int, ...] = field(metadata=rule(lo=0, hi=MAX_CPU, min_items=1, unique=True))
    big_cores: tuple[int, ...] = field(metadata=rule(lo=0, hi=MAX_CPU, unique=True))
    npu_reserve_bytes: int = field(default=0, metadata=rule(lo=0, hi=MAX_BYTES))
    device_nodes: tuple[str, ...] = field(
        default=(), metadata=rule(path=True, under="/dev/", max_items=64)
    )
    device_groups: tuple[str, ...] = field(
        default=(), metadata=rule(pattern=GROUP_PATTERN, max_items=64)
    )
    # e.g. /boot/armbianEnv.txt where cma= goes
    boot_file: str | None = field(default=None, metadata=rule(path=True))


@dataclass(frozen=True)
class EngineSettings:
    """The llama-server parameters the server must start its engine with.

    ``n_ctx`` is the whole KV cache in cells (llama-server's ``-c``): with
    ``kv_unified`` the ``n_parallel`` slots share it, otherwise each slot gets
    ``n_ctx // n_parallel``. ``cache_ram_mib`` is ``--cache-ram`` (0: no prompt
    cache in RAM; llama-server's own default of 8192 MiB grows RSS silently).
    ``llama_server`` is the engine binary to run (None: the one slmguard finds).

    Offload: ``n_gpu_layers`` layers (0 none, ``n_layer + 1`` all with the output
    layer) are on ``device`` (``Vulkan0``, ``CUDA0``; ``none``: no device at all, so
    a GPU build allocates nothing there; None: the binary's default) of
    ``backend`` (``cpu``, ``vulkan``, ``cuda``: what the binary must have), with
    the KV cache of those layers on the device unless ``kv_offload`` is False.
    """

    n_ctx: int = field(metadata=rule(lo=1, hi=BOUNDS["n_ctx_train"].hi))
    n_batch: int = field(metadata=rule(lo=1, hi=MAX_BATCH))
    n_ubatch: int = field(metadata=rule(lo=1, hi=MAX_BATCH))
    n_threads: int = field(metadata=rule(lo=1, hi=MAX_THREADS))
    kv_type: str = field(default="f16", metadata=rule(choices=KV_TYPES))
    use_mmap: bool = True
    use_mlock: bool = False
    swa_full: bool = True  # the budget assumes full-size SWA layers unless told otherwise
    # llama-server -np: slots decoding concurrently
    n_parallel: int = field(default=1, metadata=rule(lo=1, hi=MAX_PARALLEL))
    kv_unified: bool = False  # --kv-unified: one KV buffer shared by the slots
    flash_attn: bool = False  # -fa on|off (a quantized V cache needs it on)
    cache_ram_mib: int = field(default=0, metadata=rule(lo=0, hi=MAX_BYTES >> 20))  # --cache-ram
    # The binary to run: not a budget input (serve checks it is the one it selects).
    llama_server: str | None = field(default=None, metadata={**rule(path=True), "budgeted": False})
    # Offload (issue 25). A plan without these fields is CPU-only.
    # --n-gpu-layers: layers on the device; n_layer + 1 puts the output layer there too.
    n_gpu_layers: int = field(default=0, metadata=rule(lo=0, hi=BOUNDS["n_layer"].hi + 1))
    device: str | None = field(default=None, metadata=rule(pattern=DEVICE_PATTERN))  # --device
    kv_offload: bool = True  # False: --no-kv-offload, the KV cache stays in host memory
    backend: str = field(default="cpu", metadata=rule(choices=BACKENDS))  # what the binary needs

    @property
    def n_ctx_slot(self) -> int:
        """Cells one slot may use: all of them when unified, its share otherwise."""
        return self.n_ctx if self.kv_unified else self.n_ctx // max(1, self.n_parallel)


def budgeted_fields() -> tuple[str, ...]:
    """The :class:`EngineSettings` fields the memory budget depends on, in their order."""
    return tuple(
        f.name for f in dataclasses.fields(EngineSettings) if f.metadata.get("budgeted", True)
    )


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

    name: str = field(metadata=rule(max_chars=64))
    bytes: int = field(metadata=rule(lo=0, hi=MAX_BYTES))
    when: str = field(default="load", metadata=rule(choices=("load", "use")))
    kind: str = field(default="anon", metadata=rule(choices=("anon", "file", "device", "reserve")))
    note: str = field(default="", metadata=rule(max_chars=1024, empty_ok=True))


@dataclass(frozen=True)
class Limits:
    """cgroup limits for the inference zone and the reserves beside it
    (``memory_high_bytes <= memory_max_bytes <= board.ram_bytes``).

    ``device_bytes`` is the DRAM the plan gives the engine's offloaded buffers
    outside its cgroup (nvmap, Mali kbase, DMA-BUF: drivers that do not charge the
    cgroup): MemoryMax is that much lower, and the governor counts those buffers
    with the cgroup against ``memory_high_bytes + device_bytes``. 0 when nothing is
    offloaded or the driver charges the buffers to the cgroup (lavapipe, v3d, panthor).
    """

    memory_high_bytes: int = field(metadata=rule(lo=1, hi=MAX_BYTES))
    memory_max_bytes: int = field(metadata=rule(lo=1, hi=MAX_BYTES))
    os_reserve_bytes: int = field(metadata=rule(lo=0, hi=MAX_BYTES))
    business_reserve_bytes: int = field(default=0, metadata=rule(lo=0, hi=MAX_BYTES))
    device_bytes: int = field(default=0, metadata=rule(lo=0, hi=MAX_BYTES))


@dataclass(frozen=True)
class Watermarks:
    """Governor thresholds, as percent of the effective memory limit
    (``0 < recover < shed <= degrade <= critical <= 100``)."""

    shed_pct: float = field(default=85.0, metadata=rule(lo=0, hi=100))
    degrade_pct: float = field(default=92.0, metadata=rule(lo=0, hi=100))
    critical_pct: float = field(default=97.0, metadata=rule(lo=0, hi=100))
    recover_pct: float = field(default=80.0, metadata=rule(lo=0, hi=100))


@dataclass(frozen=True)
class KernelSettings:
    """sysctl and boot settings the plan asks for, within the kernel's ranges
    (``Documentation/admin-guide/sysctl/vm.rst``: swappiness 0-200 since Linux 5.8)."""

    swappiness: int = field(default=0, metadata=rule(lo=0, hi=200))
    overcommit_memory: int = field(default=2, metadata=rule(lo=0, hi=2))
    overcommit_ratio: int = field(default=80, metadata=rule(lo=0, hi=100))
    commit_charge_bytes: int = field(default=0, metadata=rule(lo=0, hi=MAX_BYTES))
    cma_bytes: int | None = field(default=None, metadata=rule(lo=0, hi=MAX_BYTES))


@dataclass(frozen=True)
class BudgetBoard:
    """What the memory budget takes from the board beside the engine's settings: the ISA
    family the CPU backend repacks weights for, the CPUs the engine sees (they size its
    HTTP pool) and the reserves beside the service."""

    isa: str = field(metadata=rule(choices=ISAS))
    n_cpus: int = field(metadata=rule(lo=1, hi=MAX_CPU + 1))
    npu_reserve_bytes: int = field(default=0, metadata=rule(lo=0, hi=MAX_BYTES))
    os_reserve_bytes: int = field(default=0, metadata=rule(lo=0, hi=MAX_BYTES))
    business_reserve_bytes: int = field(default=0, metadata=rule(lo=0, hi=MAX_BYTES))


@dataclass(frozen=True)
class BudgetGpu:
    """The GPU an engine is built for, as the budget sees it: the build's backend (a
    Vulkan build creates its instance even with ``--device none``), whether the device's
    buffers are the process's own memory (lavapipe) and the largest tensor they hold."""

    backend: str = field(metadata=rule(choices=BACKENDS[1:]))
    process_memory: bool = False
    max_tensor_bytes: int | None = field(default=None, metadata=rule(lo=1, hi=MAX_BYTES))


@dataclass(frozen=True)
class BudgetInputs:
    """What a plan's budget was computed from besides the model and ``plan.engine``: the
    board's side and the GPU's (None: a CPU-only build). ``serve`` re-budgets a plan for
    its flags from these as they are. Plans from before they were recorded have none."""

    board: BudgetBoard
    gpu: BudgetGpu | None = None


@dataclass(frozen=True)
class Plan:
    model: ModelSpec
    board: BoardSpec
    engine: EngineSettings
    limits: Limits
    budget: tuple[BudgetPart, ...] = field(default=(), metadata=rule(max_items=64))
    # What a cold first start holds beyond the budget (FIRST_START_PARTS): not the steady
    # state the watermarks are for, but within MemoryMax with it. Older plans: none.
    first_start: tuple[BudgetPart, ...] = field(
        default=(), metadata=rule(max_items=len(FIRST_START_PARTS))
    )
    watermarks: Watermarks = field(default_factory=Watermarks)
    kernel: KernelSettings = field(default_factory=KernelSettings)
    # CPUs to pin the service to (a subset of board.cpus; empty: no pinning)
    cpu_affinity: tuple[int, ...] = field(default=(), metadata=rule(lo=0, hi=MAX_CPU, unique=True))
    # one sentence per choice; keys are short names (n_ctx, memory_max, ...)
    reasons: dict[str, str] = field(
        default_factory=dict, metadata=rule(max_chars=4096, max_items=64)
    )
    # What the budget was computed from (a minor addition: older plans have none).
    budget_inputs: BudgetInputs | None = None
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


def _num(x: float) -> str:
    """A number as a message shows it: 4096, 150 (not 150.0), 97.5."""
    return str(int(x)) if float(x).is_integer() else str(x)


def _number(value: float, r: Rule, where: str) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{where}: {value} is not a finite number")
    if r.lo is not None and value < r.lo:
        raise ConfigError(f"{where}: {_num(value)} is below {_num(r.lo)}")
    if r.hi is not None and value > r.hi:
        raise ConfigError(f"{where}: {_num(value)} is above {_num(r.hi)}")


def _string(value: str, r: Rule, where: str) -> None:
    if r.choices is not None:
        if value not in r.choices:
            raise ConfigError(f"{where}: {shown(value)} is not one of {', '.join(r.choices)}")
        return
    limit = MAX_PATH_CHARS if r.path else r.max_chars
    why = problem(value, limit, empty_ok=r.empty_ok)
    if why:
        raise ConfigError(f"{where}: {shown(value)} {why}")
    if r.pattern is not None and not re.fullmatch(r.pattern, value):
        raise ConfigError(f"{where}: {shown(value)} does not match {r.pattern}")
    if r.path:
        if not value.startswith("/"):
            raise ConfigError(f"{where}: {shown(value)} is not an absolute path")
        if ".." in value.split("/"):
            raise ConfigError(f"{where}: {shown(value)} has a '..' component")
        if r.under is not None and not value.startswith(r.under):
            raise ConfigError(f"{where}: {shown(value)} is not under {r.under}")


def _check_value(value: Any, r: Rule, where: str) -> None:
    """``value`` (a built field value) against its rule; raises ConfigError with ``where``."""
    if value is None or isinstance(value, bool):
        return
    if isinstance(value, int | float):
        _number(value, r, where)
    elif isinstance(value, str):
        _string(value, r, where)
    elif isinstance(value, tuple | dict):
        n = len(value)
        if n < r.min_items:
            raise ConfigError(f"{where}: needs at least {r.min_items} entries, has {n}")
        if n > r.max_items:
            raise ConfigError(f"{where}: {n} entries (at most {r.max_items})")
        items = list(value.values()) if isinstance(value, dict) else list(value)
        if r.unique:
            seen: set[str] = set()
            for x in items:
                if repr(x) in seen:
                    raise ConfigError(f"{where}: {shown(x)} appears twice")
                seen.add(repr(x))
        if isinstance(value, dict):
            for k, v in value.items():
                key_rule = Rule(pattern=r"[a-z0-9_.]{1,64}")
                _string(k, key_rule, f"{where} key")
                _check_value(v, r, f"{where}.{k}")
        else:
            for i, x in enumerate(items):
                if not dataclasses.is_dataclass(x):
                    _check_value(x, r, f"{where}[{i}]")


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
            raise ConfigError(f"{where}: expected an object, got {_kind(value)}")
        hints = typing.get_type_hints(tp)
        kwargs = {}
        for f in dataclasses.fields(tp):
            if f.name in value:
                built = _build(hints[f.name], value[f.name], f"{where}.{f.name}")
                r = f.metadata.get("rule")
                if r is not None:
                    _check_value(built, r, f"{where}.{f.name}")
                kwargs[f.name] = built
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigError(f"{where}: missing field {f.name!r}")
        return tp(**kwargs)  # type: ignore[operator]
    if origin is tuple:
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {_kind(value)}")
        (item,) = typing.get_args(tp)[:1]
        return tuple(_build(item, x, f"{where}[{i}]") for i, x in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected an object, got {_kind(value)}")
        _, vt = typing.get_args(tp)
        return {str(k): _build(vt, v, f"{where}.{shown(k, 64)}") for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true/false, got {_kind(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {_kind(value)}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{where}: expected a number, got {_kind(value)}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {_kind(value)}")
        return value
    raise ConfigError(f"{where}: unsupported type {tp!r}")  # pragma: no cover


def _kind(value: Any) -> str:
    """What a JSON value is, for "expected X, got Y" (never the whole value)."""
    if isinstance(value, dict):
        return f"an object of {len(value)} keys"
    if isinstance(value, list):
        return f"a list of {len(value)}"
    return shown(value, 60)


# Relations between fields, checked after every field has passed its own rule.
# Each returns the problem (with the field path) or None.
def _memory_order(p: Plan) -> str | None:
    lim = p.limits
    if lim.memory_high_bytes > lim.memory_max_bytes:
        return (
            f"plan.limits.memory_high_bytes: {lim.memory_high_bytes} is above "
            f"memory_max_bytes {lim.memory_max_bytes}"
        )
    if lim.memory_max_bytes > p.board.ram_bytes:
        return (
            f"plan.limits.memory_max_bytes: {lim.memory_max_bytes} is above the board's "
            f"ram_bytes {p.board.ram_bytes}"
        )
    if lim.memory_max_bytes + lim.device_bytes > p.board.ram_bytes:
        return (
            f"plan.limits.device_bytes: {lim.device_bytes} beside memory_max_bytes "
            f"{lim.memory_max_bytes} is above the board's ram_bytes {p.board.ram_bytes}"
        )
    for name in ("os_reserve_bytes", "business_reserve_bytes"):
        if getattr(lim, name) > p.board.ram_bytes:
            return f"plan.limits.{name}: {getattr(lim, name)} is above the board's RAM"
    if p.board.npu_reserve_bytes > p.board.ram_bytes:
        return f"plan.board.npu_reserve_bytes: {p.board.npu_reserve_bytes} is above its RAM"
    if p.kernel.cma_bytes is not None and p.kernel.cma_bytes > p.board.ram_bytes:
        return f"plan.kernel.cma_bytes: {p.kernel.cma_bytes} is above the board's RAM"
    return None


def _watermark_order(p: Plan) -> str | None:
    w = p.watermarks
    if not 0 < w.recover_pct < w.shed_pct <= w.degrade_pct <= w.critical_pct <= 100:
        return (
            "plan.watermarks: need 0 < recover_pct < shed_pct <= degrade_pct <= critical_pct "
            f"<= 100, got {w.recover_pct:g} / {w.shed_pct:g} / {w.degrade_pct:g} / "
            f"{w.critical_pct:g}"
        )
    return None


def _engine_order(p: Plan) -> str | None:
    e = p.engine
    if e.n_ubatch > e.n_batch:
        return f"plan.engine.n_ubatch: {e.n_ubatch} is above n_batch {e.n_batch}"
    if e.n_parallel > e.n_ctx:
        return f"plan.engine.n_parallel: {e.n_parallel} slots for n_ctx {e.n_ctx}"
    return None


def _offload(p: Plan) -> str | None:
    """Layers on a device need a backend and a device, and exist in the model."""
    e = p.engine
    if e.n_gpu_layers > p.model.n_layer + 1:
        return (
            f"plan.engine.n_gpu_layers: {e.n_gpu_layers} is above the model's "
            f"{p.model.n_layer} layers + the output layer"
        )
    if e.n_gpu_layers and e.backend == "cpu":
        return f"plan.engine.n_gpu_layers: {e.n_gpu_layers} layers offloaded by backend cpu"
    if e.n_gpu_layers and e.device == "none":
        return f"plan.engine.n_gpu_layers: {e.n_gpu_layers} layers offloaded to device none"
    if e.backend == "cpu" and e.device not in (None, "none"):
        return f"plan.engine.device: {e.device} with backend cpu"
    return None


def _first_start(p: Plan) -> str | None:
    """First-start parts are the declared ones, once each, and never in the budget."""
    seen: set[str] = set()
    for i, part in enumerate(p.first_start):
        if part.name not in FIRST_START_PARTS or part.name in seen:
            return (
                f"plan.first_start[{i}].name: {shown(part.name)} is not a first-start part "
                f"({', '.join(FIRST_START_PARTS)}, once each)"
            )
        seen.add(part.name)
    for i, part in enumerate(p.budget):
        if part.name in FIRST_START_PARTS:
            return f"plan.budget[{i}].name: {part.name} is a first-start part (plan.first_start)"
    return None


def _cpu_sets(p: Plan) -> str | None:
    cpus = set(p.board.cpus)
    for name, values in (("board.big_cores", p.board.big_cores), ("cpu_affinity", p.cpu_affinity)):
        extra = sorted(set(values) - cpus)
        if extra:
            return (
                f"plan.{name}: CPU {extra[0]} is not in board.cpus "
                f"({', '.join(map(str, sorted(cpus)))})"
            )
    return None


def _model_source(p: Plan) -> str | None:
    if p.model.path is None and p.model.preset is None:
        return "plan.model: names neither a file (path) nor a preset"
    return None


RELATIONS: tuple[Callable[[Plan], str | None], ...] = (
    _memory_order,
    _watermark_order,
    _engine_order,
    _offload,
    _first_start,
    _cpu_sets,
    _model_source,
)


def check_plan(plan: Plan) -> None:
    """Every field rule and relation, on a plan built in memory (``plan`` checks what it
    writes); :func:`plan_from_dict` does the same while reading."""
    plan_from_dict(json.loads(dumps_plan(plan)))


def plan_from_dict(data: Any) -> Plan:
    if not isinstance(data, dict):
        raise ConfigError(f"plan: expected a JSON object, got {_kind(data)}")
    schema = data.get("schema")
    if not isinstance(schema, str) or not schema.startswith("slmguard.plan/"):
        raise ConfigError(f"not an slmguard plan (schema {shown(schema)}, expected {SCHEMA!r})")
    match = re.fullmatch(r"slmguard\.plan/(\d{1,4})(?:\.\d{1,4})?", schema)
    if match is None:
        raise ConfigError(f"unreadable plan schema {shown(schema)}")
    major = int(match.group(1))
    if major < SCHEMA_MAJOR:
        raise ConfigError(
            f"plan schema {schema!r} is from an older slmguard: re-run `slmguard plan` "
            f"(this one reads {SCHEMA!r}, which records the model file's path, size and "
            "sha256)",
            hint="re-run `slmguard plan` (e.g. slmguard plan --model FILE --json --out plan.json)",
        )
    if major != SCHEMA_MAJOR:
        raise ConfigError(
            f"plan schema {schema!r} is not supported (this slmguard reads {SCHEMA!r})",
            hint="re-run `slmguard plan --json` with this version",
        )
    plan: Plan = _build(Plan, {**data, "schema": SCHEMA}, "plan")
    for relation in RELATIONS:
        why = relation(plan)
        if why:
            raise ConfigError(why)
    return plan


def _read_bytes(path: Path) -> bytes:
    """The file's bytes: a regular file of at most MAX_PLAN_FILE_BYTES, never blocking."""
    try:
        raw = regularfile.read_bounded(path, MAX_PLAN_FILE_BYTES)
    except FileNotFoundError as err:
        raise ConfigError("plan file not found", path=path) from err
    except regularfile.NotRegularFileError as err:
        raise ConfigError(
            f"plan file is {err.kind}, not a regular file",
            path=path,
            hint="write the plan to a file: slmguard plan --json --out plan.json",
        ) from err
    except OSError as err:
        raise ConfigError(f"cannot read plan file: {err.strerror or err}", path=path) from err
    if raw is None:
        raise ConfigError(
            f"plan file is larger than {MAX_PLAN_FILE_BYTES >> 20} MiB (a plan is a few KB)",
            path=path,
        )
    return raw


def _decode(raw: bytes, path: Path | str | None) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"plan file is not UTF-8 (byte {err.start})", path=path) from err


def loads_plan(raw: bytes, path: Path | str | None = None) -> Plan:
    """Validate a plan from its bytes (``path`` only names it in errors)."""
    if len(raw) > MAX_PLAN_FILE_BYTES:
        raise ConfigError(
            f"plan file is larger than {MAX_PLAN_FILE_BYTES >> 20} MiB (a plan is a few KB)",
            path=path,
        )
    try:
        return plan_from_dict(parse_plan_json(_decode(raw, path)))
    except ConfigError as err:
        raise ConfigError(err.message, path=path, hint=err.hint) from err


def load_plan(path: Path) -> Plan:
    """Read and validate a plan file: the one reader every verb uses for ``--plan``.

    Every error is a ConfigError (exit 78) naming the file and, for a bad
    field, its path (``plan.engine.n_threads: 1000000 is above 4096``).
    """
    return loads_plan(_read_bytes(path), path)
