"""``slmguard plan``: the memory budget and every limit, from the GGUF header."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from slmguard.plan.inputs import PlanInputs
    from slmguard.plan.schema import BudgetPart, Plan

ORDER = 10

log = logging.getLogger(__name__)

_EXAMPLE = """\
Example:
  slmguard plan                                    # the default model, this host
  slmguard plan --preset qwen2.5-3b-instruct --board rk3588-4g
  slmguard plan --model m.gguf --board rpi5-8g --ctx 4096 --json --out plan.json
  slmguard plan --preset qwen2.5-0.5b-instruct --board rk3588-4g --ctx 2048 --n-parallel 1
  slmguard plan --board rk3588-8g --n-parallel 2 --cache-ram-mib 256 --shed-pct 80 --recover-pct 75
  slmguard plan --board jetson-orin-nano-8g --gpu-layers 10 --no-kv-offload
  slmguard plan --board rpi5-8g --gpu none          # CPU only on a board with a GPU
  slmguard plan --model gemma-3-4b-it.gguf --mmproj mmproj.gguf --max-images 1 --board rk3588-8g
  slmguard plan --board rk3588-8g --model chat.gguf --model bge.gguf,role=embedding \
      --model rerank.gguf,on-demand,idle-unload=10m --neighbour whisper=600M,unit=whisper.service

