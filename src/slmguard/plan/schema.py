"""The plan's shape: one versioned schema, written by ``plan``, read by everyone else.

Owns the schema: frozen dataclasses (byte counts in ``*_bytes`` fields), each field's
rule declared once next to it (:func:`rule`: range, choices, pattern, path, length,
items; an engine setting's with its flags, :func:`setting`) and the version
(``"slmguard.plan/<major>"``: a reader accepts its own major, ignores unknown keys and
refuses another major with a :class:`ConfigError`). Optional parts (``first_start``,
``budget_inputs``, ``projector``, the board's ``serving``, ``models``, ``neighbours``,
``resident_sets``) are left out of the JSON while empty, so a one-model plan is written
as before; ``docs/plan.md`` (The plan file) describes each field.

It must not do arithmetic (``budget``, ``planner``), check relations between fields
(:mod:`slmguard.plan.relations`) or read and write files
(:mod:`slmguard.plan.planfile`). No string may hold a control character; the deploy
code escapes what remains for each format.

Example::

    plan = load_plan(Path("plan.json"))  # slmguard.plan.planfile
    plan.engine.n_ctx, plan.limits.memory_max_bytes
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from slmguard import options
from slmguard.plan.bounds import BOUNDS, MAX_NAME_CHARS
from slmguard.plan.rules import rule

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
KV_TYPES = ("f16", "q8_0", "q4_0")
ARCH_PATTERN = r"[a-z0-9][a-z0-9_.-]{0,63}"
SHA256_PATTERN = r"[0-9a-f]{64}"
GROUP_PATTERN = r"[A-Za-z_][A-Za-z0-9_.-]{0,31}"  # useradd's portable group names
ZONE_PATTERN = r"[A-Za-z0-9][A-Za-z0-9_.@:+-]{0,63}"  # a thermal zone's type or directory
BACKENDS = ("cpu", "vulkan", "cuda")
#: The instruction-set families the CPU backend repacks weights for (allocation.REPACK_RULES).
ISAS = ("x86_avx2", "x86_avx512", "arm_dotprod", "arm_i8mm", "none")
# llama-server's device names (`--list-devices`: Vulkan0, CUDA0) or "none" (no device)
DEVICE_PATTERN = r"[A-Za-z][A-Za-z0-9_]{0,31}"
#: The parts only a cold first start holds (``Plan.first_start``), never in ``Plan.budget``:
#: a Vulkan engine's shader compilation when Mesa's shader cache is empty or unwritable.
FIRST_START_PARTS = ("gpu_shader_compile",)


def setting(
    default: Any = dataclasses.MISSING,
    *,
    help: str,
    verbs: tuple[str, ...] = (),
    flag: str | None = None,
    old: tuple[str, ...] = (),
    old_values: bool = False,
    shown_default: str | None = None,
    metavar: str | None = None,
    budgeted: bool = True,
    **limits: Any,
) -> Any:
    """An engine setting, declared once: its rule in a plan file (``limits``, as
    :func:`rule`), whether the budget depends on it, and the flag of the ``verbs`` that
    take it (:func:`slmguard.options.metadata`: ``plan`` and ``serve`` derive theirs)."""
    meta = options.metadata(
        help, flag=flag, old=old, old_values=old_values, verbs=verbs,
        choices=limits.get("choices"), shown_default=shown_default, metavar=metavar,
    )  # fmt: skip
    return field(default=default, metadata={**meta, **rule(**limits), "budgeted": budgeted})


#: Field metadata: leave the field out of the JSON while it holds its default (a minor
#: addition to the schema that a plan without it must not show).
OPTIONAL = {"optional": True}


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
    # Thermal zones the governor watches, by type (bigcore0-thermal) or thermal_zoneN
    # (issue 41); empty: every zone with a passive or hot trip point.
    thermal_zones: tuple[str, ...] = field(
        default=(), metadata={**rule(pattern=ZONE_PATTERN, max_items=16), **OPTIONAL}
    )


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

    n_ctx: int = setting(
        help="deprecated: the total context of all slots (llama-server's -c); give --ctx, "
        "the context per slot, instead",
        verbs=("serve",),
        shown_default="planned",
        lo=1,
        hi=BOUNDS["n_ctx_train"].hi,
    )
    n_batch: int = setting(
        help="logical batch size for prompt processing",
        verbs=("serve",),
        shown_default="planned",
        lo=1,
        hi=MAX_BATCH,
    )
    n_ubatch: int = setting(
        help="physical batch size for prompt processing",
        verbs=("serve",),
        shown_default="planned",
        lo=1,
        hi=MAX_BATCH,
    )
    n_threads: int = setting(
        help="engine threads (planned: one per usable big core: the affinity mask and the "
        "cgroup's cpuset, capped by its cpu.max quota)",
        verbs=("serve",),
        shown_default="planned",
        lo=1,
        hi=MAX_THREADS,
    )
    kv_type: str = setting(
        "f16", help="KV cache type", verbs=("serve",), shown_default="planned", choices=KV_TYPES
    )
    use_mmap: bool = setting(
        True,
        help="map the model file instead of reading it",
        verbs=("serve",),
        shown_default="planned",
    )
    use_mlock: bool = setting(
        False, help="lock the model in RAM (mlock)", verbs=("serve",), shown_default="planned"
    )
    # The budget assumes full-size SWA layers unless told otherwise.
    swa_full: bool = setting(
        True,
        help="full-size KV cache for sliding-window layers",
        verbs=("serve",),
        shown_default="planned",
    )
    n_parallel: int = setting(
        1,
        help="engine slots: generations decoded together (llama-server's -np); honoured "
        "or refused with the numbers",
        verbs=("plan", "serve"),
        old=("--slots",),
        shown_default="planned",
        lo=1,
        hi=MAX_PARALLEL,
    )
    kv_unified: bool = setting(
        False,
        help="one KV cache shared by the slots",
        verbs=("plan", "serve"),
        shown_default="planned",
    )
    flash_attn: bool = setting(
        False,
        help="flash attention, -fa (a quantized V cache needs it; planned: on where it "
        "shrinks the compute buffer)",
        verbs=("plan", "serve"),
        old_values=True,
        shown_default="planned",
    )
    cache_ram_mib: int = setting(
        0,
        help="llama-server's prompt cache in RAM, MiB, budgeted in full (0: none; "
        "llama-server's own default grows it by up to 8 GiB)",
        verbs=("plan", "serve"),
        old=("--cache-ram",),
        metavar="MIB",
        shown_default="planned",
        lo=0,
        hi=MAX_BYTES >> 20,
    )
    # The binary to run: not a budget input (serve checks it is the one it selects).
    llama_server: str | None = setting(None, help="the engine binary", budgeted=False, path=True)
    # Offload (issue 25). A plan without these fields is CPU-only.
    n_gpu_layers: int = setting(
        0,
        help="layers on the GPU (-ngl; the output layer counts first, n_layer + 1 is all): "
        "honoured or refused (planned: all that fit)",
        verbs=("plan",),
        flag="--gpu-layers",
        metavar="N",
        shown_default="planned",
        lo=0,
        hi=BOUNDS["n_layer"].hi + 1,
    )
    device: str | None = setting(None, help="llama-server's --device", pattern=DEVICE_PATTERN)
    kv_offload: bool = setting(
        True,
        help="the offloaded layers' KV cache on the GPU (--no-kv-offload: in host memory)",
        verbs=("plan",),
        old_values=True,
        shown_default="planned",
    )
    backend: str = setting("cpu", help="what the binary must be built with", choices=BACKENDS)

    @property
    def n_ctx_slot(self) -> int:
        """Cells one slot may use: all of them when unified, its share otherwise."""
        return self.n_ctx if self.kv_unified else self.n_ctx // max(1, self.n_parallel)


def budgeted_fields() -> tuple[str, ...]:
    """The :class:`EngineSettings` fields the memory budget depends on, in their order."""
    return tuple(
        f.name for f in dataclasses.fields(EngineSettings) if f.metadata.get("budgeted", True)
    )


#: Projector types whose image tokens are fixed by the projector (every image resized to
#: ``image_size`` squared): llama.cpp ignores ``--image-max-tokens`` for them.
FIXED_TOKEN_TYPES = ("gemma3",)
#: The image bounds a projector is planned with unless asked (serve holds each request to
#: the plan's): a 2048 x 2048 picture is 12 MiB once decoded to RGB.
MAX_IMAGE_BYTES = 8 << 20
MAX_IMAGE_SIDE = 4096
MAX_IMAGE_PIXELS = 2048 * 2048
MAX_IMAGES = 2


def _no_flag(**limits: Any) -> dict[str, Any]:
    """A field's rule in a plan file, for a field no verb takes as a flag."""
    return {**rule(**limits), "verbs": ()}


