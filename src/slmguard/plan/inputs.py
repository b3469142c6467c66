"""What to plan for: the model and the board, resolved from the CLI's choices.

Owns turning ``--model`` / ``--preset`` / nothing (the embedded model) and
``--board NAME|auto`` into the planner's :class:`~slmguard.plan.planner.PlanRequest`.
It reads (the GGUF header, the host under ``root``); the planner stays pure and
only the CLI prints. ``plan`` and ``doctor`` share it so they plan alike.

The embedded model is also a preset with its exact file size: where the model
package (the ``serve`` extra) is not installed, planning falls back to that
preset and says so in :attr:`PlanInputs.notes`.

A plan made from a file records that file's absolute path, size and SHA-256
(:func:`plan_for` hashes it after planning, through ``plan.model``'s digest
cache, reporting progress); ``serve`` checks them at start.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slmguard.errors import EngineUnavailableError, ModelError, UsageError
from slmguard.plan.boards import BoardProfile, GpuProfile, detect_board, get_profile, lavapipe_gpu
from slmguard.plan.configs import FIXABLE, MAX_GPU_LAYERS, MAX_SLOTS, PlanRequest
from slmguard.plan.model import ModelFile, ProgressFn, model_file
from slmguard.plan.overrides import flag
from slmguard.plan.planner import make_plan
from slmguard.plan.schema import ModelSpec, Plan, Watermarks
from slmguard.plan.text import shown

DEFAULT_PRESET = "gemma-3-270m-it:Q4_K_M"


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
            raise UsageError(f"{flag('n_gpu_layers')} {layers}: must be 0 to {MAX_GPU_LAYERS}")
        if self.gpu == "none" and layers:
            raise UsageError(f"{flag('n_gpu_layers')} {layers} with --gpu none")
        if slots is not None and not 1 <= slots <= MAX_SLOTS:
            raise UsageError(f"{flag('n_parallel')} {slots}: must be 1 to {MAX_SLOTS}")
        if cache is not None and cache < 0:
            raise UsageError(
                f"{flag('cache_ram_mib')} {cache}: must be >= 0 MiB (an unlimited prompt cache "
                "cannot be budgeted)"
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
class PlanInputs:
    """The planner's request plus what the CLI should tell the user about it."""

    request: PlanRequest
    detected_from: str
    notes: tuple[str, ...] = ()
    model_sha256: str | None = None  # known without hashing (the verified default model)


def _default_model(notes: list[str]) -> tuple[Path | None, str | None]:
    """The embedded model's path and stamped digest; (None, None) and a note in
    ``notes`` where its package is not installed (then the preset is planned)."""
    from slmguard import paths
    from slmguard.default_model import ensure_default_model

    try:
        path = ensure_default_model(paths.model_dir())
        from slmguard.default_model import stamped_digest

        return path, stamped_digest(path)
    except EngineUnavailableError:
        notes.append(
            f"the default model package is not installed; planning for preset {DEFAULT_PRESET}"
        )
        return None, None


def _model_request(
    profile: BoardProfile, ctx: int | None, *, path: Path | None, preset: str | None
) -> PlanRequest:
    """The request for a preset's facts, or for the facts in a file's header."""
    if preset is not None:
        from slmguard.plan.presets import preset_facts

        facts, p, quant = preset_facts(preset)
        return PlanRequest(facts=facts, board=profile, ctx=ctx, preset=p.name, quant=quant)
    from slmguard.plan.modelfacts import read_model_facts

    assert path is not None
    return PlanRequest(
        facts=read_model_facts(path),
        board=profile,
        ctx=ctx,
        model_path=os.path.realpath(path),
    )


AUTO_BACKENDS = ("cuda",)  # what --gpu auto offloads with; Vulkan needs --gpu vulkan


def _gpu(choices: PlanChoices, profile: BoardProfile, board: str, root: Path) -> GpuProfile | None:
    """The GPU to plan for: none, the backend asked for, or (``auto``) the board's GPU when it
    is CUDA or ``--gpu-layers`` asks for layers on it."""
    choice = choices.gpu
    if choice == "none":
        return None
    if choice == "auto":
        # Vulkan offload only when asked: the engines slmguard builds and packages are CPU
        # builds, and a plan naming Vulkan0 would not start on them.
        asked = choices.engine.get("n_gpu_layers") is not None
        gpu = profile.gpu
        return gpu if gpu is not None and (asked or gpu.backend in AUTO_BACKENDS) else None
    if profile.gpu is not None and profile.gpu.backend == choice:
        return profile.gpu
    if choice == "vulkan" and board == "auto":
        from slmguard.host.gpu import read_gpu

        lavapipe = lavapipe_gpu(read_gpu(root))
        if lavapipe is not None:
            return lavapipe
    known = f"its GPU is {profile.gpu.backend}" if profile.gpu else "it has no GPU slmguard knows"
    raise UsageError(
        f"--gpu {choice}: board {profile.name} cannot offload with {choice} ({known})",
        hint="--gpu auto plans for the board's own GPU; --board auto finds this host's",
    )


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
    known_sha256 = None
    if preset is None and path is None:
        path, known_sha256 = _default_model(notes)
        if path is None:
            preset = DEFAULT_PRESET
    request = _model_request(profile, ctx, path=path, preset=preset)
    request = dataclasses.replace(
        request,
        engine=dict(choices.engine),
        watermarks=choices.watermarks,
        gpu=_gpu(choices, profile, board, root),
    )
    return PlanInputs(
        request=request,
        detected_from=profile.detected_from,
        notes=tuple(notes),
        model_sha256=known_sha256 if preset is None else None,
    )


def plan_for(
    root: Path,
    *,
    model: Path | None = None,
    preset: str | None = None,
    board: str = "auto",
    ctx: int | None = None,
    choices: PlanChoices | None = None,
    digest: bool = True,
    state_dir: Path | None = None,
    progress: ProgressFn | None = None,
) -> tuple[Plan, PlanInputs]:
    """Resolve, then plan: the plan and what was resolved (for the CLI's notes).

    With ``digest`` (the default) a plan for a file records its sha256,
    hashed after planning (so a model that does not fit is refused at once);
    ``doctor``'s on-the-fly plans skip it.
    """
    inputs = resolve(root, model=model, preset=preset, board=board, ctx=ctx, choices=choices)
    plan = make_plan(inputs.request)
    if digest:
        plan = dataclasses.replace(
            plan, model=identified(plan.model, inputs, state_dir=state_dir, progress=progress)
        )
    return plan, inputs


def identified(
    spec: ModelSpec,
    inputs: PlanInputs,
    *,
    state_dir: Path | None = None,
    progress: ProgressFn | None = None,
) -> ModelSpec:
    """``spec`` of a planned file with the file's path, size and sha256 (hashed now, or
    the default model's stamped digest); a preset's as it is. ModelError when the file
    changed while it was being planned."""
    model_path = inputs.request.model_path
    if model_path is None:
        return spec
    if inputs.model_sha256 is not None:  # the default model, verified by its stamp
        size = Path(model_path).stat().st_size
        ident = ModelFile(Path(model_path), size, inputs.model_sha256)
    else:
        ident = model_file(Path(model_path), state_dir=state_dir, progress=progress)
    if ident.file_bytes != inputs.request.facts.file_bytes:
        raise ModelError(
            model_path,
            f"changed while being planned ({inputs.request.facts.file_bytes:,} bytes, "
            f"then {ident.file_bytes:,})",
            hint="wait until the copy or download has finished",
        )
    return dataclasses.replace(
        spec, path=str(ident.path), file_bytes=ident.file_bytes, sha256=ident.sha256
    )
