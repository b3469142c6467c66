"""The planner: from model facts and a board profile to a :class:`Plan`.

Owns the choices (context per slot, slots, flash attention, batch, KV type, the layers
on a GPU, threads, CPU affinity, MemoryHigh/MemoryMax, watermarks, CMA, overcommit) and
the rules that say a configuration fits; the policy is docs/plan.md, "How the plan
chooses". Every configuration tried is an :class:`EngineSettings`, budgeted with
:func:`~slmguard.plan.budget.compute_budget` from the :class:`BudgetInputs` the plan
records; the largest context is :func:`slmguard.plan.search.largest`; the reasons'
words are :mod:`slmguard.plan.reasons`. Pure: the caller reads the model header and
the board; nothing here prints or reads a file.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from slmguard.errors import PlanError, UsageError
from slmguard.plan import reasons
from slmguard.plan.boards import BoardProfile, GpuProfile
from slmguard.plan.budget import Budget, BudgetInput, compute_budget
from slmguard.plan.modelfacts import ModelFacts
from slmguard.plan.schema import (
    KV_TYPES as SCHEMA_KV_TYPES,
)
from slmguard.plan.schema import (
    MAX_BATCH,
    BoardSpec,
    BudgetBoard,
    BudgetGpu,
    BudgetInputs,
    EngineSettings,
    KernelSettings,
    Limits,
    ModelSpec,
    Plan,
    Watermarks,
)
from slmguard.plan.search import CTX_STEP, MIN_CTX, largest, top_ctx
from slmguard.plan.text import shown

MiB = 1 << 20
HEADROOM = 0.10  # on the commit charge
MIN_SLOT_CTX = 4096  # a slot beyond the first must still get this many tokens
UBATCHES = (512, 256, 128, 64)
KV_TYPES = ("f16", "q8_0")
SLOT_CHOICES = (4, 2, 1)
MAX_OVERCOMMIT_RATIO = 100
MAX_SLOTS = 64
MAX_GPU_LAYERS = 1025  # the schema's bound: 1024 layers + the output layer
#: The engine settings a caller may fix instead of the planner (``n_batch`` fixes
#: n_batch = n_ubatch, the ubatch the planner would otherwise choose).
FIXABLE = (
    "n_parallel", "n_batch", "kv_type", "flash_attn", "kv_unified", "cache_ram_mib",
    "n_gpu_layers", "kv_offload",
)  # fmt: skip


@dataclass(frozen=True)
class PlanRequest:
    """What to plan for. ``ctx`` is tokens per slot; ``engine`` holds the
    :class:`EngineSettings` fields the caller fixed (:data:`FIXABLE`), by name; the rest
    are chosen. ``gpu`` is the GPU to offload to (None: CPU only)."""

    facts: ModelFacts
    board: BoardProfile
    ctx: int | None = None
    engine: Mapping[str, Any] = field(default_factory=dict)
    watermarks: Watermarks | None = None
    model_path: str | None = None
    preset: str | None = None
    quant: str | None = None
    gpu: GpuProfile | None = None


GPU_CHOICES = ("auto", "none", "vulkan", "cuda")


@dataclass(frozen=True)
class PlanChoices:
    """What the caller of ``plan`` may decide instead of the planner (the CLI's flags):
    engine settings by name (:data:`FIXABLE`), the watermarks and the GPU.

    Example::

        PlanChoices(engine={"n_parallel": 2, "flash_attn": True}, watermarks=Watermarks(
                    shed_pct=80.0, degrade_pct=90.0, critical_pct=96.0, recover_pct=75.0))
    """

    engine: Mapping[str, Any] = field(default_factory=dict)
    watermarks: Watermarks | None = None
    gpu: str = "auto"  # the board's GPU, none, or a backend asked for

    def validate(self) -> None:
        """UsageError (exit 64) for a value no plan can have."""
        e = self.engine
        unknown = sorted(set(e) - set(FIXABLE))
        if unknown:
            raise UsageError(f"the planner does not take engine.{unknown[0]}")
        layers, slots, cache = e.get("n_gpu_layers"), e.get("n_parallel"), e.get("cache_ram_mib")
        if self.gpu not in GPU_CHOICES:
            raise UsageError(f"--gpu {shown(self.gpu)}: one of {', '.join(GPU_CHOICES)}")
        if layers is not None and not 0 <= layers <= MAX_GPU_LAYERS:
            raise UsageError(f"--gpu-layers {layers}: must be 0 to {MAX_GPU_LAYERS}")
        if self.gpu == "none" and layers:
            raise UsageError(f"--gpu-layers {layers} with --gpu none")
        if slots is not None and not 1 <= slots <= MAX_SLOTS:
            raise UsageError(f"--slots {slots}: must be 1 to {MAX_SLOTS}")
        if cache is not None and cache < 0:
            raise UsageError(
                f"--cache-ram {cache}: must be >= 0 MiB (an unlimited prompt cache cannot be "
                "budgeted)"
            )
        w = self.watermarks
        if w is not None and not (
            0 < w.recover_pct < w.shed_pct <= w.degrade_pct <= w.critical_pct <= 100
        ):
            raise UsageError(
                f"watermarks recover {w.recover_pct:g} / shed {w.shed_pct:g} / degrade "
                f"{w.degrade_pct:g} / critical {w.critical_pct:g}: need 0 < recover < shed <= "
                "degrade <= critical <= 100"
            )


@dataclass(frozen=True)
class _Choice:
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


def _mib(n: float) -> str:
    return reasons.mib(n)


def zone_bytes(board: BoardProfile) -> int:
    """RAM left for the inference service after the reserves beside it."""
    return (
        board.ram_bytes
        - board.os_reserve_bytes
        - board.business_reserve_bytes
        - board.npu_reserve_bytes
    )


def memory_limits(board: BoardProfile, device_outside: int = 0) -> tuple[int, int]:
    """(MemoryHigh, MemoryMax) in bytes for the board's inference zone, less the
    ``device_outside`` bytes the GPU driver holds outside the cgroup."""
    memory_max = (zone_bytes(board) - device_outside) // MiB * MiB
    gap = max(64 * MiB, math.ceil(memory_max / 20 / MiB) * MiB)
    return max(memory_max - gap, MiB), memory_max


def recovery_line(memory_high_bytes: int, device_bytes: int, marks: Watermarks) -> int:
    """Where a planned peak must stay: ``recover_pct`` of MemoryHigh plus the device bytes
    outside the cgroup (the governor counts them with it)."""
    return int((memory_high_bytes + device_bytes) * marks.recover_pct / 100)


def commit_ratio(commit_bytes: int, ram_bytes: int) -> int:
    """The ``vm.overcommit_ratio`` (no swap) that admits ``commit_bytes`` with the headroom."""
    return math.ceil(commit_bytes * (1 + HEADROOM) * 100 / ram_bytes)


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


class _Planner:
    """The search, with the board-wide numbers computed once."""

    def __init__(self, req: PlanRequest) -> None:
        self.req = req
        self.board = req.board
        self.memory_high, self.memory_max = memory_limits(req.board)
        self.marks = req.watermarks or Watermarks()
        self.line = recovery_line(self.memory_high, 0, self.marks)
        self.threads = threads_and_affinity(req.board)
        self.inputs = budget_inputs(req.board, req.gpu)
        self.layers = 0  # -ngl of the configurations being tried
        # Hold the first start's parts against MemoryMax and in the commit charge (off only
        # to ask what the steady state alone would admit, for the reasons).
        self.first_start = True
        self.no_offload: str | None = None  # why a board with a GPU offloads nothing

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

    def settle(self, c: _Choice) -> None:
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

    def budget(self, engine: EngineSettings, *, front_process: bool = True) -> Budget:
        inputs = self.inputs
        return compute_budget(
            BudgetInput(self.req.facts, engine, inputs.board, inputs.gpu, front_process)
        )

    def choice(self, ctx_slot: int, slots: int, ubatch: int, kv: str) -> _Choice:
        """The configuration with flash attention decided (on where it lowers the peak;
        a quantized V cache needs it); ``ubatch`` 0: the context per slot (a model
        without a KV cache)."""
        ubatch = ubatch or min(ctx_slot, MAX_BATCH)
        on_engine = self.engine(ctx_slot, slots, ubatch, kv, True)
        on = self.budget(on_engine)
        if kv != "f16":
            return _Choice(
                on_engine, on, self.budget(self.engine(ctx_slot, slots, ubatch, "f16", False))
            )
        off_engine = self.engine(ctx_slot, slots, ubatch, kv, False)
        off = self.budget(off_engine)
        forced = self.fixed("flash_attn")
        flash = forced if forced is not None else on.hot_bytes < off.hot_bytes
        return _Choice(on_engine, on, off) if flash else _Choice(off_engine, off, on)

    def commit(self, budget: Budget) -> int:
        """The host's planned commit charge: the service + everything else.

        A profile assumes the OS and business zones commit what they reserve;
        on the host itself (``--board auto``) the current Committed_AS is used
        when it is larger (it includes the service if that is already running:
        the plan then errs on the safe side).
        """
        b = self.board
        others = max(b.os_reserve_bytes + b.business_reserve_bytes, b.committed_bytes or 0)
        if not self.first_start:
            return budget.service_commit_bytes + others
        return budget.first_start_commit_bytes + others  # a cold first start commits more

    def commit_ratio(self, commit: int) -> int:
        return commit_ratio(commit, self.board.ram_bytes)

    def fits(self, c: _Choice) -> bool:
        gpu = self.req.gpu
        heap = gpu.max_bytes if gpu is not None and c.layers else None
        return (
            c.budget.hot_bytes <= self.line_for(c.budget)
            and (
                not self.first_start or c.budget.first_start_hot_bytes <= self.start_limit(c.budget)
            )
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
        ubatches = (batch,) if batch else UBATCHES
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

    def largest(self, slots: int, ubatch: int, kv: str) -> _Choice | None:
        """The largest per-slot context that fits (:func:`slmguard.plan.search.largest`)."""

        def attempt(ctx_slot: int) -> _Choice | None:
            c = self.choice(ctx_slot, slots, ubatch, kv)
            return c if self.fits(c) else None

        return largest(self.top_ctx(), attempt)


def _check_request(req: PlanRequest) -> None:
    f, e = req.facts, req.engine
    layers, slots, cache = e.get("n_gpu_layers"), e.get("n_parallel"), e.get("cache_ram_mib")
    kv, flash = e.get("kv_type"), e.get("flash_attn")
    unknown = sorted(set(e) - set(FIXABLE))
    if unknown:
        raise PlanError(f"the planner does not take engine.{unknown[0]}")
    if layers is not None and layers > f.n_layer + 1:
        raise PlanError(
            f"--gpu-layers {layers}: {f.name} has {f.n_layer} layers and the output "
            f"layer, so at most {f.n_layer + 1}",
            hint=f"--gpu-layers {f.n_layer + 1} offloads all of it",
        )
    if layers and req.gpu is None:
        raise PlanError(
            f"--gpu-layers {layers}: board {req.board.name} has no GPU slmguard can offload to",
            hint="--gpu vulkan or --gpu cuda names the backend on a board that has one",
        )
    if req.ctx is not None and req.ctx < 1:
        raise PlanError(f"--ctx {req.ctx}: must be at least 1")
    if req.ctx is not None and 0 < f.n_ctx_train < req.ctx:
        raise PlanError(
            f"--ctx {req.ctx} is beyond {f.name}'s trained context of {f.n_ctx_train} tokens",
            hint="quality degrades past the trained length; ask for at most that",
        )
    if slots is not None and not 1 <= slots <= MAX_SLOTS:
        raise PlanError(f"--slots {slots}: must be 1 to {MAX_SLOTS}")
    if cache is not None and cache < 0:
        raise PlanError(f"--cache-ram {cache}: must be >= 0 MiB")
    if kv not in (None, *SCHEMA_KV_TYPES):
        raise PlanError(f"KV type {kv!r}: f16, q8_0 or q4_0")
    if kv not in (None, "f16") and flash is False:
        raise PlanError(f"a {kv} KV cache needs flash attention (-fa on)")


def _refuse(p: _Planner, tried: list[_Choice], what: str) -> PlanError:
    f, board = p.req.facts, p.board
    zone = zone_bytes(board)
    best = min(tried, key=lambda c: c.budget.hot_bytes)
    peak = best.budget.hot_bytes
    p.settle(best)
    gpu = p.req.gpu
    heap = gpu.max_bytes if gpu is not None and best.layers else None
    if heap is not None and best.budget.device_bytes > heap and peak <= p.line:
        return PlanError(
            f"{f.name} on {board.name} at {what}: the GPU's buffers need "
            f"{_mib(best.budget.device_bytes)} but {gpu.title if gpu else 'the device'} has "
            f"{_mib(heap)}",
            need_bytes=best.budget.device_bytes,
            have_bytes=heap,
            hint="offload fewer layers (--gpu-layers N) or keep the KV cache on the host "
            "(--kv-offload off)",
        )
    start, limit = best.budget.first_start_hot_bytes, p.start_limit(best.budget)
    if peak <= p.line and start > limit:
        return PlanError(
            f"{f.name} on {board.name} at {what}: a cold first start (Mesa's shader cache "
            f"empty) holds {_mib(start)}, the planned peak {_mib(peak)} + "
            f"{_mib(best.budget.first_start_bytes)} of "
            f"{', '.join(x.name for x in best.budget.first_start)}, but MemoryMax is "
            f"{_mib(p.memory_max)}"
            + (
                f" (+ {_mib(limit - p.memory_max)} outside the cgroup)"
                if limit > p.memory_max
                else ""
            ),
            need_bytes=start,
            have_bytes=limit,
            hint="offload fewer layers (--gpu-layers N) or none (--gpu none), or use a smaller "
            "context",
        )
    if peak <= p.line:
        commit = p.commit(best.budget)
        return PlanError(
            f"{f.name} on {board.name}: {what} needs a commit charge of {_mib(commit)} "
            f"(+{HEADROOM:.0%}) but vm.overcommit_memory=2 admits at most "
            f"{_mib(board.ram_bytes)} (ratio 100, no swap)",
            need_bytes=math.ceil(commit * (1 + HEADROOM)),
            have_bytes=board.ram_bytes,
            hint="use a smaller context, fewer slots or a smaller model, or a board with more RAM",
        )
    return PlanError(
        f"{f.name} does not fit {board.name} at {what}: its planned peak is {_mib(peak)} "
        + (
            f"({_mib(best.budget.device_bytes)} of it on the GPU) "
            if best.budget.device_bytes
            else ""
        )
        + f"(at best: {best.slots} slot(s) x {best.ctx_slot}, n_ubatch {best.ubatch}, "
        f"{best.kv} KV, -fa {'on' if best.flash else 'off'}) but the recovery line is "
        f"{_mib(p.line)} ({p.marks.recover_pct:g}% of MemoryHigh {_mib(p.memory_high)}; the "
        f"zone is {_mib(zone)} = {_mib(board.ram_bytes)} RAM - OS "
        f"{_mib(board.os_reserve_bytes)} - business {_mib(board.business_reserve_bytes)} - "
        f"NPU {_mib(board.npu_reserve_bytes)})",
        need_bytes=peak,
        have_bytes=p.line,
        hint="ask for a smaller --ctx or fewer --slots, a smaller quantization "
        "(--preset NAME:Q4_K_M) or model",
    )


def make_plan(req: PlanRequest) -> Plan:
    """Choose every setting (see module docstring); raise PlanError when nothing fits."""
    board = req.board
    zone = zone_bytes(board)
    if zone <= 0:
        raise PlanError(
            f"board {board.name}: the reserves ({_mib(board.ram_bytes - zone)}) leave no "
            f"memory of {_mib(board.ram_bytes)} for the model",
            need_bytes=board.ram_bytes - zone,
            have_bytes=board.ram_bytes,
        )
    _check_request(req)
    p = _Planner(req)
    tried: list[_Choice] = []
    chosen: _Choice | None = None
    fallback: _Choice | None = None
    passed: list[tuple[int, _Choice | None]] = []  # offloaded layer counts not taken
    asked_layers = p.fixed("n_gpu_layers")
    for layers in p.layer_choices():
        p.layers = layers
        found = _search(p, tried)
        if found is not None and (layers == 0 or asked_layers is not None or _roomy(p, found)):
            chosen = found
            break
        fallback = fallback or found
        if layers:
            passed.append((layers, found))
    chosen = chosen or fallback
    if chosen is not None and not chosen.layers and passed:
        p.no_offload = _why_no_offload(p, passed)
    if chosen is None:
        raise _refuse(p, tried, _what(req, asked_layers))
    p.settle(chosen)
    return _assemble(p, chosen)


def _what(req: PlanRequest, asked_layers: int | None) -> str:
    """What was asked, for a refusal: ``2 slot(s) x n_ctx 4096 with 10 layers on the GPU``."""
    slots = req.engine.get("n_parallel")
    slots_text = f"{slots} slot(s) x " if slots is not None else ""
    what = (
        f"{slots_text}n_ctx {req.ctx}"
        if req.ctx is not None
        else f"{slots_text}any n_ctx >= {MIN_CTX}"
    )
    if asked_layers:
        what += f" with {asked_layers} layers on the GPU"
    return what


def _roomy(p: _Planner, c: _Choice) -> bool:
    """An offloaded configuration worth taking over the CPU alone: the context asked for,
    or one that leaves a slot :data:`MIN_SLOT_CTX` tokens (the trained length if shorter)."""
    return p.req.ctx is not None or c.ctx_slot >= min(MIN_SLOT_CTX, p.top_ctx())


def _why_no_offload(p: _Planner, passed: list[tuple[int, _Choice | None]]) -> str:
    """Why none of the offloaded layer counts ``passed`` (with what each found) was taken.

    The first start is the cause when the steady state alone would have taken one: the
    same search without the first start's parts finds a configuration worth taking, and
    adding them puts it over MemoryMax (or the CommitLimit). Otherwise, too little context
    or nothing that fits, each with the numbers."""
    for layers, _ in passed:
        p.layers, p.first_start = layers, False
        try:
            steady = _search(p, [])
        finally:
            p.layers, p.first_start = 0, True
        if steady is not None and steady.budget.first_start and _roomy(p, steady):
            return _first_start_cause(p, steady)
    found = [(n, c) for n, c in passed if c is not None]
    if found:
        n, c = found[0]
        want = min(MIN_SLOT_CTX, p.top_ctx())
        return reasons.no_offload_less_ctx(layers=n, ctx_slot=c.ctx_slot, want=want)
    return reasons.no_offload_nothing_fits()


def _first_start_cause(p: _Planner, c: _Choice) -> str:
    """The reason for offloading nothing when a cold first start is what does not fit."""
    b = c.budget
    limit = p.start_limit(b)
    outside = limit - memory_limits(p.board, p.outside_bytes(b))[1]
    if b.first_start_hot_bytes > limit:
        over = reasons.over_memory_max(
            peak_bytes=b.hot_bytes, total_bytes=b.first_start_hot_bytes, limit_bytes=limit,
            outside=bool(outside),
        )  # fmt: skip
    else:
        over = reasons.over_commit_limit(
            commit_bytes=p.commit(b), headroom=HEADROOM, ram_bytes=p.board.ram_bytes,
            ratio=MAX_OVERCOMMIT_RATIO,
        )  # fmt: skip
    return reasons.no_offload_first_start(
        layers=c.layers, slots=c.slots, ctx_slot=c.ctx_slot, peak_bytes=b.hot_bytes,
        line_bytes=p.line_for(b), parts=[(x.name, x.bytes) for x in b.first_start], over=over,
    )  # fmt: skip


def _search(p: _Planner, tried: list[_Choice]) -> _Choice | None:
    """The preferred configuration that fits at ``p.layers`` layers offloaded, or None."""
    asked, asked_slots = p.req.ctx, p.fixed("n_parallel")
    for ub, kv in p.configs():
        for slots in p.slot_choices():
            if asked is not None:
                c = p.choice(-(-asked // CTX_STEP) * CTX_STEP, slots, ub, kv)
                tried.append(c)
                if p.fits(c):
                    return c
                continue
            found = p.largest(slots, ub, kv)
            if found is None:
                tried.append(p.choice(MIN_CTX, slots, ub, kv))
            elif (
                asked_slots is not None
                or slots == 1
                or found.ctx_slot >= min(MIN_SLOT_CTX, p.top_ctx())
            ):
                return found
    return None


def _engine_reasons(p: _Planner, c: _Choice) -> dict[str, str]:
    """The reasons for the engine's settings, in the order the plan shows them."""
    req, f, b = p.req, p.req.facts, c.budget
    on, off = (b, c.other) if c.flash else (c.other, b)
    more = [s for s in p.slot_choices() if s > c.slots]
    kv_part = b.part("kv_cache")
    out = {
        "n_ctx": reasons.ctx(
            ctx_slot=c.ctx_slot, slots=c.slots, asked=req.ctx, trained=f.n_ctx_train,
            step=CTX_STEP, top=p.top_ctx(), line_bytes=p.line, has_kv_cache=f.has_kv_cache,
        ),
        "slots": reasons.slots(
            slots=c.slots, asked=p.fixed("n_parallel") is not None,
            more=more[-1] if more else None, min_slot_ctx=min(MIN_SLOT_CTX, p.top_ctx()),
            has_kv_cache=f.has_kv_cache, kv_unified=c.engine.kv_unified,
        ),
        "flash_attn": reasons.flash_attn(
            on=c.flash, reserved_on=on.compute_reserved_bytes,
            reserved_off=off.compute_reserved_bytes, peak_on=on.hot_bytes,
            peak_off=off.hot_bytes, asked=p.fixed("flash_attn") is not None, kv_type=c.kv,
        ),
        "n_batch": _batch_reason(p, c),
        "kv_type": reasons.kv_type(
            kv_type=c.kv, kv_bytes=kv_part.bytes if kv_part else 0,
            first=p.fixed("kv_type") or KV_TYPES[0], has_kv_cache=f.has_kv_cache, arch=f.arch,
        ),
    }  # fmt: skip
    if f.swa_layers and f.has_kv_cache:
        out["swa"] = _swa_reason(p, c)
    out["cache_ram"] = reasons.cache_ram(mib_asked=c.engine.cache_ram_mib)
    t = p.threads
    out["n_threads"] = reasons.threads(n=t.n, big=t.big, quota=t.quota)
    out["cpu_affinity"] = reasons.cpu_affinity(pinned=t.affinity)
    return out


def _batch_reason(p: _Planner, c: _Choice) -> str:
    """n_batch: what its compute buffer reserves, and what the smallest ubatch would save."""
    f, asked = p.req.facts, p.fixed("n_batch")
    smallest = UBATCHES[-1]
    saved = None
    if f.has_kv_cache and c.ubatch != smallest and asked is None:
        alt = p.budget(dataclasses.replace(c.engine, n_batch=smallest, n_ubatch=smallest))
        saved = c.budget.hot_bytes - alt.hot_bytes
    return reasons.batch(
        ubatch=c.ubatch, reserved=c.budget.compute_reserved_bytes, asked=bool(asked),
        first=asked or UBATCHES[0], smallest=smallest, saved=saved,
        has_kv_cache=f.has_kv_cache, arch=f.arch,
    )  # fmt: skip


def _swa_reason(p: _Planner, c: _Choice) -> str:
    """Why --swa-full: the KV cache and checkpoints the plan would have without it (the
    whole cache on the host, whatever is offloaded)."""
    f = p.req.facts
    inputs = p.inputs
    small = compute_budget(
        BudgetInput(f, dataclasses.replace(c.engine, swa_full=False), inputs.board, None, False)
    )
    kv_part, small_kv, ckpt = (
        c.budget.part("kv_cache"), small.part("kv_cache"), small.part("ctx_checkpoints")
    )  # fmt: skip
    return reasons.swa(
        swa_layers=len(f.swa_layers), n_layer=f.n_layer, window=f.sliding_window,
        kv_bytes=kv_part.bytes if kv_part else 0, small_kv_bytes=small_kv.bytes if small_kv else 0,
        checkpoint_bytes=ckpt.bytes if ckpt else 0,
    )  # fmt: skip


def _limit_reasons(p: _Planner, c: _Choice) -> dict[str, str]:
    """Why MemoryMax, MemoryHigh and the governor's watermarks are where they are."""
    board, w = p.board, p.marks
    outside = p.outside_bytes(c.budget)
    return {
        "memory_max": reasons.memory_max(
            ram_bytes=board.ram_bytes, os_bytes=board.os_reserve_bytes,
            business_bytes=board.business_reserve_bytes, npu_bytes=board.npu_reserve_bytes,
            outside_bytes=outside,
        ),
        "memory_high": reasons.memory_high(gap_bytes=p.memory_max - p.memory_high),
        "watermarks": reasons.watermarks(
            shed=w.shed_pct, degrade=w.degrade_pct, critical=w.critical_pct,
            recover=w.recover_pct, asked=p.req.watermarks is not None,
            peak_bytes=c.budget.hot_bytes, device=bool(c.budget.device_bytes),
            base_bytes=p.memory_high + outside, outside_bytes=outside, line_bytes=p.line,
        ),
    }  # fmt: skip


def _kernel_reasons(p: _Planner, c: _Choice, commit: int, ratio: int) -> dict[str, str]:
    """Why the CMA pool and the overcommit settings are what they are."""
    board, b = p.board, c.budget
    host_commit = (board.committed_bytes or 0) > (
        board.os_reserve_bytes + board.business_reserve_bytes
    )
    return {
        "cma": reasons.cma(cma_bytes=board.cma_bytes, npu_bytes=board.npu_reserve_bytes),
        "overcommit": reasons.overcommit(
            ratio=ratio, ram_bytes=board.ram_bytes, commit_bytes=commit,
            service_bytes=b.service_commit_bytes, compute_bytes=b.compute_reserved_bytes,
            first_start_bytes=b.first_start_bytes,
            committed_bytes=(board.committed_bytes or 0) if host_commit else None,
            headroom=HEADROOM,
        ),
    }  # fmt: skip


def _first_start_reason(p: _Planner, c: _Choice) -> dict[str, str]:
    """Why a cold first start still fits (none without its parts)."""
    b = c.budget
    if not b.first_start:
        return {}
    limit = p.start_limit(b)
    return {
        "first_start": reasons.first_start(
            parts=[(x.name, x.bytes) for x in b.first_start], peak_bytes=b.hot_bytes,
            total_bytes=b.first_start_hot_bytes, limit_bytes=limit, outside=limit > p.memory_max,
        )
    }  # fmt: skip


def _gpu_reason(p: _Planner, c: _Choice) -> str:
    """Why these layers are on the GPU (or none are)."""
    gpu, board_gpu = p.req.gpu, p.req.board.gpu
    kv_offload = p.fixed("kv_offload")
    return reasons.gpu_layers(
        layers=c.layers, n=p.req.facts.n_layer + 1, title=gpu.title if gpu else None,
        device=gpu.device if gpu else None, device_bytes=c.budget.device_bytes,
        in_cgroup=gpu.in_cgroup if gpu else False,
        kv_offload=True if kv_offload is None else kv_offload, note=gpu.note if gpu else "",
        asked=p.fixed("n_gpu_layers"), no_offload=p.no_offload,
        board_gpu=(board_gpu.backend, board_gpu.title)
        if gpu is None and board_gpu is not None
        else None,
    )  # fmt: skip


def _model_spec(req: PlanRequest) -> ModelSpec:
    f = req.facts
    return ModelSpec(
        name=f.name,
        arch=f.arch,
        file_bytes=f.file_bytes,
        n_layer=f.n_layer,
        n_ctx_train=f.n_ctx_train,
        path=req.model_path,
        preset=req.preset,
        quant=req.quant,
    )


def _board_spec(board: BoardProfile, gpu: GpuProfile | None) -> BoardSpec:
    """The board as planned; with offload, its GPU's nodes and groups join the rest."""
    nodes, groups = board.device_nodes, board.device_groups
    if gpu is not None:
        nodes = tuple(dict.fromkeys((*nodes, *gpu.nodes)))
        groups = tuple(dict.fromkeys((*groups, *gpu.groups)))
    return BoardSpec(
        name=board.name,
        ram_bytes=board.ram_bytes,
        cpus=board.cpus,
        big_cores=board.big_cores,
        npu_reserve_bytes=board.npu_reserve_bytes,
        device_nodes=nodes,
        device_groups=groups,
        boot_file=board.boot_file,
    )


def _assemble(p: _Planner, c: _Choice) -> Plan:
    req, board = p.req, p.board
    commit = p.commit(c.budget)
    ratio = max(50, p.commit_ratio(commit))
    why = {
        "gpu_layers": _gpu_reason(p, c),
        **_engine_reasons(p, c),
        **_limit_reasons(p, c),
        **_kernel_reasons(p, c, commit, ratio),
        **_first_start_reason(p, c),
    }
    return Plan(
        model=_model_spec(req),
        board=_board_spec(board, req.gpu if c.layers else None),
        engine=c.engine,
        limits=Limits(
            memory_high_bytes=p.memory_high,
            memory_max_bytes=p.memory_max,
            os_reserve_bytes=board.os_reserve_bytes,
            business_reserve_bytes=board.business_reserve_bytes,
            device_bytes=p.outside_bytes(c.budget),
        ),
        budget=c.budget.parts,
        first_start=c.budget.first_start,
        watermarks=p.marks,
        kernel=KernelSettings(
            swappiness=0,
            overcommit_memory=2,
            overcommit_ratio=ratio,
            commit_charge_bytes=commit,
            cma_bytes=board.cma_bytes,
        ),
        cpu_affinity=p.threads.affinity,
        reasons=why,
        budget_inputs=p.inputs,
    )
