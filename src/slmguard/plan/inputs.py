"""What to plan for: the model and the board, resolved from the CLI's choices.

Owns turning ``--model`` / ``--preset`` / nothing (the embedded model) and
``--board NAME|auto`` into the planner's :class:`~slmguard.plan.planner.PlanRequest`.
It reads (the GGUF header, the host under ``root``); the planner stays pure and
only the CLI prints. ``plan`` and ``doctor`` share it so they plan alike.

Where the embedded model's package (the ``serve`` extra) is not installed,
planning with no model plans that same file from its recorded header facts
(:mod:`slmguard.plan.embedded`) at the path a full install assembles it to, and
says so in :attr:`PlanInputs.notes`: a base and a full install make one plan.

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
from slmguard.plan.modelfacts import ModelFacts
from slmguard.plan.overrides import ProjectorOverrides, flag
from slmguard.plan.planner import make_plan
from slmguard.plan.projector import VisionInput
from slmguard.plan.schema import ModelSpec, Plan, Watermarks
from slmguard.plan.text import shown

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
    projector: ProjectorOverrides = field(default_factory=ProjectorOverrides)

    def validate(self) -> None:
        """UsageError (exit 64) for a value no plan can have."""
        self.projector.check()
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


def _default_model(notes: list[str]) -> tuple[Path, str | None, ModelFacts | None]:
    """The embedded model's path and stamped digest, and its recorded facts where its
    package is not installed (None when the file is there to read; a note in ``notes``)."""
    from slmguard import paths
    from slmguard.default_model import ensure_default_model

    try:
        path = ensure_default_model(paths.model_dir())
    except EngineUnavailableError:
        from slmguard.plan.embedded import recorded

        record = recorded()
        path = paths.model_dir() / record.file_name
        notes.append(
            f"the default model package is not installed here; planning the embedded model "
            f"{record.file_name} from its recorded header (the serve extra assembles it at "
            f"{path})"
        )
        return path, record.sha256, dataclasses.replace(record.facts, path=path)
    from slmguard.default_model import stamped_digest

    return path, stamped_digest(path), None


def _model_request(
    profile: BoardProfile,
    ctx: int | None,
    *,
    path: Path | None,
    preset: str | None,
    facts: ModelFacts | None = None,
) -> PlanRequest:
    """The request for a preset's facts, or for a file's: ``facts`` when known (the
    embedded model's record), else those in its header."""
    if preset is not None:
        from slmguard.plan.presets import preset_facts

        facts, p, quant = preset_facts(preset)
        return PlanRequest(facts=facts, board=profile, ctx=ctx, preset=p.name, quant=quant)
    from slmguard.plan.modelfacts import read_model_facts

    assert path is not None
    return PlanRequest(
        facts=facts if facts is not None else read_model_facts(path),
        board=profile,
        ctx=ctx,
        model_path=os.path.realpath(path),
    )


def _vision(given: ProjectorOverrides, request: PlanRequest) -> VisionInput | None:
    """The projector of ``--mmproj`` (its header read, its width the model's) with the
    image bounds given, or None."""
    if given.mmproj is None:
        return None
    from slmguard.plan.projector import check_text_model, read_projector_facts
    from slmguard.plan.vision import spec_for

    facts = read_projector_facts(given.mmproj)
    facts = dataclasses.replace(facts, path=Path(os.path.realpath(given.mmproj)))
    why = check_text_model(facts, request.facts.n_embd)
    if why is not None:
        raise ModelError(given.mmproj, why, hint="give the projector made for this model")
    return VisionInput(facts, given.over(spec_for(facts)))


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
    known_sha256 = facts = None
    if preset is None and path is None:
        path, known_sha256, facts = _default_model(notes)
    request = _model_request(profile, ctx, path=path, preset=preset, facts=facts)
    request = dataclasses.replace(
        request,
        engine=dict(choices.engine),
        watermarks=choices.watermarks,
        gpu=_gpu(choices, profile, board, root),
        vision=_vision(choices.projector, request),
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
    if digest and plan.projector is not None:
        plan = _projector_digest(plan, inputs, state_dir, progress)
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
    if inputs.model_sha256 is not None:  # the default model: its stamp, or its record
        size = inputs.request.facts.file_bytes  # read from the file, or recorded
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


def _projector_digest(
    plan: Plan, inputs: PlanInputs, state_dir: Path | None, progress: ProgressFn | None
) -> Plan:
    """The plan with its projector's sha256 (hashed as the model is), the file unchanged
    since its header was read."""
    assert plan.projector is not None and inputs.request.vision is not None
    planned = inputs.request.vision.facts
    ident = model_file(planned.path, state_dir=state_dir, progress=progress)
    if ident.file_bytes != planned.file_bytes:
        raise ModelError(
            planned.path,
            f"changed while being planned ({planned.file_bytes:,} bytes, then "
            f"{ident.file_bytes:,})",
            hint="wait until the copy or download has finished",
        )
    spec = dataclasses.replace(
        plan.projector, path=str(ident.path), file_bytes=ident.file_bytes, sha256=ident.sha256
    )
    return dataclasses.replace(plan, projector=spec)
