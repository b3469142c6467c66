"""The configurations the planner tries, and whether one fits the board.

Owns :class:`PlanRequest` (what to plan for, with the engine settings a caller fixed by
their :class:`EngineSettings` names), :class:`Config` (one configuration: the engine
settings the plan would write and its budget) and :class:`Configs`: the board-wide
numbers computed once (the limits, the recovery line, threads, the budget inputs the
plan records), each configuration built and budgeted, and the rules that say it fits
(docs/plan.md, "How the plan chooses"): the planned peak below the recovery line, a
cold first start within MemoryMax, the GPU's heap, the commit charge. The order of
preference and the plan itself are :mod:`slmguard.plan.planner`'s. Pure.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from slmguard.plan.boards import BoardProfile, GpuProfile
from slmguard.plan.budget import compute_budget
from slmguard.plan.limits import MAX_OVERCOMMIT_RATIO, commit_ratio, memory_limits, recovery_line
from slmguard.plan.modelfacts import ModelFacts
from slmguard.plan.parts import Budget, BudgetInput
from slmguard.plan.projector import VisionInput
from slmguard.plan.schema import (
    MAX_BATCH,
    BudgetBoard,
    BudgetGpu,
    BudgetInputs,
    EngineSettings,
    Watermarks,
)
from slmguard.plan.search import largest, top_ctx
from slmguard.plan.vision import min_ubatch

MiB = 1 << 20
MIN_SLOT_CTX = 4096  # a slot beyond the first must still get this many tokens
UBATCHES = (512, 256, 128, 64)
KV_TYPES = ("f16", "q8_0")
SLOT_CHOICES = (4, 2, 1)
MAX_SLOTS = 64
MAX_GPU_LAYERS = 1025  # the schema's bound: 1024 layers + the output layer
#: With a projector, a slot holds the images a request may carry and this many tokens of
#: text and answer besides.
IMAGE_TEXT_ROOM = 256
#: The engine settings a caller may fix instead of the planner (``n_batch`` fixes
#: n_batch = n_ubatch, the ubatch the planner would otherwise choose).
FIXABLE = (
    "n_parallel", "n_batch", "kv_type", "flash_attn", "kv_unified", "cache_ram_mib",
    "n_gpu_layers", "kv_offload",
)  # fmt: skip


@dataclass(frozen=True)
class Beside:
    """What the board's other models hold beside the one being planned (issue 39): their
    planned peak and commit charge together, and how the words name them
    (``"embed 52.0 MiB, rerank 20.1 MiB on demand"``). Nothing for a one-model plan."""

    hot_bytes: int = 0
    commit_bytes: int = 0
    what: str = ""


@dataclass(frozen=True)
class PlanRequest:
    """What to plan for. ``ctx`` is tokens per slot; ``engine`` holds the
    :class:`EngineSettings` fields the caller fixed (:data:`FIXABLE`), by name; the rest
    are chosen. ``gpu`` is the GPU to offload to (None: CPU only). ``beside``: the board's
    other models, which every configuration must fit beside; ``front_process`` False plans
    one of those (no front, no reserves: the primary model's budget holds them once)."""

    facts: ModelFacts
    board: BoardProfile
    ctx: int | None = None
    engine: Mapping[str, Any] = field(default_factory=dict)
    watermarks: Watermarks | None = None
    model_path: str | None = None
    preset: str | None = None
    quant: str | None = None
    gpu: GpuProfile | None = None
    vision: VisionInput | None = None  # a projector and the image bounds (on the host)
    beside: Beside = field(default_factory=Beside)
    front_process: bool = True


@dataclass(frozen=True)
class Config:
    """One configuration tried: its engine settings and budget, and the budget of the
    other flash-attention choice (f16 KV when that is off), for the reasons."""

    engine: EngineSettings
    budget: Budget
    other: Budget

    @property
    def ctx_slot(self) -> int:
        return self.engine.n_ctx // self.engine.n_parallel

    @property
    def slots(self) -> int:
        return self.engine.n_parallel

    @property
    def ubatch(self) -> int:
        return self.engine.n_ubatch

    @property
    def kv(self) -> str:
        return self.engine.kv_type

    @property
    def flash(self) -> bool:
        return self.engine.flash_attn

    @property
    def layers(self) -> int:
        return self.engine.n_gpu_layers


class Threads(NamedTuple):
    """The engine's threads and the CPUs it is pinned to (empty: none)."""

    n: int
    affinity: tuple[int, ...]
    big: int  # the usable big cores
    quota: bool  # the cgroup's CPU quota allows fewer than ``big``


def threads_and_affinity(board: BoardProfile) -> Threads:
    """One thread per big core (fewer under a CPU quota); the big cores pinned on a CPU
    with cores of two kinds (a thread on a little core stalls the whole group)."""
    big = board.big_cores or board.cpus
    n, quota = len(big), False
    if board.max_threads is not None and board.max_threads < n:
        n, quota = board.max_threads, True
    affinity = tuple(big) if set(big) != set(board.cpus) else ()
    return Threads(max(n, 1), affinity, len(big), quota)


def budget_inputs(board: BoardProfile, gpu: GpuProfile | None) -> BudgetInputs:
    """What every budget of a plan for ``board`` (and ``gpu``, the GPU planned for) is
    computed from besides the engine's settings; the plan records it."""
    return BudgetInputs(
        board=BudgetBoard(
            isa=board.isa,
            n_cpus=len(board.cpus),
            npu_reserve_bytes=board.npu_reserve_bytes,
            os_reserve_bytes=board.os_reserve_bytes,
            business_reserve_bytes=board.business_reserve_bytes,
        ),
        gpu=None
        if gpu is None
        else BudgetGpu(gpu.backend, gpu.process_memory, gpu.max_tensor_bytes),
    )


def _without_reserves(inputs: BudgetInputs) -> BudgetInputs:
    board = dataclasses.replace(
        inputs.board, npu_reserve_bytes=0, os_reserve_bytes=0, business_reserve_bytes=0
    )
    return dataclasses.replace(inputs, board=board)


class Configs:
    """The search, with the board-wide numbers computed once."""

    def __init__(self, req: PlanRequest) -> None:
        self.req = req
        self.board = req.board
        self.memory_high, self.memory_max = memory_limits(req.board)
        self.marks = req.watermarks or Watermarks()
        self.line = recovery_line(self.memory_high, 0, self.marks)
        self.threads = threads_and_affinity(req.board)
        self.inputs = budget_inputs(req.board, req.gpu)
        if not req.front_process:  # a board's other model: the primary holds the reserves
            self.inputs = _without_reserves(self.inputs)
        self.beside = req.beside
        self.layers = 0  # -ngl of the configurations being tried
        # Hold the first start's parts against MemoryMax and in the commit charge (off only
        # to ask what the steady state alone would admit, for the reasons).
        self.first_start = True
        self.no_offload: str | None = None  # why a board with a GPU offloads nothing
        self.projector_offload = False  # the projector's weights and encoder on the GPU
        self.offload_tried: Config | None = None  # the projector offloaded, when it did not fit

    def fixed(self, name: str) -> Any:
        """The value the caller fixed for engine setting ``name`` (None: the planner's)."""
        return self.req.engine.get(name)

    def outside_bytes(self, budget: Budget) -> int:
        """The device side the cgroup does not see (rounded up to MiB), else 0."""
        gpu = self.req.gpu
        if gpu is None or gpu.in_cgroup or not budget.device_bytes:
            return 0
        return -(-budget.device_bytes // MiB) * MiB

    def line_for(self, budget: Budget) -> int:
        """The recovery line for host + device: ``recover_pct`` of MemoryHigh plus the
        device bytes outside the cgroup (MemoryMax is that much lower)."""
        outside = self.outside_bytes(budget)
        high, _ = memory_limits(self.board, outside)
        return recovery_line(high, outside, self.marks)

    def start_limit(self, budget: Budget) -> int:
        """What a cold first start may hold, host and device: MemoryMax plus the device
        bytes outside the cgroup (the kernel OOM-kills in the unit past MemoryMax)."""
        outside = self.outside_bytes(budget)
        return memory_limits(self.board, outside)[1] + outside

    def settle(self, c: Config) -> None:
        """Fix the limits and the line to those of the chosen configuration."""
        self.layers = c.layers
        outside = self.outside_bytes(c.budget)
        self.memory_high, self.memory_max = memory_limits(self.board, outside)
        self.line = self.line_for(c.budget)

    def engine(
        self, ctx_slot: int, slots: int, ubatch: int, kv: str, flash: bool
    ) -> EngineSettings:
        """The engine settings of one configuration, at the layers being tried: on a board
        with a GPU that offloads nothing, no device at all (a GPU build would use it)."""
        engine = EngineSettings(
            n_ctx=ctx_slot * slots,
            n_batch=ubatch,
            n_ubatch=ubatch,
            n_threads=self.threads.n,
            kv_type=kv,
            swa_full=True,
            n_parallel=slots,
            kv_unified=bool(self.fixed("kv_unified")),
            flash_attn=flash,
            cache_ram_mib=self.fixed("cache_ram_mib") or 0,
        )
        gpu = self.req.gpu
        if gpu is None:
            return engine
        if not self.layers:
            return dataclasses.replace(engine, device="none")
        kv_offload = self.fixed("kv_offload")
        return dataclasses.replace(
            engine, n_gpu_layers=self.layers, device=gpu.device, backend=gpu.backend,
            kv_offload=True if kv_offload is None else kv_offload,
        )  # fmt: skip

    def vision(self) -> VisionInput | None:
        """The projector as the configurations being tried run it (None: no projector)."""
        v = self.req.vision
        if v is None or v.spec.offload == self.projector_offload:
            return v
        return VisionInput(v.facts, dataclasses.replace(v.spec, offload=self.projector_offload))

    def budget(self, engine: EngineSettings, *, front_process: bool = True) -> Budget:
        inputs = self.inputs
        front = front_process and self.req.front_process
        return compute_budget(
            BudgetInput(
                self.req.facts, engine, inputs.board, inputs.gpu, front, vision=self.vision()
            )
        )  # fmt: skip

    @property
    def image_room(self) -> int:
        """The context a slot needs for the images a request may carry and
        :data:`IMAGE_TEXT_ROOM` tokens of text and answer (0: no projector)."""
        v = self.req.vision
        return 0 if v is None else v.slot_image_tokens + IMAGE_TEXT_ROOM

    def min_ubatch(self) -> int:
        """The smallest n_ubatch: an image's tokens decode in one (1: no projector)."""
        v = self.req.vision
        return 1 if v is None else min_ubatch(v.spec.tokens_per_image)

    def peak(self, budget: Budget) -> int:
        """The planned peak of a configuration with the board's other models beside it."""
        return budget.hot_bytes + self.beside.hot_bytes

    def start_peak(self, budget: Budget) -> int:
        """:meth:`peak` after a cold first start."""
        return budget.first_start_hot_bytes + self.beside.hot_bytes

    def choice(self, ctx_slot: int, slots: int, ubatch: int, kv: str) -> Config:
        """The configuration with flash attention decided (on where it lowers the peak;
        a quantized V cache needs it); ``ubatch`` 0: the context per slot (a model
        without a KV cache)."""
        ubatch = ubatch or min(ctx_slot, MAX_BATCH)
        on_engine = self.engine(ctx_slot, slots, ubatch, kv, True)
        on = self.budget(on_engine)
        if kv != "f16":
            return Config(
                on_engine, on, self.budget(self.engine(ctx_slot, slots, ubatch, "f16", False))
            )
        off_engine = self.engine(ctx_slot, slots, ubatch, kv, False)
        off = self.budget(off_engine)
        forced = self.fixed("flash_attn")
        flash = forced if forced is not None else on.hot_bytes < off.hot_bytes
        return Config(on_engine, on, off) if flash else Config(off_engine, off, on)

    def commit(self, budget: Budget) -> int:
        """The host's planned commit charge: the service + everything else.

        A profile assumes the OS and business zones commit what they reserve;
        on the host itself (``--board auto``) the current Committed_AS is used
        when it is larger (it includes the service if that is already running:
        the plan then errs on the safe side).
        """
        b = self.board
        others = max(b.os_reserve_bytes + b.business_reserve_bytes, b.committed_bytes or 0)
        others += self.beside.commit_bytes
        if not self.first_start:
            return budget.service_commit_bytes + others
        return budget.first_start_commit_bytes + others  # a cold first start commits more

    def commit_ratio(self, commit: int) -> int:
        return commit_ratio(commit, self.board.ram_bytes, self.marks)

    def fits(self, c: Config) -> bool:
        gpu = self.req.gpu
        heap = gpu.max_bytes if gpu is not None and c.layers else None
        return (
            self.peak(c.budget) <= self.line_for(c.budget)
            and (not self.first_start or self.start_peak(c.budget) <= self.start_limit(c.budget))
            and (heap is None or c.budget.device_bytes <= heap)
            and self.commit_ratio(self.commit(c.budget)) <= MAX_OVERCOMMIT_RATIO
        )

    def layer_choices(self) -> tuple[int, ...]:
        """-ngl in order of preference: all layers, half, none; or the one asked for."""
        n = self.req.facts.n_layer + 1
        asked = self.fixed("n_gpu_layers")
        if asked is not None:
            return (asked,)
        if self.req.gpu is None:
            return (0,)
        return (n, n // 2, 0)

    def configs(self) -> Iterator[tuple[int, str]]:
        """(n_ubatch, KV type) in order of preference; without a KV cache, n_ubatch 0
        (the context per slot, see :meth:`choice`) and f16 (nothing to quantize)."""
        batch, kv = self.fixed("n_batch"), self.fixed("kv_type")
        floor = self.min_ubatch()
        ubatches = (batch,) if batch else tuple(u for u in UBATCHES if u >= floor) or (floor,)
        kvs: tuple[str, ...] = (kv,) if kv else KV_TYPES
        if not self.req.facts.has_kv_cache:
            ubatches = (batch or 0,)
            kvs = (kv or KV_TYPES[0],)
        if self.fixed("flash_attn") is False:
            kvs = tuple(k for k in kvs if k == "f16") or kvs
        for kv_type in kvs:
            for ub in ubatches:
                yield ub, kv_type

    def slot_choices(self) -> tuple[int, ...]:
        asked = self.fixed("n_parallel")
        if asked is not None:
            return (asked,)
        big = len(self.board.big_cores or self.board.cpus)
        if self.board.max_threads is not None:
            big = min(big, self.board.max_threads)
        return tuple(s for s in SLOT_CHOICES if s == 1 or s <= big)

    def top_ctx(self) -> int:
        return top_ctx(self.req.facts)

    def largest(self, slots: int, ubatch: int, kv: str) -> Config | None:
        """The largest per-slot context that fits (:func:`slmguard.plan.search.largest`)."""

        def attempt(ctx_slot: int) -> Config | None:
            c = self.choice(ctx_slot, slots, ubatch, kv)
            return c if self.fits(c) else None

        return largest(self.top_ctx(), attempt)
