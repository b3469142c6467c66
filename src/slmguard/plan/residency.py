"""A board plan's models as the server runs them: names, peaks, what may be resident.

Owns the questions the server and the governor ask of a plan with several models
(issue 39): every model with its :class:`~slmguard.plan.schema.Serving` (the primary's
defaults when the plan has none), found by name or alias (:func:`find`); each one's planned
peak (its budget's :func:`~slmguard.plan.parts.hot_bytes`); whether a set of models may be
resident together (:func:`resident_together`: within one of the plan's recorded
``resident_sets``, which the planner computed against the recovery line); the order the
degrade ladder takes them in (:func:`degrade_order`); and the budget input that re-makes a
board model's budget (:func:`model_budget_input`). Pure, on a loaded plan; it chooses
nothing (:mod:`slmguard.plan.board` plans the board) and never reads a file.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from dataclasses import dataclass

from slmguard.plan.modelfacts import ModelFacts
from slmguard.plan.parts import BudgetInput, hot_bytes
from slmguard.plan.schema import (
    SERVED_NAME_PATTERN,
    BudgetInputs,
    BudgetPart,
    EngineSettings,
    ModelSpec,
    Plan,
    Serving,
)

#: The primary model's priority when the plan does not say (a one-model plan); the others'
#: default (``plan --model SPEC``) is :data:`OTHER_PRIORITY`, below it.
PRIMARY_PRIORITY = 100
OTHER_PRIORITY = 50


@dataclass(frozen=True)
class PlannedModel:
    """One model of a plan: the primary (``index`` None: ``plan.model``, ``plan.engine``,
    ``plan.budget``, whose parts hold the front and the board's reserves) or
    ``plan.models[index]``."""

    serving: Serving
    model: ModelSpec
    engine: EngineSettings
    budget: tuple[BudgetPart, ...]
    index: int | None = None

    @property
    def peak_bytes(self) -> int:
        """Its planned peak: what it holds resident at full load (the primary's with the
        front's parts)."""
        return hot_bytes(self.budget)

    @property
    def pinned(self) -> bool:
        return self.serving.residency == "pinned"


def served_name(model: ModelSpec) -> str:
    """The name a model is served as when none is given (:func:`name_for` its file or
    preset)."""
    return name_for(model.path, model.preset)


def name_for(path: str | None, preset: str | None) -> str:
    """A model's name from its file's name without ``.gguf`` (as ``serve`` names it), or
    its preset's, made fit for :data:`~slmguard.plan.schema.SERVED_NAME_PATTERN` (other
    characters become ``-``); "" when nothing of it is left."""
    raw = path.rsplit("/", 1)[-1].removesuffix(".gguf") if path else preset
    name = re.sub(r"[^A-Za-z0-9._:/@+-]", "-", raw or "").lstrip("._:/@+-")[:128]
    return name if re.fullmatch(SERVED_NAME_PATTERN, name) else ""


def primary_serving(plan: Plan) -> Serving:
    """How the primary model is served: as the plan says, else pinned, for chat, under its
    file's name."""
    if plan.serving is not None:
        return plan.serving
    return Serving(name=served_name(plan.model) or "model", priority=PRIMARY_PRIORITY)


def planned_models(plan: Plan) -> tuple[PlannedModel, ...]:
    """Every model of the plan, the primary first, then ``plan.models`` in order."""
    primary = PlannedModel(primary_serving(plan), plan.model, plan.engine, plan.budget)
    return (
        primary,
        *(
            PlannedModel(m.serving, m.model, m.engine, m.budget, i)
            for i, m in enumerate(plan.models)
        ),
    )


def find(plan: Plan, name: str) -> PlannedModel | None:
    """The model answering to ``name`` (its name or an alias), or None."""
    return next((m for m in planned_models(plan) if name in m.serving.names), None)


def resident_together(plan: Plan, names: Iterable[str]) -> bool:
    """Whether the models named (by their names, not aliases) may be resident at once:
    all within one of the plan's resident sets (a one-model plan: the primary alone)."""
    wanted = set(names)
    if not plan.models:
        return wanted <= {primary_serving(plan).name}
    return any(wanted <= set(rs.models) for rs in plan.resident_sets)


def degrade_order(plan: Plan) -> tuple[str, ...]:
    """The models' names in the order the governor's degrade ladder acts on them: the
    lowest priority first; of equal priority, the one listed later first."""
    models = list(enumerate(planned_models(plan)))
    ordered = sorted(models, key=lambda im: (im[1].serving.priority, -im[0]))
    return tuple(m.serving.name for _, m in ordered)


def board_model_inputs(inputs: BudgetInputs) -> BudgetInputs:
    """A board model's budget inputs: the plan's, with the board's reserves at 0 (the
    primary's budget holds them, once)."""
    board = dataclasses.replace(
        inputs.board, npu_reserve_bytes=0, os_reserve_bytes=0, business_reserve_bytes=0
    )
    return dataclasses.replace(inputs, board=board)


def model_budget_input(
    plan: Plan, index: int, facts: ModelFacts, engine: EngineSettings | None = None
) -> BudgetInput:
    """What :func:`~slmguard.plan.budget.compute_budget` takes to re-make the budget of
    ``plan.models[index]`` (at ``engine``, else its planned settings): no front process,
    no reserves. A board plan always records its budget inputs."""
    if plan.budget_inputs is None:
        raise ValueError("a plan with several models records its budget_inputs")
    inputs = board_model_inputs(plan.budget_inputs)
    chosen = engine if engine is not None else plan.models[index].engine
    return BudgetInput(facts, chosen, inputs.board, inputs.gpu, front_process=False)
