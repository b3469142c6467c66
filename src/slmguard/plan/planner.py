"""The planner: from model facts and a board profile to a :class:`Plan`.

Owns the choices (context per slot, slots, flash attention, batch, KV type, the layers
on a GPU, threads, CPU affinity, MemoryHigh/MemoryMax, watermarks, CMA, overcommit) and
the rules that say a configuration fits; the policy is docs/plan.md, "How the plan
chooses". Every configuration tried is an :class:`EngineSettings`, budgeted with
:func:`~slmguard.plan.budget.compute_budget` from the :class:`BudgetInputs` the plan
records; the largest context is :func:`slmguard.plan.search.largest`; the reasons'
words are :mod:`slmguard.plan.reasons`. Pure: the caller reads the model header and
the board; nothing here prints or reads a file.
"""

from __future__ import annotations

import dataclasses

from slmguard.errors import PlanError
from slmguard.plan import reasons, refusals
from slmguard.plan.boards import BoardProfile, GpuProfile
from slmguard.plan.budget import compute_budget
from slmguard.plan.configs import (
    FIXABLE,
    IMAGE_TEXT_ROOM,
    KV_TYPES,
    MAX_SLOTS,
    MIN_SLOT_CTX,
    UBATCHES,
    Config,
    Configs,
    PlanRequest,
)
from slmguard.plan.limits import (
    MAX_OVERCOMMIT_RATIO,
    commit_headroom,
    commit_line,
    memory_limits,
    zone_bytes,
)
from slmguard.plan.overrides import flag
from slmguard.plan.parts import Budget, BudgetInput
from slmguard.plan.projector import IMAGE_SPLIT_TOKENS, IMAGE_WRAP_TOKENS, encoder_compute_bytes
from slmguard.plan.schema import (
    KV_TYPES as SCHEMA_KV_TYPES,
)
from slmguard.plan.schema import (
    BoardSpec,
    KernelSettings,
    Limits,
    ModelSpec,
    Plan,
)
from slmguard.plan.search import CTX_STEP, MIN_CTX
from slmguard.plan.vision import DEVICE_PARTS as VISION_DEVICE_PARTS
from slmguard.plan.vision import min_ubatch

MiB = 1 << 20


def _mib(n: float) -> str:
    return reasons.mib(n)


