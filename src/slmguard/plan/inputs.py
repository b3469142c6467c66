"""What to plan for: the model and the board, resolved from the CLI's choices.

Owns turning ``--model`` / ``--preset`` / nothing (the embedded model) and
``--board NAME|auto`` into the planner's :class:`~slmguard.plan.planner.PlanRequest`.
It reads (the GGUF header, the host under ``root``); the planner stays pure and
only the CLI prints. ``plan`` and ``doctor`` share it so they plan alike.

The embedded model is also a preset with its exact file size: where the model
package (the ``serve`` extra) is not installed, planning falls back to that
preset and says so in :attr:`PlanInputs.notes`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from slmguard.errors import EngineUnavailableError, UsageError
from slmguard.plan.boards import detect_board, get_profile
from slmguard.plan.planner import PlanChoices, PlanRequest, make_plan
from slmguard.plan.schema import Plan

DEFAULT_PRESET = "gemma-3-270m-it:Q4_K_M"


@dataclass(frozen=True)
class PlanInputs:
    """The planner's request plus what the CLI should tell the user about it."""

    request: PlanRequest
    detected_from: str
    notes: tuple[str, ...] = ()


def resolve(
    root: Path,
    *,
    model: Path | None = None,
    preset: str | None = None,
    board: str = "auto",
    ctx: int | None = None,
    choices: PlanChoices | None = None,
) -> PlanInputs:
    """Resolve the model and board; raises the usual ModelError/PlanError/UsageError."""
    if model is not None and preset is not None:
        raise UsageError("give either --model or --preset, not both")
    if ctx is not None and ctx < 1:
        raise UsageError(f"--ctx {ctx}: must be a positive number of tokens")
    choices = choices or PlanChoices()
    choices.validate()
    profile = detect_board(root) if board == "auto" else get_profile(board)
    notes: list[str] = []
    path = model
    if preset is None and path is None:
        from slmguard import paths
        from slmguard.default_model import ensure_default_model

        try:
            path = ensure_default_model(paths.model_dir())
        except EngineUnavailableError:
            preset = DEFAULT_PRESET
            notes.append(
                f"the default model package is not installed; planning for preset {preset}"
            )
    if preset is not None:
        from slmguard.plan.presets import preset_facts

        facts, p, quant = preset_facts(preset)
        request = PlanRequest(facts=facts, board=profile, ctx=ctx, preset=p.name, quant=quant)
    else:
        from slmguard.plan.modelfacts import read_model_facts

        assert path is not None
        request = PlanRequest(
            facts=read_model_facts(path),
            board=profile,
            ctx=ctx,
            model_path=str(Path(path).resolve()),
        )
    request = dataclasses.replace(
        request,
        slots=choices.slots,
        flash_attn=choices.flash_attn,
        kv_unified=choices.kv_unified,
        cache_ram_mib=choices.cache_ram_mib,
        watermarks=choices.watermarks,
    )
    return PlanInputs(request=request, detected_from=profile.detected_from, notes=tuple(notes))


def plan_for(
    root: Path,
    *,
    model: Path | None = None,
    preset: str | None = None,
    board: str = "auto",
    ctx: int | None = None,
    choices: PlanChoices | None = None,
) -> tuple[Plan, PlanInputs]:
    """Resolve, then plan: the plan and what was resolved (for the CLI's notes)."""
    inputs = resolve(root, model=model, preset=preset, board=board, ctx=ctx, choices=choices)
    return make_plan(inputs.request), inputs
