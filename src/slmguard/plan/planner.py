"""The planner: from model facts and a board profile to a :class:`Plan`.

Owns the choices (context per slot, slots, flash attention, batch, KV type,
prompt cache, threads, CPU affinity, MemoryHigh/MemoryMax, governor
watermarks, CMA size, overcommit settings), each with its reason in
``plan.reasons``. Pure: the caller reads the model header and the board; the
arithmetic is :mod:`slmguard.plan.budget`.

Policy, in order:

1. The inference zone is RAM minus the OS, business and NPU/GPU reserves.
   MemoryMax is the zone; MemoryHigh sits 5 % (at least 64 MiB) below it so
   the kernel throttles and reclaims before it OOM-kills.
2. The governor's watermarks are fixed first: shed 85 %, degrade 92 %,
   critical 97 %, recover 80 % of MemoryHigh (the source document's 85 %
   warning line), or what the caller asks for. They are never moved to make
   a plan fit.
3. A configuration fits when its planned peak (the service's working set with
   every slot's context full: anonymous memory plus the hot file-backed
   weights and code) stays below the recovery line, ``recover_pct`` of
   MemoryHigh, so the governor starts with room to act before it sheds; when
   that peak plus what a cold first start holds (``Plan.first_start``: a Vulkan
   engine compiling its shaders) stays within MemoryMax; and when its commit
   charge (every reserved buffer, thread stacks, the first start's parts, the OS
   and business reserves, + 10 %) fits under ``vm.overcommit_memory=2`` with
   ``overcommit_ratio`` <= 100 and no swap.
4. Among the configurations that fit: f16 KV and n_ubatch 512 first, then
   smaller ubatches (256, 128, 64: a smaller compute buffer) and then a q8_0
   KV cache; flash attention whenever it shrinks the compute buffer (it never
   grows it on the CPU backend; a quantized V cache requires it). Slots: as
   many as requested, else 4, 2 or 1 (at most one per big core), the most that
   still give each slot :data:`MIN_SLOT_CTX` tokens. Context: the largest
   multiple of 256 per slot up to the trained length, or the requested one,
   which is honoured or refused with the numbers.
5. ``--cache-ram`` stays 0 (no prompt cache in RAM) unless asked for; a
   requested size is budgeted as a part that grows with use.
6. A model llama.cpp runs without a KV cache (an encoder: BERT, EmbeddingGemma;
   ``ModelFacts.has_kv_cache``) computes every input whole in one ubatch, so
   n_batch = n_ubatch = the context per slot (a longer ubatch buys nothing, a
   shorter one would refuse inputs the context admits), its KV is 0 bytes and f16
   (the KV type allocates nothing); the context then costs only the batch it
   implies, and the largest that fits is taken as above.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

from slmguard.errors import PlanError, UsageError
from slmguard.plan.boards import BoardProfile, GpuProfile
from slmguard.plan.budget import CELL_PAD, Budget, BudgetInput, compute_budget
from slmguard.plan.modelfacts import ModelFacts
from slmguard.plan.schema import (
    MAX_BATCH,
    BoardSpec,
    EngineSettings,
    KernelSettings,
    Limits,
    ModelSpec,
    Plan,
    Watermarks,
)
from slmguard.plan.text import shown

MiB = 1 << 20
HEADROOM = 0.10  # on the commit charge
MIN_CTX = 512
MIN_SLOT_CTX = 4096  # a slot beyond the first must still get this many tokens
CTX_STEP = CELL_PAD
UBATCHES = (512, 256, 128, 64)
KV_TYPES = ("f16", "q8_0")
SLOT_CHOICES = (4, 2, 1)
MAX_OVERCOMMIT_RATIO = 100
MAX_SLOTS = 64
MAX_GPU_LAYERS = 1025  # the schema's bound: 1024 layers + the output layer


@dataclass(frozen=True)
class PlanRequest:
    """What to plan for. ``ctx`` is tokens per slot; ``None`` fields are chosen."""

    facts: ModelFacts
    board: BoardProfile
    ctx: int | None = None
    slots: int | None = None
    n_batch: int | None = None
    kv_type: str | None = None
    flash_attn: bool | None = None
    kv_unified: bool = False
    cache_ram_mib: int = 0
    watermarks: Watermarks | None = None
    model_path: str | None = None
    preset: str | None = None
    quant: str | None = None
    gpu: GpuProfile | None = None  # the GPU to offload to (None: CPU only)
    gpu_layers: int | None = None  # -ngl asked for (None: the planner chooses)
    kv_offload: bool = True


GPU_CHOICES = ("auto", "none", "vulkan", "cuda")


@dataclass(frozen=True)
class PlanChoices:
    """What the caller of ``plan`` may decide instead of the planner (the CLI's flags).

    Example::

        PlanChoices(slots=2, flash_attn=True, watermarks=Watermarks(shed_pct=80.0,
                    degrade_pct=90.0, critical_pct=96.0, recover_pct=75.0))
    """

    slots: int | None = None
    flash_attn: bool | None = None
    kv_unified: bool = False
    cache_ram_mib: int = 0
    watermarks: Watermarks | None = None
    gpu: str = "auto"  # the board's GPU, none, or a backend asked for
    gpu_layers: int | None = None
    kv_offload: bool = True

    def validate(self) -> None:
        """UsageError (exit 64) for a value no plan can have."""
        if self.gpu not in GPU_CHOICES:
            raise UsageError(f"--gpu {shown(self.gpu)}: one of {', '.join(GPU_CHOICES)}")
        if self.gpu_layers is not None and not 0 <= self.gpu_layers <= MAX_GPU_LAYERS:
            raise UsageError(f"--gpu-layers {self.gpu_layers}: must be 0 to {MAX_GPU_LAYERS}")
        if self.gpu == "none" and self.gpu_layers:
            raise UsageError(f"--gpu-layers {self.gpu_layers} with --gpu none")
        if self.slots is not None and not 1 <= self.slots <= MAX_SLOTS:
            raise UsageError(f"--slots {self.slots}: must be 1 to {MAX_SLOTS}")
        if self.cache_ram_mib < 0:
            raise UsageError(
                f"--cache-ram {self.cache_ram_mib}: must be >= 0 MiB (an unlimited prompt "
                "cache cannot be budgeted)"
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
    ctx_slot: int
    slots: int
    ubatch: int
    kv: str
    flash: bool
    budget: Budget
    other: Budget  # the same with the other -fa choice (f16 KV when that is off)
    layers: int = 0  # -ngl


def _mib(n: float) -> str:
    return f"{n / MiB:,.0f} MiB"


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


def top_ctx(facts: ModelFacts) -> int:
    """The largest context per slot planned for: the trained length in 256s (32768 when
    the header gives none), at least :data:`MIN_CTX`."""
    top = facts.n_ctx_train if facts.n_ctx_train > 0 else 32_768
    return max(MIN_CTX, top // CTX_STEP * CTX_STEP)


def threads_and_affinity(board: BoardProfile) -> tuple[int, tuple[int, ...], str, str]:
    """(n_threads, CPU affinity, reason for threads, reason for affinity)."""
    big = board.big_cores or board.cpus
    n = len(big)
    why_threads = f"one per big core ({n})"
    if board.max_threads is not None and board.max_threads < n:
        n = board.max_threads
        why_threads = f"the cgroup CPU quota allows {n} of the {len(big)} usable big cores"
    heterogeneous = set(big) != set(board.cpus)
    if heterogeneous:
        affinity = tuple(big)
        why_aff = (
            f"pin to the big cores {','.join(map(str, big))}: a thread on a little core "
            "stalls every matrix multiply for the whole group"
        )
    else:
        affinity = ()
        why_aff = "all cores are the same: no pinning, the scheduler balances"
    return max(n, 1), affinity, why_threads, why_aff


class _Planner:
    """The search, with the board-wide numbers computed once."""

    def __init__(self, req: PlanRequest) -> None:
        self.req = req
        self.board = req.board
        self.memory_high, self.memory_max = memory_limits(req.board)
        self.marks = req.watermarks or Watermarks()
        self.line = recovery_line(self.memory_high, 0, self.marks)
        self.threads, self.affinity, self.why_threads, self.why_aff = threads_and_affinity(
            req.board
        )
        self.layers = 0  # -ngl of the configurations being tried
        # Hold the first start's parts against MemoryMax and in the commit charge (off only
        # to ask what the steady state alone would admit, for the reasons).
        self.first_start = True
        self.no_offload: str | None = None  # why a board with a GPU offloads nothing

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

    def budget(self, ctx_slot: int, slots: int, ubatch: int, kv: str, flash: bool) -> Budget:
        b = self.board
        return compute_budget(
            BudgetInput(
                facts=self.req.facts,
                n_ctx=ctx_slot * slots,
                n_batch=ubatch,
                n_ubatch=ubatch,
                n_threads=self.threads,
                n_parallel=slots,
                kv_unified=self.req.kv_unified,
                kv_type=kv,
                flash_attn=flash,
                swa_full=True,
                cache_ram_mib=self.req.cache_ram_mib,
                isa=b.isa,
                n_cpus=len(b.cpus),
                npu_reserve_bytes=b.npu_reserve_bytes,
                os_reserve_bytes=b.os_reserve_bytes,
                business_reserve_bytes=b.business_reserve_bytes,
                gpu_device=self.layers > 0,
                gpu_build=self.req.gpu.backend if self.req.gpu else None,
                n_gpu_layers=self.layers,
                kv_offload=self.req.kv_offload,
                device_process_memory=bool(self.req.gpu and self.req.gpu.process_memory),
                device_max_tensor_bytes=self.req.gpu.max_tensor_bytes if self.req.gpu else None,
            )
        )

    def choice(self, ctx_slot: int, slots: int, ubatch: int, kv: str) -> _Choice:
        """The configuration with flash attention decided (see module docstring);
        ``ubatch`` 0: the context per slot (a model without a KV cache)."""
        ubatch = ubatch or min(ctx_slot, MAX_BATCH)
        on = self.budget(ctx_slot, slots, ubatch, kv, True)
        if kv != "f16":
            off = self.budget(ctx_slot, slots, ubatch, "f16", False)
            return _Choice(ctx_slot, slots, ubatch, kv, True, on, off, self.layers)
        off = self.budget(ctx_slot, slots, ubatch, kv, False)
        forced = self.req.flash_attn
        flash = forced if forced is not None else on.hot_bytes < off.hot_bytes
        return _Choice(
            ctx_slot,
            slots,
            ubatch,
            kv,
            flash,
            on if flash else off,
            off if flash else on,
            self.layers,
        )

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
        if self.req.gpu_layers is not None:
            return (self.req.gpu_layers,)
        if self.req.gpu is None:
            return (0,)
        return (n, n // 2, 0)

    def configs(self) -> Iterator[tuple[int, str]]:
        """(n_ubatch, KV type) in order of preference; without a KV cache, n_ubatch 0
        (the context per slot, see :meth:`choice`) and f16 (nothing to quantize)."""
        ubatches = (self.req.n_batch,) if self.req.n_batch else UBATCHES
        kvs: tuple[str, ...] = (self.req.kv_type,) if self.req.kv_type else KV_TYPES
        if not self.req.facts.has_kv_cache:
            ubatches = (self.req.n_batch or 0,)
            kvs = (self.req.kv_type or KV_TYPES[0],)
        if self.req.flash_attn is False:
            kvs = tuple(k for k in kvs if k == "f16") or kvs
        for kv in kvs:
            for ub in ubatches:
                yield ub, kv

    def slot_choices(self) -> tuple[int, ...]:
        if self.req.slots is not None:
            return (self.req.slots,)
        big = len(self.board.big_cores or self.board.cpus)
        if self.board.max_threads is not None:
            big = min(big, self.board.max_threads)
        return tuple(s for s in SLOT_CHOICES if s == 1 or s <= big)

    def top_ctx(self) -> int:
        return top_ctx(self.req.facts)

    def largest(self, slots: int, ubatch: int, kv: str) -> _Choice | None:
        """The largest per-slot context that fits (memory grows with it: bisect)."""
        cands = list(range(self.top_ctx(), MIN_CTX - 1, -CTX_STEP))
        lo, hi, best = 0, len(cands) - 1, None
        while lo <= hi:
            mid = (lo + hi) // 2
            c = self.choice(cands[mid], slots, ubatch, kv)
            if self.fits(c):
                best, hi = c, mid - 1
            else:
                lo = mid + 1
        return best


def _check_request(req: PlanRequest) -> None:
    f = req.facts
    if req.gpu_layers is not None and req.gpu_layers > f.n_layer + 1:
        raise PlanError(
            f"--gpu-layers {req.gpu_layers}: {f.name} has {f.n_layer} layers and the output "
            f"layer, so at most {f.n_layer + 1}",
            hint=f"--gpu-layers {f.n_layer + 1} offloads all of it",
        )
    if req.gpu_layers and req.gpu is None:
        raise PlanError(
            f"--gpu-layers {req.gpu_layers}: board {req.board.name} has no GPU slmguard can "
            "offload to",
            hint="--gpu vulkan or --gpu cuda names the backend on a board that has one",
        )
    if req.ctx is not None and req.ctx < 1:
        raise PlanError(f"--ctx {req.ctx}: must be at least 1")
    if req.ctx is not None and 0 < f.n_ctx_train < req.ctx:
        raise PlanError(
            f"--ctx {req.ctx} is beyond {f.name}'s trained context of {f.n_ctx_train} tokens",
            hint="quality degrades past the trained length; ask for at most that",
        )
    if req.slots is not None and not 1 <= req.slots <= MAX_SLOTS:
        raise PlanError(f"--slots {req.slots}: must be 1 to {MAX_SLOTS}")
    if req.cache_ram_mib < 0:
        raise PlanError(f"--cache-ram {req.cache_ram_mib}: must be >= 0 MiB")
    if req.kv_type not in (None, "f16", "q8_0", "q4_0"):
        raise PlanError(f"KV type {req.kv_type!r}: f16, q8_0 or q4_0")
    if req.kv_type not in (None, "f16") and req.flash_attn is False:
        raise PlanError(f"a {req.kv_type} KV cache needs flash attention (-fa on)")


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
    for layers in p.layer_choices():
        p.layers = layers
        found = _search(p, req, tried)
        if found is not None and (layers == 0 or req.gpu_layers is not None or _roomy(p, found)):
            chosen = found
            break
        fallback = fallback or found
        if layers:
            passed.append((layers, found))
    chosen = chosen or fallback
    if chosen is not None and not chosen.layers and passed:
        p.no_offload = _why_no_offload(p, passed)
    if chosen is None:
        slots_text = f"{req.slots} slot(s) x " if req.slots is not None else ""
        what = (
            f"{slots_text}n_ctx {req.ctx}"
            if req.ctx is not None
            else f"{slots_text}any n_ctx >= {MIN_CTX}"
        )
        if req.gpu_layers:
            what += f" with {req.gpu_layers} layers on the GPU"
        raise _refuse(p, tried, what)
    p.settle(chosen)
    return _assemble(p, chosen)


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
            steady = _search(p, p.req, [])
        finally:
            p.layers, p.first_start = 0, True
        if steady is not None and steady.budget.first_start and _roomy(p, steady):
            return _first_start_cause(p, steady)
    found = [(n, c) for n, c in passed if c is not None]
    if found:
        n, c = found[0]
        return (
            f"offloading {n} layers leaves {c.ctx_slot} tokens per slot, fewer than "
            f"{min(MIN_SLOT_CTX, p.top_ctx())}: less context than the CPU alone"
        )
    return (
        "no configuration with layers on the GPU fits (host and GPU buffers over the "
        "recovery line, the GPU's heap or the CommitLimit)"
    )


def _first_start_cause(p: _Planner, c: _Choice) -> str:
    """The reason for offloading nothing when a cold first start is what does not fit."""
    b = c.budget
    limit = p.start_limit(b)
    parts = ", ".join(f"{x.name} {_mib(x.bytes)}" for x in b.first_start)
    outside = limit - memory_limits(p.board, p.outside_bytes(b))[1]
    if b.first_start_hot_bytes > limit:
        over = f"{_mib(b.hot_bytes)} + it = {_mib(b.first_start_hot_bytes)}, over MemoryMax " + (
            f"+ the GPU buffers outside the cgroup {_mib(limit)}" if outside else _mib(limit)
        )
    else:
        commit = p.commit(b)
        over = (
            f"a commit charge of {_mib(commit)} (+{HEADROOM:.0%}) over the CommitLimit of "
            f"{_mib(p.board.ram_bytes)} (ratio {MAX_OVERCOMMIT_RATIO}, no swap)"
        )
    return (
        f"a cold first start would not fit: {c.layers} layers fit the steady state "
        f"({c.slots} slot(s) x {c.ctx_slot}, planned peak {_mib(b.hot_bytes)} below the "
        f"recovery line {_mib(p.line_for(b))}), but a cold start (Mesa's shader cache empty: "
        f"the first after installing or upgrading the engine or the driver) adds {parts}: "
        f"{over}"
    )


def _search(p: _Planner, req: PlanRequest, tried: list[_Choice]) -> _Choice | None:
    """The preferred configuration that fits at ``p.layers`` layers offloaded, or None."""
    chosen: _Choice | None = None
    for ub, kv in p.configs():
        for slots in p.slot_choices():
            if req.ctx is not None:
                ctx_slot = -(-req.ctx // CTX_STEP) * CTX_STEP
                c = p.choice(ctx_slot, slots, ub, kv)
                tried.append(c)
                if p.fits(c):
                    chosen = c
            else:
                found = p.largest(slots, ub, kv)
                if found is None:
                    tried.append(p.choice(MIN_CTX, slots, ub, kv))
                elif (
                    req.slots is not None
                    or slots == 1
                    or found.ctx_slot >= min(MIN_SLOT_CTX, p.top_ctx())
                ):
                    chosen = found
            if chosen:
                break
        if chosen:
            break
    return chosen


def _ctx_reason(p: _Planner, c: _Choice) -> str:
    req, f = p.req, p.req.facts
    if req.ctx is not None:
        padded = "" if c.ctx_slot == req.ctx else f" (padded to {c.ctx_slot}: cells come in 256s)"
        return (
            f"requested {req.ctx} per slot{padded}; x {c.slots} slot(s) = -c {c.ctx_slot * c.slots}"
        )
    return (
        f"{c.ctx_slot} per slot x {c.slots} = -c {c.ctx_slot * c.slots}: the largest multiple "
        f"of {CTX_STEP} up to the trained {f.n_ctx_train} "
        + (
            "(the trained length itself)"
            if c.ctx_slot == p.top_ctx()
            else f"whose peak stays below the recovery line ({_mib(p.line)})"
        )
        + ("; no KV cache: it costs only the compute of one ubatch" if not f.has_kv_cache else "")
    )


def _slots_reason(p: _Planner, c: _Choice) -> str:
    req = p.req
    if req.slots is not None:
        return f"{c.slots} as requested (-np {c.slots})"
    more = [s for s in p.slot_choices() if s > c.slots]
    return (
        f"{c.slots} (-np {c.slots}): "
        + (
            "one per big core, up to 4, each slot a full context"
            if not more
            else f"{more[-1]} would leave a slot fewer than {min(MIN_SLOT_CTX, p.top_ctx())} tokens"
        )
        + (
            ""
            if not req.facts.has_kv_cache
            else "; per-slot KV"
            if not req.kv_unified
            else "; one unified KV pool (--kv-unified)"
        )
    )


def _flash_reason(p: _Planner, c: _Choice) -> str:
    on, off = (c.budget, c.other) if c.flash else (c.other, c.budget)
    return (
        f"{'on' if c.flash else 'off'}: compute buffer {_mib(on.compute_reserved_bytes)} "
        f"reserved with -fa on, {_mib(off.compute_reserved_bytes)} with -fa off"
        + (
            f"; planned peak {_mib(on.hot_bytes)} vs {_mib(off.hot_bytes)}"
            if on.hot_bytes != off.hot_bytes
            else ""
        )
        + (
            " (requested)"
            if p.req.flash_attn is not None
            else (
                " (a quantized V cache needs it)"
                if c.kv != "f16"
                else ("" if c.flash else "; off: it buys no headroom here")
            )
        )
    )


def _batch_reason(p: _Planner, c: _Choice) -> str:
    req, budget = p.req, c.budget
    if not req.facts.has_kv_cache:
        return (
            f"{c.ubatch} (= n_ubatch"
            + (", as requested" if req.n_batch else " = the context per slot")
            + f"): {req.facts.arch} has no KV cache, so llama.cpp computes each input whole "
            "in one ubatch (non-causal attention needs n_ubatch >= its tokens; llama-server "
            f"refuses a longer one); the compute buffer reserves "
            f"{_mib(budget.compute_reserved_bytes)} for a ubatch attending to itself"
        )
    first_ub = req.n_batch or UBATCHES[0]
    smallest = UBATCHES[-1]
    alt = (
        p.budget(c.ctx_slot, c.slots, smallest, c.kv, c.flash)
        if c.ubatch != smallest and req.n_batch is None
        else None
    )
    return (
        f"{c.ubatch} (= n_ubatch): the compute buffer reserves "
        f"{_mib(budget.compute_reserved_bytes)}"
        + (", the default" if c.ubatch == first_ub else f"; {first_ub} did not fit")
        + (
            f" (n_ubatch {smallest} would save "
            f"{_mib(budget.hot_bytes - alt.hot_bytes)} at a slower prefill; "
            "a smaller ubatch is taken only when this one does not fit)"
            if alt is not None
            else ""
        )
    )


def _kv_reason(p: _Planner, c: _Choice) -> str:
    if not p.req.facts.has_kv_cache:
        return (
            f"none: llama.cpp runs {p.req.facts.arch} without a KV cache (no memory module, "
            "llama_model::create_memory), so the plan budgets 0 bytes for it whatever the "
            f"context, and {c.kv} allocates nothing; a smaller context frees no memory, so "
            "the governor never shrinks it (it sheds and parks)"
        )
    kv_part = c.budget.part("kv_cache")
    first_kv = p.req.kv_type or KV_TYPES[0]
    return (
        f"{c.kv}: KV cache {_mib(kv_part.bytes if kv_part else 0)}, allocated in full at load"
        + ("" if c.kv == first_kv else f"; {first_kv} did not fit")
    )


def _swa_reason(p: _Planner, c: _Choice) -> str:
    """Why --swa-full: the KV cache and checkpoints the plan would have without it."""
    req, f = p.req, p.req.facts
    cp = compute_budget(
        BudgetInput(
            facts=f,
            n_ctx=c.ctx_slot * c.slots,
            n_batch=c.ubatch,
            n_ubatch=c.ubatch,
            n_parallel=c.slots,
            kv_unified=req.kv_unified,
            kv_type=c.kv,
            flash_attn=c.flash,
            swa_full=False,
            front_process=False,
        )
    )
    kv_part = c.budget.part("kv_cache")
    small = cp.part("kv_cache")
    ckpt = cp.part("ctx_checkpoints")
    return (
        f"{len(f.swa_layers)} of {f.n_layer} layers use a {f.sliding_window}-token window; "
        f"--swa-full keeps them full size (KV {_mib(kv_part.bytes if kv_part else 0)}): "
        f"without it the KV cache is {_mib(small.bytes if small else 0)} but llama-server "
        f"keeps up to 32 context checkpoints per slot ({_mib(ckpt.bytes if ckpt else 0)})"
    )


def _engine_reasons(p: _Planner, c: _Choice) -> dict[str, str]:
    """The reasons for the engine's settings, in the order the plan shows them."""
    req = p.req
    reasons = {
        "n_ctx": _ctx_reason(p, c),
        "slots": _slots_reason(p, c),
        "flash_attn": _flash_reason(p, c),
        "n_batch": _batch_reason(p, c),
        "kv_type": _kv_reason(p, c),
    }
    if req.facts.swa_layers and req.facts.has_kv_cache:
        reasons["swa"] = _swa_reason(p, c)
    reasons["cache_ram"] = f"--cache-ram {req.cache_ram_mib}: " + (
        "no prompt cache in RAM (llama-server's default would grow by up to 8 GiB)"
        if req.cache_ram_mib == 0
        else "as requested, budgeted in full as prompt_cache"
    )
    reasons["n_threads"] = p.why_threads
    reasons["cpu_affinity"] = p.why_aff
    return reasons


def _limit_reasons(p: _Planner, c: _Choice) -> dict[str, str]:
    """Why MemoryMax, MemoryHigh and the governor's watermarks are where they are."""
    board, w = p.board, p.marks
    peak = c.budget.hot_bytes
    outside = p.outside_bytes(c.budget)
    base = p.memory_high + outside
    source = "as requested" if p.req.watermarks is not None else "the source document's 85% line"
    of_what = (
        f"MemoryHigh + the {_mib(outside)} of GPU buffers outside the cgroup"
        if outside
        else "MemoryHigh"
    )
    return {
        "memory_max": (
            f"the inference zone: {_mib(board.ram_bytes)} RAM - OS {_mib(board.os_reserve_bytes)}"
            f" - business {_mib(board.business_reserve_bytes)} - NPU/GPU "
            f"{_mib(board.npu_reserve_bytes)}"
            + (
                f" - the GPU buffers outside the cgroup {_mib(outside)} (the driver does not "
                "charge them to it; the governor counts them with it)"
                if outside
                else ""
            )
        ),
        "memory_high": (
            f"{_mib(p.memory_max - p.memory_high)} below MemoryMax so the kernel throttles and "
            "reclaims the cold page cache before it OOM-kills"
        ),
        "watermarks": (
            f"fixed first ({source}): shed {w.shed_pct:g}%, degrade {w.degrade_pct:g}%, "
            f"critical {w.critical_pct:g}%, "
            f"recover {w.recover_pct:g}% of {of_what}; the planned peak {_mib(peak)} "
            + ("(host and GPU) " if c.budget.device_bytes else "")
            + f"({peak * 100 / base:.1f}%) stays below the recovery line "
            f"{_mib(p.line)}, so a full load is normal and sheds nothing: "
            f"{_mib(base * w.shed_pct / 100 - peak)} of headroom to the shed line"
        ),
    }


def _kernel_reasons(p: _Planner, c: _Choice, commit: int, ratio: int) -> dict[str, str]:
    """Why the CMA pool and the overcommit settings are what they are."""
    board, budget = p.board, c.budget
    if board.cma_bytes is not None:
        cma = (
            f"cma={board.cma_bytes // MiB}M: the NPU's contiguous pool, sized to the "
            f"{_mib(board.npu_reserve_bytes)} NPU reserve instead of a guess"
        )
    else:
        cma = "left as the board boots (no NPU CMA pool to size)"
    host_commit = (board.committed_bytes or 0) > (
        board.os_reserve_bytes + board.business_reserve_bytes
    )
    overcommit = (
        f"mode 2, ratio {ratio}: CommitLimit {_mib(board.ram_bytes * ratio // 100)} (no swap) "
        f"admits the planned commit charge {_mib(commit)} (service "
        f"{_mib(budget.service_commit_bytes)}, incl. the engine's thread stacks and the "
        f"full {_mib(budget.compute_reserved_bytes)} compute reservation, + "
        + (
            f"a cold first start's {_mib(budget.first_start_bytes)}, + "
            if budget.first_start_bytes
            else ""
        )
        + (
            f"the host's current Committed_AS {_mib(board.committed_bytes or 0)}"
            if host_commit
            else "OS and business reserves"
        )
        + f") with {HEADROOM:.0%} headroom"
    )
    return {"cma": cma, "overcommit": overcommit}


def _first_start_reason(p: _Planner, c: _Choice) -> dict[str, str]:
    """Why a cold first start still fits: the planned peak and the first-start parts
    within MemoryMax (none without them)."""
    b = c.budget
    if not b.first_start:
        return {}
    limit = p.start_limit(b)
    parts = ", ".join(f"{x.name} {_mib(x.bytes)}" for x in b.first_start)
    return {
        "first_start": (
            f"a cold first start (Mesa's shader cache empty: the first after installing or "
            f"upgrading the engine or the driver; every start if the cache cannot be written) "
            f"adds {parts}, kept for that engine's life: the planned peak "
            f"{_mib(b.hot_bytes)} + it = {_mib(b.first_start_hot_bytes)}, within "
            + (
                f"MemoryMax + the GPU buffers outside the cgroup {_mib(limit)}"
                if limit > p.memory_max
                else f"MemoryMax {_mib(limit)}"
            )
            + "; not counted in the watermarks (serve keeps the cache, so later starts are "
            "warm); the commit charge includes it"
        )
    }


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


def _offload_settings(p: _Planner, c: _Choice) -> dict[str, object]:
    """The engine's offload fields: the GPU's device and backend, or no device at all
    on a board with a GPU that offloads nothing (a GPU build would use it otherwise)."""
    gpu = p.req.gpu
    if gpu is None:
        return {}
    if not c.layers:
        return {"device": "none"}
    return {
        "n_gpu_layers": c.layers,
        "device": gpu.device,
        "kv_offload": p.req.kv_offload,
        "backend": gpu.backend,
    }


def _gpu_reason(p: _Planner, c: _Choice) -> str:
    """Why these layers are on the GPU (or none are)."""
    req, gpu, f = p.req, p.req.gpu, p.req.facts
    n = f.n_layer + 1
    if gpu is None and p.req.board.gpu is not None:
        board_gpu = p.req.board.gpu
        return (
            f"none: CPU only; --gpu {board_gpu.backend} plans {board_gpu.title} (needs an engine "
            f"built with {board_gpu.backend}; --gpu auto offloads with CUDA only)"
        )
    if gpu is None:
        return "no GPU on this board profile: the CPU does everything"
    b = c.budget
    if not c.layers:
        why = (
            "as requested (--gpu-layers 0)"
            if req.gpu_layers == 0
            else p.no_offload or "offloading left less context than the CPU alone"
        )
        return f"none of {n} on {gpu.title}: {why}; --device none keeps a GPU build off it"
    asked = " (requested)" if req.gpu_layers is not None else ""
    outside = "outside the engine's cgroup" if not gpu.in_cgroup else "charged to its cgroup"
    return (
        f"{c.layers} of {n} (output first, then the last {c.layers - 1} repeating layers)"
        f"{asked} on {gpu.device}, {gpu.title}: {_mib(b.device_bytes)} of GPU buffers "
        f"({outside}), KV {'on the device' if req.kv_offload else 'kept on the host'}; "
        f"{gpu.note}"
    )


def _assemble(p: _Planner, c: _Choice) -> Plan:
    req, board = p.req, p.board
    commit = p.commit(c.budget)
    ratio = max(50, p.commit_ratio(commit))
    reasons = {
        "gpu_layers": _gpu_reason(p, c),
        **_engine_reasons(p, c),
        **_limit_reasons(p, c),
        **_kernel_reasons(p, c, commit, ratio),
        **_first_start_reason(p, c),
    }
    return Plan(
        model=_model_spec(req),
        board=_board_spec(board, req.gpu if c.layers else None),
        engine=EngineSettings(
            n_ctx=c.ctx_slot * c.slots,
            n_batch=c.ubatch,
            n_ubatch=c.ubatch,
            n_threads=p.threads,
            kv_type=c.kv,
            swa_full=True,
            n_parallel=c.slots,
            kv_unified=req.kv_unified,
            flash_attn=c.flash,
            cache_ram_mib=req.cache_ram_mib,
            **_offload_settings(p, c),  # type: ignore[arg-type]
        ),
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
        cpu_affinity=p.affinity,
        reasons=reasons,
    )