@dataclass(frozen=True)
class ProjectorSpec:
    """A vision projector planned beside the model (llama-server's ``--mmproj``): the
    file (absolute ``path``, ``file_bytes``, ``sha256``, checked by ``serve`` at start
    like the model), the image tokens it makes, where its weights and encoder run
    (``offload``: on the plan's GPU; False: ``--no-mmproj-offload``), the
    ``--image-max-tokens`` planned for a type whose tokens vary (None: not given), and
    the bounds of one request's images the budget holds (serve refuses more, 400)."""

    path: str = field(metadata=_no_flag(path=True))
    file_bytes: int = field(metadata=_no_flag(lo=1, hi=MAX_BYTES))
    name: str = field(metadata=_no_flag(max_chars=MAX_NAME_CHARS))
    projector_type: str = field(metadata=_no_flag(pattern=ARCH_PATTERN))
    tokens_per_image: int = field(metadata=_no_flag(lo=1, hi=MAX_BATCH))
    sha256: str | None = field(default=None, metadata=_no_flag(pattern=SHA256_PATTERN))
    offload: bool = field(default=False, metadata=_no_flag())
    image_max_tokens: int | None = field(default=None, metadata=_no_flag(lo=1, hi=MAX_BATCH))
    max_images: int = setting(
        MAX_IMAGES,
        help="images one request may carry (with --mmproj; each is budgeted while it is "
        "decoded and encoded)",
        verbs=("plan", "serve"), shown_default=f"{MAX_IMAGES}, or the plan's", metavar="N",
        lo=1, hi=64,
    )  # fmt: skip
    max_image_bytes: int = setting(
        MAX_IMAGE_BYTES,
        help="largest image file a request may carry, bytes (with --mmproj)",
        verbs=("plan", "serve"), shown_default=f"{MAX_IMAGE_BYTES}, or the plan's",
        metavar="BYTES", lo=64, hi=1 << 30,
    )  # fmt: skip
    max_image_side: int = setting(
        MAX_IMAGE_SIDE,
        help="largest width or height of an image, pixels, read from its header before it "
        "is decoded (with --mmproj)",
        verbs=("plan", "serve"), shown_default=f"{MAX_IMAGE_SIDE}, or the plan's",
        metavar="PIXELS", lo=1, hi=1 << 16,
    )  # fmt: skip
    max_image_pixels: int = setting(
        MAX_IMAGE_PIXELS,
        help="most pixels of an image, width x height (with --mmproj: a decompression bomb "
        "is refused before it is decoded)",
        verbs=("plan", "serve"), shown_default=f"{MAX_IMAGE_PIXELS}, or the plan's",
        metavar="PIXELS", lo=1, hi=1 << 28,
    )  # fmt: skip

    @property
    def fixed_tokens(self) -> bool:
        """Every image makes :attr:`tokens_per_image` tokens (``--image-max-tokens`` is
        ignored by the engine)."""
        return self.projector_type in FIXED_TOKEN_TYPES


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


