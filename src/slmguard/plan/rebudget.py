"""A plan's budget for other engine settings: the planner's arithmetic, the plan's limits.

Owns :func:`rebudget`. ``serve`` puts its flags over a plan's engine settings; when that
changes what the budget depends on (:func:`changed_fields`: every
:class:`~slmguard.plan.schema.EngineSettings` field but the binary), the budget is made
again with :func:`~slmguard.plan.budget.compute_budget` from the inputs the plan records
(:attr:`Plan.budget_inputs`) and checked against the plan's own limits with the planner's
rules: the planned peak below the recovery line, that peak plus a cold first start within
MemoryMax, the commit charge within the plan's CommitLimit. When it does not fit, the
largest context per slot that does is searched (:func:`slmguard.plan.search.largest`).
Each part is the new figure plus what the plan records differently at its own settings (a
preset planned and a file served, a hand-edited part): the budget at the plan's settings
is that baseline. Pure: the caller reads the model header and its tensor table.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from slmguard.plan.allocation import REPACK_RULES, engine_cells, repacked_bytes
from slmguard.plan.boards import PROFILES
from slmguard.plan.budget import compute_budget
from slmguard.plan.limits import commit_line, recovery_line
from slmguard.plan.modelfacts import ModelFacts
from slmguard.plan.parts import Budget, BudgetInput
from slmguard.plan.projector import VisionInput
from slmguard.plan.schema import (
    BudgetBoard,
    BudgetGpu,
    BudgetInputs,
    BudgetPart,
    EngineSettings,
    Plan,
    budgeted_fields,
)
from slmguard.plan.search import largest, top_ctx


def changed_fields(planned: EngineSettings, engine: EngineSettings) -> tuple[str, ...]:
    """The budgeted fields (:func:`~slmguard.plan.schema.budgeted_fields`) that ``engine``
    changes over ``planned``, in the order :class:`EngineSettings` declares them.

    A context the engine pads to the plan's cells (``--ctx 1000`` over a plan of
    1024 per slot: llama.cpp allocates 256 cells at a time) changes nothing.
    """
    changed = [f for f in budgeted_fields() if getattr(planned, f) != getattr(engine, f)]
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
    def commit_line_bytes(self) -> int | None:
        """Where the commit charge may reach: the commit line of the plan's CommitLimit, or
        the plan's own commit when that is larger (a plan written with the older 10 %
        headroom keeps its own settings)."""
        if self.commit_limit_bytes is None:
            return None
        line = commit_line(self.commit_limit_bytes, self.plan.watermarks)
        return max(line, self.planned_commit_bytes)

    @property
    def commit_fits(self) -> bool:
        line = self.commit_line_bytes
        return line is None or self.commit_bytes <= line

    @property
    def fits(self) -> bool:
        return self.peak_fits and self.start_fits and self.commit_fits


def recorded_inputs(plan: Plan, facts: ModelFacts) -> BudgetInputs:
    """What the plan's budget was computed from: as it records it, or, for a plan from
    before it did (:func:`legacy_inputs`), as far as the plan tells."""
    return plan.budget_inputs if plan.budget_inputs is not None else legacy_inputs(plan, facts)


def legacy_inputs(plan: Plan, facts: ModelFacts) -> BudgetInputs:
    """The inputs of a plan that does not record them: its board's CPUs and reserves, the
    ISA whose repacking of this model gives its ``weights_repacked`` part (else its board
    profile's), the GPU backend its engine names (nothing of the GPU's limits)."""
    isa = None
    recorded = plan.part("weights_repacked")
    if recorded is not None:
        isa = next((i for i in REPACK_RULES if repacked_bytes(facts, i) == recorded.bytes), None)
    if isa is None:
        profile = PROFILES.get(plan.board.name) or PROFILES["generic"]
        isa = profile.isa
    board, limits, backend = plan.board, plan.limits, plan.engine.backend
    return BudgetInputs(
        board=BudgetBoard(
            isa=isa,
            n_cpus=len(board.cpus),
            npu_reserve_bytes=board.npu_reserve_bytes,
            os_reserve_bytes=limits.os_reserve_bytes,
            business_reserve_bytes=limits.business_reserve_bytes,
        ),
        gpu=BudgetGpu(backend) if backend != "cpu" else None,
    )


def budget_input(plan: Plan, facts: ModelFacts, engine: EngineSettings) -> BudgetInput:
    """What :func:`~slmguard.plan.budget.compute_budget` takes for ``engine`` in ``plan``."""
    inputs = recorded_inputs(plan, facts)
    return BudgetInput(facts, engine, inputs.board, inputs.gpu)


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


def rebudget(
    plan: Plan, facts: ModelFacts, engine: EngineSettings, vision: VisionInput | None = None
) -> Rebudget:
    """``plan`` re-budgeted for ``engine`` (see the module docstring), with its projector
    (``vision``: its header's facts and the plan's section) where it has one; raises
    ValueError for settings the budget cannot hold (a quantized KV cache without flash
    attention)."""
    inputs = recorded_inputs(plan, facts)

    def budget(e: EngineSettings) -> Budget:
        return compute_budget(BudgetInput(facts, e, inputs.board, inputs.gpu, vision=vision))

    old = budget(plan.engine)
    recorded = dataclasses.replace(old, parts=plan.budget)
    limit = None
    if plan.kernel.overcommit_memory == 2:
        limit = plan.board.ram_bytes * plan.kernel.overcommit_ratio // 100

    def measured(e: EngineSettings) -> Rebudget:
        new = _corrected(plan.budget, old, budget(e))
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

    def attempt(ctx_slot: int) -> int | None:
        fits = measured(dataclasses.replace(engine, n_ctx=ctx_slot * engine.n_parallel)).fits
        return ctx_slot if fits else None

    return dataclasses.replace(result, largest_ctx=largest(top_ctx(facts), attempt))