def _check_request(req: PlanRequest) -> None:
    f, e = req.facts, req.engine
    layers, slots, cache = e.get("n_gpu_layers"), e.get("n_parallel"), e.get("cache_ram_mib")
    kv, flash = e.get("kv_type"), e.get("flash_attn")
    unknown = sorted(set(e) - set(FIXABLE))
    if unknown:
        raise PlanError(f"the planner does not take engine.{unknown[0]}")
    if layers is not None and layers > f.n_layer + 1:
        raise PlanError(
            f"{flag('n_gpu_layers')} {layers}: {f.name} has {f.n_layer} layers and the output "
            f"layer, so at most {f.n_layer + 1}",
            hint=f"{flag('n_gpu_layers')} {f.n_layer + 1} offloads all of it",
        )
    if layers and req.gpu is None:
        raise PlanError(
            f"{flag('n_gpu_layers')} {layers}: board {req.board.name} has no GPU slmguard can "
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
    if slots is not None and not 1 <= slots <= MAX_SLOTS:
        raise PlanError(f"{flag('n_parallel')} {slots}: must be 1 to {MAX_SLOTS}")
    if cache is not None and cache < 0:
        raise PlanError(f"{flag('cache_ram_mib')} {cache}: must be >= 0 MiB")
    if kv not in (None, *SCHEMA_KV_TYPES):
        raise PlanError(f"KV type {kv!r}: f16, q8_0 or q4_0")
    if kv not in (None, "f16") and flash is False:
        raise PlanError(f"a {kv} KV cache needs flash attention (-fa on)")
    if req.vision is not None:
        _check_vision(req)


def _check_vision(req: PlanRequest) -> None:
    """A batch or a context asked for that cannot hold the images (PlanError, 78)."""
    v = req.vision
    assert v is not None
    batch = req.engine.get("n_batch")
    if batch is not None and batch < min_ubatch(v.spec.tokens_per_image):
        raise refusals.image_batch(
            batch=batch, tokens=v.spec.tokens_per_image, kind=v.spec.projector_type
        )
    room = v.slot_image_tokens + IMAGE_TEXT_ROOM
    if req.ctx is not None and req.ctx < room:
        raise _image_room(req, req.ctx, asked=True)


def _image_room(req: PlanRequest, ctx_slot: int | None, *, asked: bool) -> PlanError:
    v = req.vision
    assert v is not None
    return refusals.image_room(
        model=req.facts.name, board=req.board.name, max_images=v.spec.max_images,
        image_tokens=v.image_tokens, room=v.slot_image_tokens + IMAGE_TEXT_ROOM,
        text=IMAGE_TEXT_ROOM, ctx_slot=ctx_slot, asked=asked,
    )  # fmt: skip


def _refuse(p: Configs, tried: list[Config], what: str, hints: bool) -> PlanError:
    """Why the smallest configuration tried does not fit (:mod:`slmguard.plan.refusals`)."""
    f, board = p.req.facts, p.board
    best = min(tried, key=lambda c: c.budget.hot_bytes)
    b, peak = best.budget, p.peak(best.budget)
    p.settle(best)
    gpu = p.req.gpu
    heap = gpu.max_bytes if gpu is not None and best.layers else None
    said = {"model": f.name, "board": board.name, "what": what}
    if gpu is not None and heap is not None and b.device_bytes > heap and peak <= p.line:
        return refusals.gpu_heap(
            **said, device_bytes=b.device_bytes, title=gpu.title, heap_bytes=heap
        )
    start, limit = p.start_peak(b), p.start_limit(b)
    if peak <= p.line and start > limit:
        return refusals.first_start(
            **said, start_bytes=start, peak_bytes=peak, first_start_bytes=b.first_start_bytes,
            parts=[x.name for x in b.first_start], memory_max_bytes=p.memory_max,
            limit_bytes=limit,
        )  # fmt: skip
    if peak <= p.line:
        return refusals.commit_limit(
            **said,
            commit_bytes=p.commit(b),
            headroom=commit_headroom(p.marks),
            ram_bytes=board.ram_bytes,
        )
    return refusals.peak(
        **said, peak_bytes=peak, device_bytes=b.device_bytes,
        best=refusals.configuration(
            slots=best.slots, ctx_slot=best.ctx_slot, ubatch=best.ubatch, kv_type=best.kv,
            flash=best.flash,
        ),
        line_bytes=p.line, recover_pct=p.marks.recover_pct, memory_high_bytes=p.memory_high,
        zone_bytes=zone_bytes(board), ram_bytes=board.ram_bytes,
        os_bytes=board.os_reserve_bytes, business_bytes=board.business_reserve_bytes,
        npu_bytes=board.npu_reserve_bytes, beside=p.beside.what,
        hint=_peak_hint(p, peak) + _images_hint(b) if hints else "",
    )  # fmt: skip


def _peak_hint(p: Configs, peak: int) -> str:
    """What would bring a peak over the recovery line under it, naming only what applies:
    the context or slots the caller fixed, a smaller quantization of the preset or a
    smaller preset model (the largest one that plans here), the recovery line raised as
    far as it fits below the shed line (when that plans), a board with more RAM."""
    req, marks = p.req, p.marks
    ways = ["a smaller --ctx"] if req.ctx is not None and req.ctx > MIN_CTX else []
    if (p.fixed("n_parallel") or 1) > 1:
        ways.append(f"fewer {flag('n_parallel')}")
    if not ways:  # nothing the caller fixed is in the way
        ways.append(_smaller_model(req))
        needed = -(-peak * marks.recover_pct // p.line)  # the line is recover_pct of a sum
        raised = dataclasses.replace(marks, recover_pct=float(needed))
        if needed < marks.shed_pct and _plans(dataclasses.replace(req, watermarks=raised)):
            ways.append(f"--recover-pct {needed:g} (nearer the shed line at {marks.shed_pct:g}%)")
    ways.append("a board with more RAM")
    head = f"it is {_mib(peak - p.line)} over the recovery line; "
    return head + ", ".join(ways[:-1]) + " or " + ways[-1]


def _plans(req: PlanRequest) -> bool:
    try:
        make_plan(req, hints=False)
    except PlanError:
        return False
    return True


def _smaller_model(req: PlanRequest) -> str:
    """A smaller quantization of the preset planned, else a smaller preset model: the
    largest that plans on this board with the same request."""
    from slmguard.plan.presets import PRESETS, preset_facts

    size = req.facts.file_bytes
    candidates = sorted(
        ((b, name, q) for name, p in PRESETS.items() for q, b in p.file_bytes.items() if b < size),
        key=lambda c: (c[1] != req.preset, -c[0]),  # the same model first, largest first
    )  # fmt: skip
    for _, name, quant in candidates:
        facts, _, _ = preset_facts(f"{name}:{quant}")
        if _plans(dataclasses.replace(req, facts=facts, preset=name, quant=quant, model_path=None)):
            return f"--preset {name}:{quant}"
    return "a smaller model"


def _images_hint(b: Budget) -> str:
    """What the images a request may carry take of a peak (nothing without a projector)."""
    images = sum(x.bytes for x in b.parts if x.name in ("image_slots", "image_requests"))
    if not images:
        return ""
    return (
        f"; the images requests may carry take {reasons.mib(images)} of it: allow fewer or "
        "smaller ones (--max-images, --max-image-bytes, --max-image-pixels)"
    )


def make_plan(req: PlanRequest, *, hints: bool = True) -> Plan:
    """Choose every setting (docs/plan.md, "How the plan chooses"); raise PlanError when
    nothing fits (with ``hints``, what would fit instead, each tried: :func:`_peak_hint`)."""
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
    p = Configs(req)
    tried: list[Config] = []
    chosen: Config | None = None
    fallback: Config | None = None
    passed: list[tuple[int, Config | None]] = []  # offloaded layer counts not taken
    asked_layers = p.fixed("n_gpu_layers")
    for layers in p.layer_choices():
        p.layers = layers
        found = _search(p, tried)
        if found is not None and (layers == 0 or asked_layers is not None or _roomy(p, found)):
            chosen = found
            break
        fallback = fallback or found
        if layers:
            passed.append((layers, found))
    chosen = chosen or fallback
    if chosen is not None and not chosen.layers and passed:
        p.no_offload = _why_no_offload(p, passed)
    if chosen is None:
        raise _refuse(p, tried, _what(req, asked_layers), hints)
    if chosen.ctx_slot < p.image_room:
        raise _image_room(req, chosen.ctx_slot, asked=False)
    p.settle(chosen)
    return _assemble(p, _place_projector(p, chosen))


def _place_projector(p: Configs, c: Config) -> Config:
    """The chosen configuration with the projector on the GPU when layers are there and
    it fits beside them at the same settings (the limits settled again); else as it is
    (on the host)."""
    if p.req.vision is None or not c.layers:
        return c
    p.projector_offload = True
    offloaded = p.choice(c.ctx_slot, c.slots, c.ubatch, c.kv)
    if offloaded.engine == c.engine and p.fits(offloaded):
        p.settle(offloaded)
        return offloaded
    p.offload_tried = offloaded
    p.projector_offload = False
    return c


def _what(req: PlanRequest, asked_layers: int | None) -> str:
    """What was asked, for a refusal: ``2 slot(s) x n_ctx 4096 with 10 layers on the GPU``."""
    slots = req.engine.get("n_parallel")
    slots_text = f"{slots} slot(s) x " if slots is not None else ""
    what = (
        f"{slots_text}n_ctx {req.ctx}"
        if req.ctx is not None
        else f"{slots_text}any n_ctx >= {MIN_CTX}"
    )
    if asked_layers:
        what += f" with {asked_layers} layers on the GPU"
    return what


def _roomy(p: Configs, c: Config) -> bool:
    """An offloaded configuration worth taking over the CPU alone: the context asked for,
    or one that leaves a slot :data:`MIN_SLOT_CTX` tokens (the trained length if shorter)."""
    return p.req.ctx is not None or c.ctx_slot >= min(MIN_SLOT_CTX, p.top_ctx())


def _why_no_offload(p: Configs, passed: list[tuple[int, Config | None]]) -> str:
    """Why none of the offloaded layer counts ``passed`` (with what each found) was taken.

    The first start is the cause when the steady state alone would have taken one: the
    same search without the first start's parts finds a configuration worth taking, and
    adding them puts it over MemoryMax (or the CommitLimit). Otherwise, too little context
    or nothing that fits, each with the numbers."""
    for layers, _ in passed:
        p.layers, p.first_start = layers, False
        try:
            steady = _search(p, [])
        finally:
            p.layers, p.first_start = 0, True
        if steady is not None and steady.budget.first_start and _roomy(p, steady):
            return _first_start_cause(p, steady)
    found = [(n, c) for n, c in passed if c is not None]
    if found:
        n, c = found[0]
        want = min(MIN_SLOT_CTX, p.top_ctx())
        return reasons.no_offload_less_ctx(layers=n, ctx_slot=c.ctx_slot, want=want)
    return reasons.no_offload_nothing_fits()


def _first_start_cause(p: Configs, c: Config) -> str:
    """The reason for offloading nothing when a cold first start is what does not fit."""
    b = c.budget
    limit = p.start_limit(b)
    outside = limit - memory_limits(p.board, p.outside_bytes(b))[1]
    if p.start_peak(b) > limit:
        over = reasons.over_memory_max(
            peak_bytes=p.peak(b), total_bytes=p.start_peak(b), limit_bytes=limit,
            outside=bool(outside),
        )  # fmt: skip
    else:
        over = reasons.over_commit_limit(
            commit_bytes=p.commit(b), headroom=commit_headroom(p.marks),
            ram_bytes=p.board.ram_bytes, ratio=MAX_OVERCOMMIT_RATIO,
        )  # fmt: skip
    return reasons.no_offload_first_start(
        layers=c.layers, slots=c.slots, ctx_slot=c.ctx_slot, peak_bytes=p.peak(b),
        line_bytes=p.line_for(b), parts=[(x.name, x.bytes) for x in b.first_start], over=over,
    )  # fmt: skip


def _search(p: Configs, tried: list[Config]) -> Config | None:
    """The preferred configuration that fits at ``p.layers`` layers offloaded, or None."""
    asked, asked_slots = p.req.ctx, p.fixed("n_parallel")
    for ub, kv in p.configs():
        for slots in p.slot_choices():
            if asked is not None:
                c = p.choice(-(-asked // CTX_STEP) * CTX_STEP, slots, ub, kv)
                tried.append(c)
                if p.fits(c):
                    return c
                continue
            found = p.largest(slots, ub, kv)
            if found is None:
                tried.append(p.choice(MIN_CTX, slots, ub, kv))
            elif (
                asked_slots is not None
                or slots == 1
                or found.ctx_slot >= max(min(MIN_SLOT_CTX, p.top_ctx()), p.image_room)
            ):
                return found
    return None


def _commit_bound(p: Configs, c: Config) -> int | None:
    """The commit line (at ratio 100) when it, not the peak, stops the next context up."""
    if c.ctx_slot >= p.top_ctx() or not p.req.facts.has_kv_cache:
        return None
    up = p.choice(c.ctx_slot + CTX_STEP, c.slots, c.ubatch, c.kv)
    if p.peak(up.budget) > p.line_for(up.budget):
        return None
    if p.commit_ratio(p.commit(up.budget)) <= MAX_OVERCOMMIT_RATIO:
        return None
    return commit_line(p.board.ram_bytes * MAX_OVERCOMMIT_RATIO // 100, p.marks)


def _engine_reasons(p: Configs, c: Config) -> dict[str, str]:
    """The reasons for the engine's settings, in the order the plan shows them."""
    req, f, b = p.req, p.req.facts, c.budget
    on, off = (b, c.other) if c.flash else (c.other, b)
    more = [s for s in p.slot_choices() if s > c.slots]
    kv_part = b.part("kv_cache")
    out = {
        "n_ctx": reasons.ctx(
            ctx_slot=c.ctx_slot, slots=c.slots, asked=req.ctx, trained=f.n_ctx_train,
            step=CTX_STEP, top=p.top_ctx(), line_bytes=p.line, has_kv_cache=f.has_kv_cache,
            commit_line_bytes=_commit_bound(p, c),
        ),
        "slots": reasons.slots(
            slots=c.slots, asked=p.fixed("n_parallel") is not None,
            more=more[-1] if more else None, min_slot_ctx=min(MIN_SLOT_CTX, p.top_ctx()),
            has_kv_cache=f.has_kv_cache, kv_unified=c.engine.kv_unified,
        ),
        "flash_attn": reasons.flash_attn(
            on=c.flash, reserved_on=on.compute_reserved_bytes,
            reserved_off=off.compute_reserved_bytes, peak_on=on.hot_bytes,
            peak_off=off.hot_bytes, asked=p.fixed("flash_attn") is not None, kv_type=c.kv,
        ),
        "n_batch": _batch_reason(p, c),
        "kv_type": reasons.kv_type(
            kv_type=c.kv, kv_bytes=kv_part.bytes if kv_part else 0,
            first=p.fixed("kv_type") or KV_TYPES[0], has_kv_cache=f.has_kv_cache, arch=f.arch,
        ),
    }  # fmt: skip
    if f.swa_layers and f.has_kv_cache:
        out["swa"] = _swa_reason(p, c)
    out["cache_ram"] = reasons.cache_ram(mib_asked=c.engine.cache_ram_mib)
    t = p.threads
    out["n_threads"] = reasons.threads(n=t.n, big=t.big, quota=t.quota)
    out["cpu_affinity"] = reasons.cpu_affinity(pinned=t.affinity)
    return out


def _batch_reason(p: Configs, c: Config) -> str:
    """n_batch: what its compute buffer reserves, and what the smallest ubatch would save."""
    f, asked = p.req.facts, p.fixed("n_batch")
    smallest = UBATCHES[-1]
    saved = None
    if f.has_kv_cache and c.ubatch != smallest and asked is None:
        alt = p.budget(dataclasses.replace(c.engine, n_batch=smallest, n_ubatch=smallest))
        saved = c.budget.hot_bytes - alt.hot_bytes
    return reasons.batch(
        ubatch=c.ubatch, reserved=c.budget.compute_reserved_bytes, asked=bool(asked),
        first=asked or UBATCHES[0], smallest=smallest, saved=saved,
        has_kv_cache=f.has_kv_cache, arch=f.arch,
    )  # fmt: skip


def _swa_reason(p: Configs, c: Config) -> str:
    """Why --swa-full: the KV cache and checkpoints the plan would have without it (the
    whole cache on the host, whatever is offloaded)."""
    f = p.req.facts
    inputs = p.inputs
    small = compute_budget(
        BudgetInput(f, dataclasses.replace(c.engine, swa_full=False), inputs.board, None, False)
    )
    kv_part, small_kv, ckpt = (
        c.budget.part("kv_cache"), small.part("kv_cache"), small.part("ctx_checkpoints")
    )  # fmt: skip
    return reasons.swa(
        swa_layers=len(f.swa_layers), n_layer=f.n_layer, window=f.sliding_window,
        kv_bytes=kv_part.bytes if kv_part else 0, small_kv_bytes=small_kv.bytes if small_kv else 0,
        checkpoint_bytes=ckpt.bytes if ckpt else 0,
    )  # fmt: skip


def _limit_reasons(p: Configs, c: Config) -> dict[str, str]:
    """Why MemoryMax, MemoryHigh and the governor's watermarks are where they are."""
    board, w = p.board, p.marks
    outside = p.outside_bytes(c.budget)
    return {
        "memory_max": reasons.memory_max(
            ram_bytes=board.ram_bytes, os_bytes=board.os_reserve_bytes,
            business_bytes=board.business_reserve_bytes, npu_bytes=board.npu_reserve_bytes,
            outside_bytes=outside,
        ),
        "memory_high": reasons.memory_high(gap_bytes=p.memory_max - p.memory_high),
        "watermarks": reasons.watermarks(
            shed=w.shed_pct, degrade=w.degrade_pct, critical=w.critical_pct,
            recover=w.recover_pct, asked=p.req.watermarks is not None,
            peak_bytes=p.peak(c.budget), device=bool(c.budget.device_bytes),
            base_bytes=p.memory_high + outside, outside_bytes=outside, line_bytes=p.line,
        ),
    }  # fmt: skip


def _kernel_reasons(p: Configs, c: Config, commit: int, ratio: int) -> dict[str, str]:
    """Why the CMA pool and the overcommit settings are what they are."""
    board, b = p.board, c.budget
    host_commit = (board.committed_bytes or 0) > (
        board.os_reserve_bytes + board.business_reserve_bytes
    )
    return {
        "cma": reasons.cma(cma_bytes=board.cma_bytes, npu_bytes=board.npu_reserve_bytes),
        "overcommit": reasons.overcommit(
            ratio=ratio, ram_bytes=board.ram_bytes, commit_bytes=commit,
            service_bytes=b.service_commit_bytes, compute_bytes=b.compute_reserved_bytes,
            first_start_bytes=b.first_start_bytes,
            committed_bytes=(board.committed_bytes or 0) if host_commit else None,
            headroom=commit_headroom(p.marks),
        ),
    }  # fmt: skip


def _first_start_reason(p: Configs, c: Config) -> dict[str, str]:
    """Why a cold first start still fits (none without its parts)."""
    b = c.budget
    if not b.first_start:
        return {}
    limit = p.start_limit(b)
    return {
        "first_start": reasons.first_start(
            parts=[(x.name, x.bytes) for x in b.first_start], peak_bytes=p.peak(b),
            total_bytes=p.start_peak(b), limit_bytes=limit, outside=limit > p.memory_max,
        )
    }  # fmt: skip


def _gpu_reason(p: Configs, c: Config) -> str:
    """Why these layers are on the GPU (or none are)."""
    gpu, board_gpu = p.req.gpu, p.req.board.gpu
    kv_offload = p.fixed("kv_offload")
    return reasons.gpu_layers(
        layers=c.layers, n=p.req.facts.n_layer + 1, title=gpu.title if gpu else None,
        device=gpu.device if gpu else None, device_bytes=c.budget.device_bytes,
        in_cgroup=gpu.in_cgroup if gpu else False,
        kv_offload=True if kv_offload is None else kv_offload, note=gpu.note if gpu else "",
        asked=p.fixed("n_gpu_layers"), no_offload=p.no_offload,
        board_gpu=(board_gpu.backend, board_gpu.title)
        if gpu is None and board_gpu is not None
        else None,
    )  # fmt: skip


def _vision_reasons(p: Configs, c: Config) -> dict[str, str]:
    """Where the projector runs and what its images take (none without a projector)."""
    v = p.req.vision
    if v is None:
        return {}
    f, s = v.facts, v.spec
    tried = p.offload_tried
    shown = c if p.projector_offload or tried is None else tried
    device = sum(x.bytes for x in shown.budget.parts if x.name in VISION_DEVICE_PARTS)
    return {
        "projector": reasons.projector(
            name=s.name, kind=s.projector_type, weights_bytes=f.weights_bytes,
            compute_bytes=encoder_compute_bytes(f, c.flash), offload=p.projector_offload,
            has_gpu=bool(c.layers), peak_bytes=shown.budget.hot_bytes,
            line_bytes=p.line_for(shown.budget), device_bytes=device,
        ),
        "image_tokens": reasons.image_tokens(
            tokens=s.tokens_per_image, kind=s.projector_type, size=f.image_size,
            wrap=IMAGE_WRAP_TOKENS + IMAGE_SPLIT_TOKENS, max_images=s.max_images,
            ctx_slot=c.ctx_slot,
            ubatch=c.ubatch, max_bytes=s.max_image_bytes, max_pixels=s.max_image_pixels,
            max_side=s.max_image_side,
        ),
    }  # fmt: skip


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


def _assemble(p: Configs, c: Config) -> Plan:
    req, board = p.req, p.board
    commit = p.commit(c.budget)
    ratio = max(50, p.commit_ratio(commit))
    why = {
        "gpu_layers": _gpu_reason(p, c),
        **_engine_reasons(p, c),
        **_limit_reasons(p, c),
        **_kernel_reasons(p, c, commit, ratio),
        **_first_start_reason(p, c),
        **_vision_reasons(p, c),
    }
    vision = req.vision
    return Plan(
        model=_model_spec(req),
        board=_board_spec(board, req.gpu if c.layers else None),
        engine=c.engine,
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
        cpu_affinity=p.threads.affinity,
        reasons=why,
        budget_inputs=p.inputs,
        projector=None
        if vision is None
        else dataclasses.replace(vision.spec, offload=p.projector_offload),
    )