# -- A board: several models and the board's other services (issue 39) ------------------
#
# A one-model plan has none of this and its JSON is what it was (plan_to_dict leaves out
# an OPTIONAL field that holds its default); a reader from before ignores these keys and
# serves the primary model (plan.model, plan.engine, plan.budget) alone.

#: What a model of a board is served for (the routes that take it).
ROLES = ("chat", "completion", "embedding", "rerank")
#: ``pinned``: loaded at start, never evicted; ``on_demand``: loaded when a request needs it.
RESIDENCIES = ("pinned", "on_demand")
#: The id a client sends as ``model``, and its aliases: a subset of what serve's
#: ``--model-name`` takes (printable ASCII without space), starting with a letter or digit.
SERVED_NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}"
NEIGHBOUR_NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}"
#: A neighbour's systemd service: systemd's unit-name characters without the backslash of
#: its escapes, never starting with '-' (it is an argument of ``systemctl show``).
NEIGHBOUR_UNIT_PATTERN = r"[A-Za-z0-9_][A-Za-z0-9:_.@-]{0,240}\.service"
#: The models of one board, the primary included (the resident sets are at most 2^7).
MAX_BOARD_MODELS = 8
MAX_NEIGHBOURS = 32
MAX_ALIASES = 8
MAX_PRIORITY = 1000
MAX_IDLE_UNLOAD_S = 7 * 86400
PROTECTIONS = ("min", "low")
#: Where a neighbour's memory_bytes came from: given, or read from its running unit.
NEIGHBOUR_SOURCES = ("declared", "memory_peak", "memory_current")
#: slmguard's own services: never a neighbour (deploy.units names them).
OWN_UNITS = ("slmguard.service", "slmguard-watch.service", "slmguard-crashdump.service")


