"""A plan's budget for other engine settings: the planner's arithmetic, the plan's limits.

Owns :func:`rebudget`. ``serve`` puts its flags over a plan's engine settings
(``settings.engine_settings``); when that changes what the budget depends on
(:data:`BUDGET_FIELDS`: the context, the slots, the batch, the KV type, flash
attention ...), the budget is made again for the new settings with
:func:`slmguard.plan.budget.compute_budget`, the function the planner uses, and
checked against the plan's own limits with the planner's rules: the planned peak
(``Budget.hot_bytes``) below the recovery line (``recover_pct`` of MemoryHigh plus
the device bytes outside the cgroup, :func:`~slmguard.plan.planner.recovery_line`),
that peak plus what a cold first start holds (``Budget.first_start``) within MemoryMax
(plus the same device bytes), and, under ``vm.overcommit_memory=2``, the commit charge
(+10 %, a cold first start's included) within the CommitLimit the plan's
``overcommit_ratio`` gives (no swap,
:func:`~slmguard.plan.planner.commit_ratio`). When it does not fit, the largest
context per slot that does (the same settings otherwise) is searched as the
planner searches it.

A plan does not record everything its budget was made from (the ISA the CPU
backend repacks for, a GPU's limits, the host's commit charge beside the service),
so the arithmetic runs twice, at the plan's settings and at the new ones, with the
same model and board, and each part is the new figure plus what the plan records
differently at its own settings: a part the new settings do not change keeps the
plan's figure exactly, and one they change moves by what the arithmetic says. The
commit charge moves the same way from the plan's ``kernel.commit_charge_bytes``.

Pure: the caller reads the model header, with its tensor table (the repacked
weights and the engine's commit charge need it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from slmguard.plan.boards import PROFILES
from slmguard.plan.budget import (
    REPACK_RULES,
    Budget,
    BudgetInput,
    compute_budget,
    engine_cells,
    repacked_bytes,
)
from slmguard.plan.modelfacts import ModelFacts
from slmguard.plan.planner import (
    CTX_STEP,
    MIN_CTX,
    commit_ratio,
    recovery_line,
    top_ctx,
)
from slmguard.plan.schema import BudgetPart, EngineSettings, Plan

#: The engine settings the budget depends on (:class:`~slmguard.plan.budget.BudgetInput`).
BUDGET_FIELDS = (
    "n_ctx", "n_batch", "n_ubatch", "n_threads", "n_parallel", "kv_unified", "kv_type",
    "flash_attn", "swa_full", "cache_ram_mib", "use_mmap", "use_mlock", "n_gpu_layers",
    "device", "kv_offload", "backend",
)  # fmt: skip


def changed_fields(planned: EngineSettings, engine: EngineSettings) -> tuple[str, ...]:
    """The fields of :data:`BUDGET_FIELDS` that ``engine`` changes over ``planned``.

    A context the engine pads to the plan's cells (``--ctx 1000`` over a plan of
    1024 per slot: llama.cpp allocates 256 cells at a time) changes nothing.
    """
    changed = [f for f in BUDGET_FIELDS if getattr(planned, f) != getattr(engine, f)]
    if "n_ctx" in changed and not {"n_parallel", "kv_unified"} & set(changed):
        cells = engine_cells(planned.n_ctx, planned.n_parallel, planned.kv_unified)
        if cells == engine_cells(engine.n_ctx, engine.n_parallel, engine.kv_unified):
            changed.remove("n_ctx")
    return tuple(changed)


@dataclass(frozen=True)
class Rebudget:
    """A plan re-budgeted for other engine settings, against the plan's limits.

    ``plan`` is the plan with those settings and the re-made budget parts (what the
    governor takes); ``largest_ctx`` is searched only when it does not fit: the
    largest context per slot (a multiple of 256, at least 512) that fits with the
    other settings as given, None when none does.
    """

    plan: Plan
    changed: tuple[str, ...]
    peak_bytes: int
    planned_peak_bytes: int  # the plan's own, from its recorded parts
    line_bytes: int
    commit_bytes: int  # the host's planned commit charge with these settings
    planned_commit_bytes: int
    commit_limit_bytes: int | None  # RAM x overcommit_ratio / 100 (None: not mode 2)
    largest_ctx: int | None = None
    #: The peak after a cold first start (``Budget.first_start_hot_bytes``) and what it may
    #: be: MemoryMax plus the device bytes outside the cgroup (None: not checked).
    start_bytes: int = 0
    start_limit_bytes: int | None = None

    @property
    def peak_fits(self) -> bool:
        return self.peak_bytes <= self.line_bytes

    @property
    def start_fits(self) -> bool:
        return self.start_limit_bytes is None or self.start_bytes <= self.start_limit_bytes

    @property
    def commit_fits(self) -> bool:
        return (
            self.commit_limit_bytes is None
            or commit_ratio(self.commit_bytes, self.plan.board.ram_bytes)
            <= self.plan.kernel.overcommit_ratio
        )

    @property
    def fits(self) -> bool:
        return self.peak_fits and self.start_fits and self.commit_fits


def plan_isa(plan: Plan, facts: ModelFacts) -> str:
    """The ISA the plan's repacked weights were budgeted for: the one whose repacking of
    this model gives the plan's ``weights_repacked`` part, else the board profile's."""
    recorded = plan.part("weights_repacked")
    if recorded is not None:
        for isa in REPACK_RULES:
            if repacked_bytes(facts, isa) == recorded.bytes:
                return isa
    profile = PROFILES.get(plan.board.name)
    return profile.isa if profile is not None else PROFILES["generic"].isa


def budget_input(plan: Plan, facts: ModelFacts, engine: EngineSettings, isa: str) -> BudgetInput:
    """What :func:`~slmguard.plan.budget.compute_budget` takes for ``engine`` on the
    plan's board (its CPUs and reserves), as the planner gives it."""
    board, limits = plan.board, plan.limits
    offloaded = engine.n_gpu_layers > 0 and engine.device != "none"
    return BudgetInput(
        facts=facts,
        n_ctx=engine.n_ctx,
        n_batch=engine.n_batch,
        n_ubatch=engine.n_ubatch,
        n_threads=engine.n_threads,
        n_parallel=engine.n_parallel,
        kv_unified=engine.kv_unified,
        kv_type=engine.kv_type,
        flash_attn=engine.flash_attn,
        swa_full=engine.swa_full,
        cache_ram_mib=engine.cache_ram_mib,
        use_mmap=engine.use_mmap,
        use_mlock=engine.use_mlock,
        isa=isa,
        n_cpus=len(board.cpus),
        npu_reserve_bytes=board.npu_reserve_bytes,
        os_reserve_bytes=limits.os_reserve_bytes,
        business_reserve_bytes=limits.business_reserve_bytes,
        gpu_device=offloaded,
        gpu_build=engine.backend if engine.backend != "cpu" else None,
        n_gpu_layers=engine.n_gpu_layers if offloaded else 0,
        kv_offload=engine.kv_offload,
    )


