"""A board's plan: several models and the board's other services under one budget.

Owns :func:`make_board_plan` (issue 39). The neighbours' memory joins the business
reserve (the inference zone, MemoryMax and every line are that much lower); each other
model is planned at its context (asked, else :data:`OTHER_CTX` or its trained length) with
no front and no reserves; the primary model is then planned by the one planner with the
pinned models and the largest on-demand one beside it (its context the largest that still
fits, or the one asked); the sets of models that may be resident together are every set
of on-demand models whose planned peak, beside the pinned ones, passes the planner's own
rule (:meth:`~slmguard.plan.configs.Configs.fits`), and the plan keeps the largest ones.
Refused (PlanError, 78) with the numbers when the pinned models and the neighbours do not
fit, or an on-demand model could never be loaded. Pure: the caller reads the headers.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from slmguard.errors import PlanError
from slmguard.plan import boardwords, reasons
from slmguard.plan.configs import Beside, Config, Configs, PlanRequest
from slmguard.plan.limits import MAX_OVERCOMMIT_RATIO, commit_headroom, zone_bytes
from slmguard.plan.parts import Budget
from slmguard.plan.planner import make_plan
from slmguard.plan.schema import (
    BoardModel,
    BudgetPart,
    Neighbour,
    Plan,
    ResidentSet,
    Serving,
)

#: The context per slot of a board's other model when none is asked for (at most its
#: trained length): the primary model gets the largest context that fits beside them.
OTHER_CTX = 2048
#: The reasons of a board's other model kept in its plan (the engine's; the limits,
#: watermarks and kernel settings are the board's, in the plan's own reasons).
MODEL_REASONS = ("n_ctx", "slots", "flash_attn", "n_batch", "kv_type", "swa", "cache_ram",
                 "n_threads")  # fmt: skip


@dataclass(frozen=True)
class OtherModel:
    """A model of the board beside the primary one: what to plan for (``request``: its
    facts and file or preset, ``ctx`` per slot and the engine settings fixed) and how it
    is served."""

    request: PlanRequest
    serving: Serving


@dataclass(frozen=True)
class BoardRequest:
    """The board: the primary model (``primary``: the planner's request, its board and
    GPU the board's), how it is served (None with no other model), the other models and
    the neighbours."""

    primary: PlanRequest
    serving: Serving | None = None
    others: tuple[OtherModel, ...] = ()
    neighbours: tuple[Neighbour, ...] = ()


@dataclass(frozen=True)
class _Planned:
    """One other model as planned: its sub-plan (engine, budget, reasons) and budget."""

    other: OtherModel
    plan: Plan
    budget: Budget

    @property
    def name(self) -> str:
        return self.other.serving.name

    @property
    def pinned(self) -> bool:
        return self.other.serving.residency == "pinned"


def _sizes(neighbours: Sequence[Neighbour]) -> list[tuple[str, int]]:
    return [(n.name, n.memory_bytes) for n in neighbours]


def _with_neighbours(req: BoardRequest) -> PlanRequest:
    """The primary's request on the board whose business reserve holds the neighbours."""
    board = req.primary.board
    held = sum(n.memory_bytes for n in req.neighbours)
    wider = dataclasses.replace(board, business_reserve_bytes=board.business_reserve_bytes + held)
    if req.neighbours and zone_bytes(wider) <= 0:
        raise boardwords.refuse_neighbours(
            board=board.name, each=_sizes(req.neighbours), os_bytes=board.os_reserve_bytes,
            own_bytes=board.business_reserve_bytes, npu_bytes=board.npu_reserve_bytes,
            ram_bytes=board.ram_bytes,
        )  # fmt: skip
    return dataclasses.replace(req.primary, board=wider)


def _plan_other(other: OtherModel, primary: PlanRequest) -> _Planned:
    """One other model at its context, on the board's CPU (a GPU build's engine with no
    device: its instance is budgeted), without the front and the reserves."""
    req = other.request
    engine = {"n_parallel": 1, **req.engine}
    if primary.gpu is not None:
        engine["n_gpu_layers"] = 0
    ctx = req.ctx if req.ctx is not None else min(OTHER_CTX, req.facts.n_ctx_train)
    sub = dataclasses.replace(
        req, board=primary.board, ctx=ctx, engine=engine, gpu=primary.gpu,
        watermarks=primary.watermarks, front_process=False,
    )  # fmt: skip
    try:
        plan = make_plan(sub)
    except PlanError as err:
        raise boardwords.refuse_model(
            board=primary.board.name, name=other.serving.name, err=err
        ) from err
    return _Planned(other, plan, Configs(sub).budget(plan.engine))


def _beside(models: Sequence[_Planned]) -> Beside:
    """The pinned models and the largest on-demand one (by peak, and by commit charge)."""
    pinned = [m for m in models if m.pinned]
    demand = [m for m in models if not m.pinned]
    hot = sum(m.budget.hot_bytes for m in pinned)
    commit = sum(m.budget.first_start_commit_bytes for m in pinned)
    words = [f"{m.name} {reasons.mib(m.budget.hot_bytes)}" for m in pinned]
    if demand:
        largest = max(demand, key=lambda m: m.budget.hot_bytes)
        hot += largest.budget.hot_bytes
        commit += max(m.budget.first_start_commit_bytes for m in demand)
        words.append(f"{largest.name} {reasons.mib(largest.budget.hot_bytes)} on demand")
    return Beside(hot, commit, ", ".join(words))


def _plan_primary(req: BoardRequest, primary: PlanRequest, models: list[_Planned]) -> Plan:
    """The primary model beside the others, or the refusal that names what does not fit."""
    each = _sizes(req.neighbours)
    try:
        return make_plan(dataclasses.replace(primary, beside=_beside(models)))
    except PlanError as err:
        pinned = [m for m in models if m.pinned]
        if len(pinned) == len(models):
            raise boardwords.refuse_pinned(board=primary.board.name, err=err, each=each) from err
        try:
            make_plan(dataclasses.replace(primary, beside=_beside(pinned)))
        except PlanError as pinned_err:
            raise boardwords.refuse_pinned(
                board=primary.board.name, err=pinned_err, each=each
            ) from err
        largest = max((m for m in models if not m.pinned), key=lambda m: m.budget.hot_bytes)
        raise boardwords.refuse_on_demand(
            board=primary.board.name, name=largest.name, peak_bytes=largest.budget.hot_bytes,
            err=err, each=each,
        ) from err  # fmt: skip


@dataclass(frozen=True)
class _SetCheck:
    """The planner's rule for the primary's configuration with a set of models beside it."""

    primary: PlanRequest
    config: Config

    def configs(self, models: Sequence[_Planned]) -> Configs:
        beside = Beside(
            sum(m.budget.hot_bytes for m in models),
            sum(m.budget.first_start_commit_bytes for m in models),
        )
        return Configs(dataclasses.replace(self.primary, beside=beside))

    def fits(self, models: Sequence[_Planned]) -> bool:
        p = self.configs(models)
        p.layers = self.config.layers
        return p.fits(self.config)


def _resident_sets(check: _SetCheck, models: list[_Planned]) -> list[tuple[_Planned, ...]]:
    """The largest sets of models (every pinned one in each) that fit together."""
    pinned = tuple(m for m in models if m.pinned)
    demand = [m for m in models if not m.pinned]
    fitting = [
        pinned + combo
        for n in range(len(demand), -1, -1)
        for combo in itertools.combinations(demand, n)
        if check.fits(pinned + combo)
    ]
    largest: list[tuple[_Planned, ...]] = []
    for s in fitting:  # the larger sets come first
        if not any({m.name for m in s} <= {m.name for m in big} for big in largest):
            largest.append(s)
    return largest


def _primary_parts(plan: Plan, req: BoardRequest) -> tuple[BudgetPart, ...]:
    """The primary's parts with the neighbours apart from the board's business reserve."""
    if not req.neighbours:
        return plan.budget
    own = req.primary.board.business_reserve_bytes
    held = ", ".join(f"{n.name} {reasons.mib(n.memory_bytes)}" for n in req.neighbours)
    out: list[BudgetPart] = []
    for part in plan.budget:
        if part.name == "business_reserve":
            if own:
                out.append(dataclasses.replace(part, bytes=own))
            out.append(
                BudgetPart(
                    "neighbours", part.bytes - own, "load", "reserve",
                    f"the board's other services in the business slice: {held}"[:1024],
                )
            )  # fmt: skip
        else:
            out.append(part)
    return tuple(out)


def _kernel_and_reason(
    plan: Plan, check: _SetCheck, sets: list[tuple[_Planned, ...]], primary_budget: Budget
) -> tuple[Plan, str]:
    """The commit charge of the set that commits most, its overcommit ratio and reason."""
    worst = max(sets, key=lambda s: sum(m.budget.first_start_commit_bytes for m in s))
    p = check.configs(worst)
    commit = p.commit(primary_budget)
    ratio = max(50, p.commit_ratio(commit))
    board = check.primary.board
    host = (board.committed_bytes or 0) > board.os_reserve_bytes + board.business_reserve_bytes
    why = reasons.overcommit(
        ratio=ratio, ram_bytes=board.ram_bytes, commit_bytes=commit,
        service_bytes=primary_budget.service_commit_bytes + p.beside.commit_bytes,
        compute_bytes=primary_budget.compute_reserved_bytes
        + sum(m.budget.compute_reserved_bytes for m in worst),
        first_start_bytes=primary_budget.first_start_bytes,
        committed_bytes=(board.committed_bytes or 0) if host else None,
        headroom=commit_headroom(p.marks),
    )  # fmt: skip
    kernel = dataclasses.replace(plan.kernel, commit_charge_bytes=commit, overcommit_ratio=ratio)
    return dataclasses.replace(plan, kernel=kernel), why


def _board_model(m: _Planned) -> BoardModel:
    return BoardModel(
        serving=m.other.serving,
        model=m.plan.model,
        engine=m.plan.engine,
        budget=m.plan.budget,
        reasons={k: v for k, v in m.plan.reasons.items() if k in MODEL_REASONS},
    )


def make_board_plan(req: BoardRequest) -> Plan:
    """The plan of the whole board (module docstring); a plain plan with neither other
    models nor neighbours."""
    primary = _with_neighbours(req)
    models = [_plan_other(o, primary) for o in req.others]
    plan = _plan_primary(req, primary, models)
    plan = dataclasses.replace(plan, budget=_primary_parts(plan, req), neighbours=req.neighbours)
    why = dict(plan.reasons)
    if req.neighbours:
        why["neighbours"] = boardwords.neighbours(
            each=_sizes(req.neighbours), own_bytes=req.primary.board.business_reserve_bytes
        )
    if not models:
        return dataclasses.replace(plan, serving=req.serving, reasons=why)
    serving = req.serving or Serving(name="model")
    configs = Configs(primary)
    primary_budget = configs.budget(plan.engine)
    check = _SetCheck(primary, Config(plan.engine, primary_budget, primary_budget))
    sets = _resident_sets(check, models)
    placed = {m.name for s in sets for m in s}
    never = [m for m in models if m.name not in placed]
    if never:  # the primary's search left room for each alone: only the commit can do this
        raise PlanError(
            f"board {primary.board.name}: the on-demand model {never[0].name} fits in no "
            "resident set (its commit charge beside the pinned models is above ratio "
            f"{MAX_OVERCOMMIT_RATIO})",
            hint=f"a smaller context for {never[0].name} (ctx=) or fewer pinned models",
        )
    plan, why["overcommit"] = _kernel_and_reason(plan, check, sets, primary_budget)
    line = check.configs([]).line_for(primary_budget)
    resident = [
        ResidentSet(
            models=(serving.name, *(m.name for m in s)),
            peak_bytes=check.configs(s).peak(primary_budget),
        )
        for s in sets
    ]
    why["models"] = boardwords.models(
        each=[
            (serving.name, serving.role, serving.residency, serving.priority,
             primary_budget.hot_bytes),
            *((m.name, m.other.serving.role, m.other.serving.residency,
               m.other.serving.priority, m.budget.hot_bytes) for m in models),
        ]
    )  # fmt: skip
    why["resident_sets"] = boardwords.resident_sets(
        sets=[(rs.models, rs.peak_bytes) for rs in resident], line_bytes=line
    )
    return dataclasses.replace(
        plan,
        serving=serving,
        models=tuple(_board_model(m) for m in models),
        resident_sets=tuple(resident),
        reasons=why,
    )