Boards: {boards}
Presets (NAME or NAME:QUANT): {presets}
"""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from slmguard import options
    from slmguard.plan.boards import board_names
    from slmguard.plan.overrides import EngineOverrides, ProjectorOverrides
    from slmguard.plan.presets import PRESETS
    from slmguard.plan.schema import Watermarks

    p = sub.add_parser(
        "plan",
        help="memory budget, context size and limits for a model on a board",
        description="Read the model's GGUF header (or a preset), compute what llama-server "
        "will allocate, fix the governor's watermarks, choose the slots, flash attention, "
        "batch and the largest context per slot whose planned peak stays below the "
        "recovery line, and derive MemoryHigh/MemoryMax, CMA and overcommit settings, each "
        "with its reason. --json prints the versioned plan that render, apply, serve and "
        "watch read with --plan.\n\n"
        + _EXAMPLE.format(boards=", ".join(board_names()), presets=", ".join(PRESETS)),
        formatter_class=options.HelpFormatter,
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--model",
        action="append",
        metavar="SPEC",
        help="a GGUF file (default: the embedded model). Repeated, a board: the first is the "
        "primary model, each SPEC FILE (or file=, preset=NAME, embedded) with optional "
        "name=ID, alias=ID, role=chat|completion|embedding|rerank, pinned|on-demand, "
        "priority=N, idle-unload=SECONDS, ctx=TOKENS, slots=N (docs/plan.md, 'A board')",
    )
    src.add_argument("--preset", help="plan a known model before downloading it")
    p.add_argument(
        "--neighbour",
        action="append",
        default=[],
        metavar="SPEC",
        help="another service on the board and its memory, held apart from the models and "
        "protected: NAME=SIZE (600M, 1.5G), with unit=NAME.service to protect that unit, "
        "and min (MemoryMin=, default) or low (MemoryLow=); NAME,unit=UNIT reads the running "
        "unit's MemoryPeak (repeatable)",
    )
    p.add_argument("--board", default="auto", help="board profile or 'auto' (default)")
    # --ctx and the engine settings the planner takes: their own declarations, as serve's
    options.add_flags(p, EngineOverrides, None, verb="plan")
    _gpu_arguments(p)
    options.add_flags(p, ProjectorOverrides, None, verb="plan")  # --mmproj and image bounds
    w = Watermarks()
    for name, default in (
        ("shed", w.shed_pct),
        ("degrade", w.degrade_pct),
        ("critical", w.critical_pct),
        ("recover", w.recover_pct),
    ):
        p.add_argument(
            f"--{name}-pct",
            type=float,
            default=None,
            help=f"governor {name} watermark, %% of MemoryHigh (default {default:g})",
        )
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON plan here")
    p.add_argument("--root", type=Path, default=Path("/"), help=argparse.SUPPRESS)
    p.set_defaults(run=run)


def _gpu_arguments(p: argparse.ArgumentParser) -> None:
    """Which GPU to plan for (the layers and the KV cache's place are engine settings)."""
    p.add_argument(
        "--gpu",
        choices=("auto", "none", "vulkan", "cuda"),
        default="auto",
        help="offload to the board's GPU when it is CUDA or --gpu-layers asks (auto, "
        "default), not at all (none), or with this backend (vulkan with --board auto on a "
        "host with only lavapipe: Mesa's CPU Vulkan)",
    )


def _mib(n: int) -> str:
    return f"{n / (1 << 20):,.1f} MiB"


_BAR_CHARS = {"anon": "#", "file": "=", "device": "%", "reserve": "."}


def _bar(plan: object, width: int = 60) -> list[str]:
    from slmguard.plan.schema import Plan

    assert isinstance(plan, Plan)
    total = plan.board.ram_bytes
    segs: list[tuple[str, str, int]] = []
    # Every model's parts (a board's other models beside the primary's).
    parts = [*plan.budget, *(p for m in plan.models for p in m.budget)]
    groups = {
        "anon": sum(p.bytes for p in parts if p.kind == "anon"),
        # Cold page cache (repacked tensors' file pages) is reclaimable: not drawn.
        "file": sum(p.bytes for p in parts if p.kind == "file" and p.name != "weights_mapped_cold"),
        "device": sum(p.bytes for p in parts if p.kind == "device"),
        "reserve": sum(p.bytes for p in parts if p.kind == "reserve"),
    }
    for kind, n in groups.items():
        if n:
            segs.append((kind, _BAR_CHARS[kind], n))
    used = sum(n for _, _, n in segs)
    bar = ""
    for _, ch, n in segs:
        bar += ch * max(1, round(n * width / total))
    bar = bar[:width].ljust(width, " ")
    mark = min(width - 1, round(plan.limits.memory_max_bytes * width / total))
    legend = "  ".join(f"{ch} {kind} {_mib(n)}" for kind, ch, n in segs)
    return [
        f"[{bar}] {_mib(total)} RAM",
        " " + " " * mark + f"^ MemoryMax {_mib(plan.limits.memory_max_bytes)}",
        f" {legend}  (free {_mib(max(0, total - used))})",
    ]


def _head_lines(plan: Plan, detected_from: str) -> list[str]:
    """The model and the board the plan is for."""
    m, b = plan.model, plan.board
    src = m.path or f"preset {m.preset} {m.quant}"
    lines = [
        f"model   {m.name} ({m.arch}, {m.n_layer} layers, trained ctx {m.n_ctx_train}) - {src}",
        f"board   {b.name}: {_mib(b.ram_bytes)} RAM, CPUs {','.join(map(str, b.cpus))}, "
        f"big {','.join(map(str, b.big_cores))}",
    ]
    if detected_from:
        lines.append(f"        detected: {detected_from}")
    v = plan.projector
    if v is not None:
        lines.append(
            f"vision  {v.name} ({v.projector_type}, {v.tokens_per_image} tokens an image) - "
            f"{v.path}; {'--mmproj-offload' if v.offload else '--no-mmproj-offload'}, up to "
            f"{v.max_images} image(s) a request"
        )
    return lines


def _budget_lines(plan: Plan) -> list[str]:
    """The budget's parts, one a line, and the service's totals at load and at peak."""
    lines = [f"{'part':<20} {'bytes':>14} {'MiB':>10}  {'when':<5} {'kind':<7} note"]
    lines += [_part_line(p) for p in plan.budget]
    load = sum(
        p.bytes
        for p in plan.budget
        if p.kind in ("anon", "file") and p.when == "load" and p.name != "weights_mapped_cold"
    )
    peak = sum(
        p.bytes
        for p in plan.budget
        if p.kind in ("anon", "file") and p.name != "weights_mapped_cold"
    )
    return [
        *lines,
        f"{'service at load':<20} {load:>14,} {load / (1 << 20):>10.1f}  (hot: without the "
        "cold page cache)",
        f"{'service at peak':<20} {peak:>14,} {peak / (1 << 20):>10.1f}",
        *_first_start_lines(plan, peak),
    ]


def _part_line(p: BudgetPart) -> str:
    return (
        f"{p.name:<20} {p.bytes:>14,} {p.bytes / (1 << 20):>10.1f}  {p.when:<5} "
        f"{p.kind:<7} {p.note}"
    )


def _first_start_lines(plan: Plan, peak: int) -> list[str]:
    """What a cold first start adds beyond the steady state, and the total it reaches."""
    if not plan.first_start:
        return []
    lim = plan.limits
    gpu = sum(p.bytes for p in plan.budget if p.kind == "device" and p.name[:4] == "gpu_")
    total = peak + gpu + sum(p.bytes for p in plan.first_start)
    return [
        "first start only (a cold one: not in the steady state the watermarks are for):",
        *(_part_line(p) for p in plan.first_start),
        f"{'cold start at peak':<20} {total:>14,} {total / (1 << 20):>10.1f}  "
        f"(host{' and GPU' if gpu else ''}; MemoryMax {_mib(lim.memory_max_bytes)}"
        + (f" + {_mib(lim.device_bytes)} outside the cgroup" if lim.device_bytes else "")
        + ")",
    ]


def _settings_lines(plan: Plan) -> list[str]:
    """The engine's flags, the cgroup limits, the watermarks and the kernel settings."""
    e, lim, k, w = plan.engine, plan.limits, plan.kernel, plan.watermarks
    return [
        f"offload {e.n_gpu_layers} layers on {e.device} ({e.backend}), KV "
        f"{'on the device' if e.kv_offload else 'on the host'}, "
        f"{_mib(sum(p.bytes for p in plan.budget if p.kind == 'device' and p.name[:4] == 'gpu_'))}"
        " of GPU buffers"
        if e.n_gpu_layers
        else f"offload none{' (--device none)' if e.device == 'none' else ''}",
        f"engine  n_ctx {e.n_ctx} = {e.n_parallel} slot{'s' if e.n_parallel > 1 else ''} x "
        f"{e.n_ctx_slot}{' (unified)' if e.kv_unified else ''}  n_batch {e.n_batch}  "
        f"n_ubatch {e.n_ubatch}  threads {e.n_threads}  kv {e.kv_type}  "
        f"-fa {'on' if e.flash_attn else 'off'}  cache-ram {e.cache_ram_mib}  CPUAffinity "
        f"{' '.join(map(str, plan.cpu_affinity)) or '(all)'}",
        f"limits  MemoryHigh {_mib(lim.memory_high_bytes)}  MemoryMax "
        f"{_mib(lim.memory_max_bytes)}  OS reserve {_mib(lim.os_reserve_bytes)}  business "
        f"{_mib(lim.business_reserve_bytes)}"
        + (f"  GPU outside the cgroup {_mib(lim.device_bytes)}" if lim.device_bytes else ""),
        f"govern  shed {w.shed_pct:g}%  degrade {w.degrade_pct:g}%  critical "
        f"{w.critical_pct:g}%  recover {w.recover_pct:g}%",
        f"kernel  vm.swappiness={k.swappiness}  vm.overcommit_memory={k.overcommit_memory}  "
        f"vm.overcommit_ratio={k.overcommit_ratio}  commit {_mib(k.commit_charge_bytes)}  "
        f"cma={(str(k.cma_bytes >> 20) + 'M') if k.cma_bytes is not None else '(unchanged)'}",
    ]


def _board_lines(plan: Plan) -> list[str]:
    """A board's models (one engine each), neighbours and resident sets; none for one model."""
    from slmguard.plan.residency import planned_models

    lines: list[str] = []
    if plan.models:
        lines += [
            "models  (one engine each, the primary first; peak: at full load, the primary's "
            "with the front)",
            f"  {'name':<24} {'role':<10} {'residency':<10} {'prio':>4} {'n_ctx':>7} "
            f"{'slots':>5} {'peak MiB':>9}  idle-unload",
        ]
        for m in planned_models(plan):
            s, e = m.serving, m.engine
            idle = f"{s.idle_unload_s} s" if s.idle_unload_s else "-"
            aliases = f"  (also {', '.join(s.aliases)})" if s.aliases else ""
            lines.append(
                f"  {s.name:<24} {s.role:<10} {s.residency.replace('_', '-'):<10} "
                f"{s.priority:>4} {e.n_ctx:>7} {e.n_parallel:>5} "
                f"{m.peak_bytes / (1 << 20):>9.1f}  {idle}{aliases}"
            )
        lines.append("resident together (each set at or below the recovery line):")
        lines += [f"  {' + '.join(rs.models)}: {_mib(rs.peak_bytes)}" for rs in plan.resident_sets]
    if plan.neighbours:
        lines.append("neighbours (in the business slice, protected):")
        lines += [
            f"  {n.name:<24} {_mib(n.memory_bytes):>14}  "
            f"{n.unit or '(no unit)'}  Memory{n.protection.capitalize()}= ({n.source})"
            for n in plan.neighbours
        ]
    return [*lines, ""] if lines else []


def render_text(plan: object, detected_from: str = "") -> str:
    from slmguard.plan.schema import Plan

    assert isinstance(plan, Plan)
    lines = [
        *_head_lines(plan, detected_from),
        "",
        *_budget_lines(plan),
        "",
        *_bar(plan),
        "",
        *_settings_lines(plan),
        "",
        *_board_lines(plan),
        "why:",
    ]
    lines += [f"  {key:<13} {text}" for key, text in plan.reasons.items()]
    return "\n".join(lines) + "\n"


class HashProgress:
    """Progress of hashing a model on stderr: nothing for a hash that ends within
    ``quiet_s`` (the common case, or a cached digest), then a line per 10 %."""

    def __init__(self, what: str, quiet_s: float = 1.0) -> None:
        self.what = what
        self.quiet_s = quiet_s
        self.start = time.monotonic()
        self.shown = -10

    def __call__(self, done: int, total: int) -> None:
        if time.monotonic() - self.start < self.quiet_s:
            return
        pct = done * 100 // max(total, 1)
        if pct >= self.shown + 10 or (done == total and self.shown < 100):
            self.shown = pct
            print(f"slmguard: hashing {self.what}: {pct}% of {_mib(total)}", file=sys.stderr)


def choices_from(args: argparse.Namespace) -> object:
    """The planner's :class:`PlanChoices` from the flags: the engine settings given (by
    their EngineSettings names), the watermarks (only when given), the GPU."""
    from slmguard import options
    from slmguard.plan.inputs import PlanChoices
    from slmguard.plan.overrides import EngineOverrides, ProjectorOverrides
    from slmguard.plan.schema import Watermarks

    given = {
        f"{name}_pct": getattr(args, f"{name}_pct")
        for name in ("shed", "degrade", "critical", "recover")
        if getattr(args, f"{name}_pct") is not None
    }
    engine = EngineOverrides(**options.collect(EngineOverrides, args, None, None, verb="plan"))
    projector = ProjectorOverrides(
        **options.collect(ProjectorOverrides, args, None, None, verb="plan")
    )
    return PlanChoices(
        engine=dict(engine.fields),
        watermarks=Watermarks(**given) if given else None,
        gpu=args.gpu,
        projector=projector,
    )


def _make_plan(args: argparse.Namespace) -> tuple[Plan, PlanInputs]:
    """One model (``--model FILE``, ``--preset``, or neither) as always; a board when
    ``--model`` is repeated or carries items, or ``--neighbour`` is given."""
    import os

    from slmguard.errors import UsageError
    from slmguard.plan.boardargs import parse_model, parse_neighbour
    from slmguard.plan.boardinputs import board_plan_for
    from slmguard.plan.inputs import PlanChoices, plan_for

    choices = choices_from(args)
    assert isinstance(choices, PlanChoices)
    models = [parse_model(text, os.path.isfile) for text in args.model or ()]
    neighbours = [parse_neighbour(text) for text in args.neighbour]
    for m in models:
        if args.out and m.file and os.path.realpath(args.out) == os.path.realpath(m.file):
            raise UsageError(f"--out {args.out} is the model file: the plan would overwrite it")
    if args.preset is not None and neighbours:
        raise UsageError("--neighbour goes with --model SPEC: --model preset=NAME plans a preset")
    if len(models) <= 1 and not neighbours and all(m.plain for m in models):
        model = Path(models[0].file) if models and models[0].file else None
        return plan_for(
            args.root, model=model, preset=args.preset, board=args.board, ctx=args.ctx,
            choices=choices, progress=HashProgress(model.name if model else "the default model"),
        )  # fmt: skip
    return board_plan_for(
        args.root, models=models, neighbours=neighbours, board=args.board, ctx=args.ctx,
        choices=choices, progress=HashProgress,
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    from slmguard import options
    from slmguard.errors import HostWriteError
    from slmguard.plan.planfile import check_plan, dumps_plan

    for message in options.renamed(args):
        log.warning("%s", message)
    plan, inputs = _make_plan(args)
    for note in inputs.notes:
        print(f"slmguard: {note}", file=sys.stderr)
    check_plan(plan)  # what every reader will check, before anything is written
    text = dumps_plan(plan)
    if args.out:
        try:
            args.out.write_text(text, encoding="utf-8")
        except OSError as err:
            raise HostWriteError(args.out, f"cannot write the plan: {err.strerror or err}") from err
    sys.stdout.write(text if args.json else render_text(plan, inputs.detected_from))
    return 0
