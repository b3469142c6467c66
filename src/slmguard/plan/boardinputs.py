"""What to plan for a board: the models and neighbours the CLI named, resolved (issue 39).

Owns turning ``plan``'s parsed ``--model SPEC`` and ``--neighbour SPEC`` values
(:mod:`slmguard.plan.boardargs`) into :class:`~slmguard.plan.board.BoardRequest`: each
model's facts (its GGUF header, a preset, or the embedded model, through
:func:`slmguard.plan.inputs.resolve`), how it is served (its name, by default its file's;
its role, by default what its GGUF declares: rank pooling a reranker, another pooling an
embedding model, else chat), the neighbours' memory (given, or read from the running
unit's MemoryPeak/MemoryCurrent through :mod:`slmguard.host.systemd`); then the board's
plan (:func:`~slmguard.plan.board.make_board_plan`) with every planned file hashed, as
:func:`slmguard.plan.inputs.plan_for` does for one. Every bad input is a UsageError (64).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path

from slmguard.errors import UsageError
from slmguard.host import systemd
from slmguard.plan.board import BoardRequest, OtherModel, make_board_plan
from slmguard.plan.boardargs import ModelArg, NeighbourArg
from slmguard.plan.inputs import PlanChoices, PlanInputs, identified, resolve
from slmguard.plan.model import ProgressFn
from slmguard.plan.modelfacts import ModelFacts
from slmguard.plan.overrides import flag
from slmguard.plan.residency import OTHER_PRIORITY, PRIMARY_PRIORITY, name_for
from slmguard.plan.schema import (
    MAX_BOARD_MODELS,
    MAX_NEIGHBOURS,
    ModelSpec,
    Neighbour,
    Plan,
    Serving,
)

MiB = 1 << 20
#: llama.cpp's ``LLAMA_POOLING_TYPE_RANK``: a reranker's pooling (``<arch>.pooling_type``).
POOLING_RANK = 4


def default_role(facts: ModelFacts) -> str:
    """What a model is served for unless told: its GGUF's pooling type says."""
    if facts.pooling_type == POOLING_RANK:
        return "rerank"
    if facts.pooling_type:
        return "embedding"
    return "chat"


def _serving(arg: ModelArg, inputs: PlanInputs, primary: bool, where: str) -> Serving:
    req = inputs.request
    name = arg.name or name_for(req.model_path, req.preset)
    if not name:
        raise UsageError(f"{where}: its file's name makes no model name: add name=NAME")
    role = arg.role or default_role(req.facts)
    if role == "rerank" and req.facts.pooling_type != POOLING_RANK:
        raise UsageError(
            f"{where}: role=rerank, but {req.facts.name} is no reranker (its GGUF declares no "
            "rank pooling)"
        )
    if primary and arg.residency == "on_demand":
        raise UsageError(
            f"{where}: the first --model is the primary model, always resident (its budget "
            "holds the front): list an on-demand model after it"
        )
    return Serving(
        name=name,
        aliases=arg.aliases,
        role=role,
        residency=arg.residency or "pinned",
        priority=arg.priority
        if arg.priority is not None
        else (PRIMARY_PRIORITY if primary else OTHER_PRIORITY),
        idle_unload_s=arg.idle_unload_s or 0,
    )


def _resolve_model(
    root: Path, arg: ModelArg, board: str, ctx: int | None, choices: PlanChoices | None
) -> PlanInputs:
    """The model's facts and the planner's request for it (its board detected as the
    primary's is)."""
    return resolve(
        root,
        model=Path(arg.file) if arg.file is not None else None,
        preset=arg.preset,
        board=board,
        ctx=ctx,
        choices=choices,
    )


def _primary_choices(arg: ModelArg, ctx: int | None, choices: PlanChoices) -> tuple[
    int | None, PlanChoices
]:  # fmt: skip
    """The primary's context and engine choices: the SPEC's or the flags', not both."""
    if arg.ctx is not None and ctx is not None:
        raise UsageError(f"--ctx {ctx} and ctx={arg.ctx} in the first --model: give one")
    slots = choices.engine.get("n_parallel")
    if arg.slots is not None and slots is not None:
        raise UsageError(
            f"{flag('n_parallel')} {slots} and slots={arg.slots} in the first --model: give one"
        )
    if arg.slots is not None:
        choices = dataclasses.replace(choices, engine={**choices.engine, "n_parallel": arg.slots})
    return (arg.ctx if arg.ctx is not None else ctx), choices


def _check_names(servings: Sequence[Serving]) -> None:
    seen: dict[str, int] = {}
    for i, s in enumerate(servings):
        for name in s.names:
            if name in seen:
                raise UsageError(
                    f"--model #{i + 1} answers to {name!r}, as --model #{seen[name] + 1} "
                    "does: give each a name=NAME of its own",
                )
            seen[name] = i