def _corrected(recorded: tuple[BudgetPart, ...], old: Budget, new: Budget) -> Budget:
    """``new`` with each part moved by what the plan records differently from ``old``
    (the same arithmetic at the plan's settings); parts the arithmetic makes at neither
    setting are kept as recorded."""
    plan_parts = {p.name: p.bytes for p in recorded}
    old_parts = {p.name: p.bytes for p in old.parts}
    parts = []
    for p in new.parts:
        if p.name in plan_parts and p.name in old_parts:
            p = dataclasses.replace(
                p, bytes=max(0, p.bytes + plan_parts[p.name] - old_parts[p.name])
            )
        parts.append(p)
    made = {p.name for p in new.parts} | set(old_parts)
    parts.extend(p for p in recorded if p.name not in made)
    return dataclasses.replace(new, parts=tuple(parts))


def rebudget(plan: Plan, facts: ModelFacts, engine: EngineSettings) -> Rebudget:
    """``plan`` re-budgeted for ``engine`` (see the module docstring); raises ValueError
    for settings the budget cannot hold (a quantized KV cache without flash attention)."""
    isa = plan_isa(plan, facts)
    old = compute_budget(budget_input(plan, facts, plan.engine, isa))
    recorded = dataclasses.replace(old, parts=plan.budget)
    limit = None
    if plan.kernel.overcommit_memory == 2:
        limit = plan.board.ram_bytes * plan.kernel.overcommit_ratio // 100

    def measured(e: EngineSettings) -> Rebudget:
        new = _corrected(plan.budget, old, compute_budget(budget_input(plan, facts, e, isa)))
        return Rebudget(
            plan=dataclasses.replace(plan, engine=e, budget=new.parts, first_start=new.first_start),
            changed=changed_fields(plan.engine, e),
            peak_bytes=new.hot_bytes,
            planned_peak_bytes=recorded.hot_bytes,
            line_bytes=recovery_line(
                plan.limits.memory_high_bytes, plan.limits.device_bytes, plan.watermarks
            ),
            commit_bytes=plan.kernel.commit_charge_bytes
            + new.first_start_commit_bytes
            - old.first_start_commit_bytes,
            planned_commit_bytes=plan.kernel.commit_charge_bytes,
            commit_limit_bytes=limit,
            start_bytes=new.first_start_hot_bytes,
            start_limit_bytes=plan.limits.memory_max_bytes + plan.limits.device_bytes,
        )

    result = measured(engine)
    if result.fits:
        return result
    largest = _largest(top_ctx(facts), lambda ctx: measured(_with_ctx(engine, ctx)).fits)
    return dataclasses.replace(result, largest_ctx=largest)


def _with_ctx(engine: EngineSettings, ctx_slot: int) -> EngineSettings:
    """``engine`` with ``ctx_slot`` tokens per slot (``-c`` = that x the slots, as the
    planner and serve's ``--ctx`` write it)."""
    return dataclasses.replace(engine, n_ctx=ctx_slot * engine.n_parallel)


def _largest(top: int, fits: Callable[[int], bool]) -> int | None:
    """The largest context per slot from ``top`` down to MIN_CTX, in 256s, that fits
    (memory grows with it: bisect), or None."""
    cands = list(range(top, MIN_CTX - 1, -CTX_STEP))
    lo, hi, best = 0, len(cands) - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        if fits(cands[mid]):
            best, hi = cands[mid], mid - 1
        else:
            lo = mid + 1
    return best