@dataclass(frozen=True)
class Serving:
    """How the server serves one model of a board: the ``name`` clients send as ``model``
    and its ``aliases``, its ``role``, its ``residency``, its ``priority`` (the governor's
    degrade ladder acts on the lowest first; ties: the later model first) and, on demand,
    how long it may sit idle before it is unloaded (``idle_unload_s``, 0: never)."""

    name: str = field(metadata=rule(pattern=SERVED_NAME_PATTERN))
    aliases: tuple[str, ...] = field(
        default=(), metadata=rule(pattern=SERVED_NAME_PATTERN, max_items=MAX_ALIASES, unique=True)
    )
    role: str = field(default="chat", metadata=rule(choices=ROLES))
    residency: str = field(default="pinned", metadata=rule(choices=RESIDENCIES))
    priority: int = field(default=100, metadata=rule(lo=0, hi=MAX_PRIORITY))
    idle_unload_s: int = field(default=0, metadata=rule(lo=0, hi=MAX_IDLE_UNLOAD_S))

    @property
    def names(self) -> tuple[str, ...]:
        """Every name the model answers to: its name, then its aliases."""
        return (self.name, *self.aliases)


@dataclass(frozen=True)
class BoardModel:
    """A model of the board beside the primary one: its own file, engine settings (one
    :class:`EngineSettings`, as the primary's), budget and reasons. Its budget has no
    front and no reserves (the primary's holds them, once); it is computed from
    ``plan.budget_inputs`` with the board's reserves at 0 (``plan.board``, ``model_input``)."""

    serving: Serving
    model: ModelSpec
    engine: EngineSettings
    budget: tuple[BudgetPart, ...] = field(default=(), metadata=rule(max_items=64))
    reasons: dict[str, str] = field(
        default_factory=dict, metadata=rule(max_chars=4096, max_items=64)
    )


@dataclass(frozen=True)
class Neighbour:
    """One of the board's other services and the memory it holds at its peak.

    ``unit`` (a systemd service) is what ``render``/``apply`` move into the business slice
    with ``MemoryMin=`` (``protection`` min: the kernel never reclaims it below
    ``memory_bytes``) or ``MemoryLow=`` (low: only when nothing unprotected is left);
    without a unit the memory is held back all the same, and protected by the business
    slice as a whole. ``source``: given (``declared``) or read from the running unit."""

    name: str = field(metadata=rule(pattern=NEIGHBOUR_NAME_PATTERN))
    memory_bytes: int = field(metadata=rule(lo=1, hi=MAX_BYTES))
    unit: str | None = field(default=None, metadata=rule(pattern=NEIGHBOUR_UNIT_PATTERN))
    protection: str = field(default="min", metadata=rule(choices=PROTECTIONS))
    source: str = field(default="declared", metadata=rule(choices=NEIGHBOUR_SOURCES))


@dataclass(frozen=True)
class ResidentSet:
    """Models that may be resident together (by name; every pinned one is in each set) and
    their planned peak together (the front's included): at or below the recovery line."""

    models: tuple[str, ...] = field(
        metadata=rule(pattern=SERVED_NAME_PATTERN, min_items=1, max_items=MAX_BOARD_MODELS,
                      unique=True)
    )  # fmt: skip
    peak_bytes: int = field(metadata=rule(lo=0, hi=MAX_BYTES))


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
    # A vision projector served beside the model (a minor addition: older plans have none).
    projector: ProjectorSpec | None = field(default=None, metadata=OPTIONAL)
    # A board (issue 39; minor additions, left out of a one-model plan's JSON): how the
    # primary model is served, the other models, the board's other services, and which
    # sets of models may be resident together.
    serving: Serving | None = field(default=None, metadata=OPTIONAL)
    models: tuple[BoardModel, ...] = field(
        default=(), metadata={**rule(max_items=MAX_BOARD_MODELS - 1), **OPTIONAL}
    )
    neighbours: tuple[Neighbour, ...] = field(
        default=(), metadata={**rule(max_items=MAX_NEIGHBOURS), **OPTIONAL}
    )
    resident_sets: tuple[ResidentSet, ...] = field(
        default=(), metadata={**rule(max_items=1 << (MAX_BOARD_MODELS - 1)), **OPTIONAL}
    )
    schema: str = SCHEMA

    def part(self, name: str) -> BudgetPart | None:
        return next((p for p in self.budget if p.name == name), None)