def resolve_neighbours(args: Sequence[NeighbourArg], root: Path) -> tuple[Neighbour, ...]:
    """The neighbours with their memory: given, or read from the running unit."""
    if len(args) > MAX_NEIGHBOURS:
        raise UsageError(f"{len(args)} --neighbour (at most {MAX_NEIGHBOURS})")
    out: list[Neighbour] = []
    for arg in args:
        if any(n.name == arg.name for n in out):
            raise UsageError(f"--neighbour {arg.name}: named twice")
        if arg.unit is not None and any(n.unit == arg.unit for n in out):
            raise UsageError(f"--neighbour {arg.name}: unit {arg.unit} is another's too")
        if arg.memory_bytes is not None:
            out.append(Neighbour(arg.name, arg.memory_bytes, arg.unit, arg.protection))
            continue
        assert arg.unit is not None  # boardargs refuses a neighbour with neither
        memory, source = _unit_memory(arg.name, arg.unit, root)
        out.append(Neighbour(arg.name, memory, arg.unit, arg.protection, source))
    return tuple(out)


def _unit_memory(name: str, unit: str, root: Path) -> tuple[int, str]:
    """A running unit's memory, rounded up to MiB: its MemoryPeak (or MemoryCurrent, when
    systemd has no peak), with where it came from."""
    read = systemd.unit_memory(unit, root)
    if read is None:
        raise UsageError(
            f"--neighbour {name},unit={unit}: cannot ask systemd (not running here, or the "
            "unit is not installed)",
            hint=f"give its size: --neighbour {name}=SIZE,unit={unit}",
        )
    figures = [(b, s) for b, s in ((read.peak_bytes, "memory_peak"),
                                   (read.current_bytes, "memory_current")) if b]  # fmt: skip
    if not figures:
        raise UsageError(
            f"--neighbour {name},unit={unit}: systemd has no memory figure for it "
            f"(ActiveState={read.active_state or 'unknown'}; MemoryAccounting off?)",
            hint=f"start it, or give its size: --neighbour {name}=SIZE,unit={unit}",
        )
    peak = max(b for b, _ in figures)
    source = next(s for b, s in figures if b == peak)
    return -(-peak // MiB) * MiB, source


def board_plan_for(
    root: Path,
    *,
    models: Sequence[ModelArg],
    neighbours: Sequence[NeighbourArg] = (),
    board: str = "auto",
    ctx: int | None = None,
    choices: PlanChoices | None = None,
    digest: bool = True,
    state_dir: Path | None = None,
    progress: Callable[[str], ProgressFn] | None = None,
) -> tuple[Plan, PlanInputs]:
    """The board's plan (module docstring) and the primary's resolved inputs (for the
    CLI's notes). ``models``: the primary first (none: the embedded model);
    ``progress(file name)``: the progress of hashing that file, made when it starts."""
    if len(models) > MAX_BOARD_MODELS:
        raise UsageError(f"{len(models)} --model (at most {MAX_BOARD_MODELS} on a board)")
    args = list(models) or [ModelArg(embedded=True)]
    primary_ctx, primary_choices = _primary_choices(args[0], ctx, choices or PlanChoices())
    found = [_resolve_model(root, args[0], board, primary_ctx, primary_choices)]
    found += [_resolve_model(root, a, board, a.ctx, None) for a in args[1:]]
    servings = [
        _serving(a, inputs, i == 0, f"--model #{i + 1}")
        for i, (a, inputs) in enumerate(zip(args, found, strict=True))
    ]
    _check_names(servings)
    others = tuple(
        OtherModel(
            dataclasses.replace(
                inputs.request, engine={} if a.slots is None else {"n_parallel": a.slots}
            ),
            serving,
        )
        for a, inputs, serving in zip(args[1:], found[1:], servings[1:], strict=True)
    )
    several = len(args) > 1 or not args[0].plain
    plan = make_board_plan(
        BoardRequest(
            primary=found[0].request,
            serving=servings[0] if several else None,
            others=others,
            neighbours=resolve_neighbours(neighbours, root),
        )
    )
    if digest:
        plan = _identified(plan, found, state_dir, progress)
    return plan, found[0]


def _identified(
    plan: Plan,
    found: Sequence[PlanInputs],
    state_dir: Path | None,
    progress: Callable[[str], ProgressFn] | None,
) -> Plan:
    """Every planned file's path, size and sha256 in the plan."""

    def one(spec: ModelSpec, inputs: PlanInputs) -> ModelSpec:
        path = inputs.request.model_path
        shown = progress(Path(path).name) if progress is not None and path else None
        return identified(spec, inputs, state_dir=state_dir, progress=shown)

    primary = one(plan.model, found[0])
    models = tuple(
        dataclasses.replace(m, model=one(m.model, inputs))
        for m, inputs in zip(plan.models, found[1:], strict=True)
    )
    return dataclasses.replace(plan, model=primary, models=models)
