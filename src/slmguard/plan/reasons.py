"""The plan's reasons: one function per setting, its phrases as data.

Owns the sentences of ``Plan.reasons`` (why each setting is what it is) and the
causes the GPU's reason gives for offloading nothing. Each reason is a function
of the numbers the planner found, given by keyword; the words are the
:data:`PHRASES` table, filled with :meth:`str.format`. Pure: it imports no
arithmetic, no planner and nothing that reads the host, so a reason is as easy to
read, test or translate as a table row. The planner decides; this module only says
why.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

MiB = 1 << 20

#: Every phrase of every reason; ``{name}`` fields are filled by the functions below.
PHRASES: Mapping[str, str] = {
    # n_ctx
    "ctx.asked": "requested {asked} per slot{padded}; x {slots} slot(s) = -c {n_ctx}",
    "ctx.padded": " (padded to {ctx_slot}: cells come in 256s)",
    "ctx.largest": (
        "{ctx_slot} per slot x {slots} = -c {n_ctx}: the largest multiple of {step} up to "
        "the trained {trained} {why}{no_kv}"
    ),
    "ctx.trained": "(the trained length itself)",
    "ctx.line": "whose peak stays below the recovery line ({line})",
    "ctx.commit": (
        "whose commit charge stays at the recovery line of the largest CommitLimit "
        "(vm.overcommit_ratio 100: {commit_line}); its peak would allow more"
    ),
    "ctx.demo": (
        "serve's demo size {cap} on a host with no known board (--ctx N asks for more, up "
        "to the largest that fits)"
    ),
    "ctx.no_kv": "; no KV cache: it costs only the compute of one ubatch",
    # slots
    "slots.asked": "{slots} as requested (-np {slots})",
    "slots.chosen": "{slots} (-np {slots}): {why}{kv}",
    "slots.all": "one per big core, up to 4, each slot a full context",
    "slots.fewer": "{more} would leave a slot fewer than {min_slot_ctx} tokens",
    "slots.kv_per_slot": "; per-slot KV",
    "slots.kv_unified": "; one unified KV pool (--kv-unified)",
    # flash_attn
    "flash": ("{state}: compute buffer {on} reserved with -fa on, {off} with -fa off{peaks}{why}"),
    "flash.peaks": "; planned peak {on} vs {off}",
    "flash.asked": " (requested)",
    "flash.quantized": " (a quantized V cache needs it)",
    "flash.no_gain": "; off: it buys no headroom here",
    # n_batch
    "batch.no_kv": (
        "{ubatch} (= n_ubatch{how}): {arch} has no KV cache, so llama.cpp computes each "
        "input whole in one ubatch (non-causal attention needs n_ubatch >= its tokens; "
        "llama-server refuses a longer one); the compute buffer reserves {reserved} for a "
        "ubatch attending to itself"
    ),
    "batch.no_kv.asked": ", as requested",
    "batch.no_kv.ctx": " = the context per slot",
    "batch": "{ubatch} (= n_ubatch): the compute buffer reserves {reserved}{first}{smaller}",
    "batch.default": ", the default",
    "batch.first_failed": "; {first} did not fit",
    "batch.smaller": (
        " (n_ubatch {smallest} would save {saved} at a slower prefill; a smaller ubatch is "
        "taken only when this one does not fit)"
    ),
    # kv_type
    "kv.none": (
        "none: llama.cpp runs {arch} without a KV cache (no memory module, "
        "llama_model::create_memory), so the plan budgets 0 bytes for it whatever the "
        "context, and {kv_type} allocates nothing; a smaller context frees no memory, so "
        "the governor never shrinks it (it sheds and parks)"
    ),
    "kv": "{kv_type}: KV cache {kv}, allocated in full at load{first}",
    "kv.first_failed": "; {first} did not fit",
    # swa
    "swa": (
        "{swa_layers} of {n_layer} layers use a {window}-token window; --swa-full keeps "
        "them full size (KV {kv}): without it the KV cache is {small} but llama-server "
        "keeps up to 32 context checkpoints per slot ({checkpoints})"
    ),
    # cache_ram
    "cache_ram": "--cache-ram {mib}: {what}",
    "cache_ram.none": "no prompt cache in RAM (llama-server's default would grow by up to 8 GiB)",
    "cache_ram.asked": "as requested, budgeted in full as prompt_cache",
    # n_threads, cpu_affinity
    "threads": "one per big core ({n})",
    "threads.quota": "the cgroup CPU quota allows {n} of the {big} usable big cores",
    "affinity.pinned": (
        "pin to the big cores {cores}: a thread on a little core stalls every matrix "
        "multiply for the whole group"
    ),
    "affinity.none": "all cores are the same: no pinning, the scheduler balances",
    # memory_max, memory_high, watermarks
    "memory_max": (
        "the inference zone: {ram} RAM - OS {os} - business {business} - NPU/GPU {npu}{outside}"
    ),
    "memory_max.outside": (
        " - the GPU buffers outside the cgroup {outside} (the driver does not charge them "
        "to it; the governor counts them with it)"
    ),
    "memory_high": (
        "{gap} below MemoryMax so the kernel throttles and reclaims the cold page cache "
        "before it OOM-kills"
    ),
    "watermarks": (
        "fixed first ({source}): shed {shed}%, degrade {degrade}%, critical {critical}%, "
        "recover {recover}% of {of_what}; the planned peak {peak} {device}({pct}) stays "
        "below the recovery line {line}, so a full load is normal and sheds nothing: "
        "{headroom} of headroom to the shed line"
    ),
    "watermarks.asked": "as requested",
    "watermarks.source": "the source document's 85% line",
    "watermarks.high": "MemoryHigh",
    "watermarks.high_outside": "MemoryHigh + the {outside} of GPU buffers outside the cgroup",
    "watermarks.device": "(host and GPU) ",
    # cma, overcommit
    "cma": (
        "cma={cma_mib}M: the NPU's contiguous pool, sized to the {npu} NPU reserve instead "
        "of a guess"
    ),
    "cma.unchanged": "left as the board boots (no NPU CMA pool to size)",
    "overcommit": (
        "mode 2, ratio {ratio}: CommitLimit {limit} (no swap) admits the planned commit "
        "charge {commit} (service {service}, incl. the engine's thread stacks and the full "
        "{compute} compute reservation, + {first_start}{others}) with {headroom} headroom "
        "or more: the charge at most at the governor's recovery line of CommitLimit"
    ),
    "overcommit.first_start": "a cold first start's {bytes}, + ",
    "overcommit.host": "the host's current Committed_AS {committed}",
    "overcommit.reserves": "OS and business reserves",
    # first_start
    "first_start": (
        "a cold first start (Mesa's shader cache empty: the first after installing or "
        "upgrading the engine or the driver; every start if the cache cannot be written) "
        "adds {parts}, kept for that engine's life: the planned peak {peak} + it = {total}, "
        "within {limit}; not counted in the watermarks (serve keeps the cache, so later "
        "starts are warm); the commit charge includes it"
    ),
    "first_start.max": "MemoryMax {limit}",
    "first_start.max_outside": "MemoryMax + the GPU buffers outside the cgroup {limit}",
    # gpu_layers
    "gpu.cpu_only": (
        "none: CPU only; --gpu {backend} plans {title} (needs an engine built with "
        "{backend}; --gpu auto offloads with CUDA only)"
    ),
    "gpu.no_gpu": "no GPU on this board profile: the CPU does everything",
    "gpu.none": "none of {n} on {title}: {why}; --device none keeps a GPU build off it",
    "gpu.none.asked": "as requested (--gpu-layers 0)",
    "gpu.none.less_ctx": "offloading left less context than the CPU alone",
    "gpu.layers": (
        "{layers} of {n} (output first, then the last {repeating} repeating layers){asked} on "
        "{device}, {title}: {bytes} of GPU buffers ({where}), KV {kv}; {note}"
    ),
    "gpu.layers.asked": " (requested)",
    "gpu.outside": "outside the engine's cgroup",
    "gpu.inside": "charged to its cgroup",
    "gpu.kv_device": "on the device",
    "gpu.kv_host": "kept on the host",
    # why a GPU offloads nothing (in gpu_layers)
    "no_offload.less_ctx": (
        "offloading {layers} layers leaves {ctx_slot} tokens per slot, fewer than {want}: "
        "less context than the CPU alone"
    ),
    "no_offload.nothing_fits": (
        "no configuration with layers on the GPU fits (host and GPU buffers over the "
        "recovery line, the GPU's heap or the CommitLimit)"
    ),
    "no_offload.first_start": (
        "a cold first start would not fit: {layers} layers fit the steady state ({slots} "
        "slot(s) x {ctx_slot}, planned peak {peak} below the recovery line {line}), but a "
        "cold start (Mesa's shader cache empty: the first after installing or upgrading the "
        "engine or the driver) adds {parts}: {over}"
    ),
    "no_offload.over_max": "{peak} + it = {total}, over MemoryMax {limit}",
    "no_offload.over_max_outside": (
        "{peak} + it = {total}, over MemoryMax + the GPU buffers outside the cgroup {limit}"
    ),
    "no_offload.over_commit": (
        "a commit charge of {commit} (+{headroom}) over the CommitLimit of {ram} (ratio "
        "{ratio}, no swap)"
    ),
    # projector: where a vision projector's weights and image encoder run
    "projector": "{name} ({type}, {weights} of weights, encoder buffer {compute}) {where}: {why}",
    "projector.gpu": "on the GPU with the layers",
    "projector.host": "on the host (--no-mmproj-offload)",
    "projector.no_gpu": (
        "no layer is on a GPU, and the host is where the cgroup and the governor see it (a GPU "
        "build would otherwise put the encoder on its default device)"
    ),
    "projector.fits_gpu": (
        "it fits there beside the layers (planned peak {peak}, below the recovery line "
        "{line}), and the encoder runs on the GPU"
    ),
    "projector.no_fit_gpu": (
        "the host is the safer side: with its {device} on the GPU the plan would not fit at "
        "this context (planned peak {peak} against the recovery line {line}, or the GPU's "
        "heap); on the host the cgroup and the governor see it"
    ),
    # image_tokens: what an image takes of a slot and of a batch
    "images": (
        "{tokens} tokens an image ({type}: every image resized to {size} x {size}, so "
        "--image-max-tokens has nothing to bound) + {wrap} around it and its text; "
        "{max_images} image(s) a request take {room} of a slot's {ctx_slot}; n_batch = "
        "n_ubatch {ubatch} >= {tokens}: an image decodes in one ubatch (llama.cpp aborts "
        "on a smaller one); each request's images at most {max_bytes} and {max_pixels:,} "
        "pixels ({max_side} a side)"
    ),
}


def say(key: str, **values: object) -> str:
    """The phrase ``key`` of :data:`PHRASES` with ``values`` filled in."""
    return PHRASES[key].format(**values)


def mib(n: float) -> str:
    """Bytes as the reasons show them: ``1,234 MiB``."""
    return f"{n / MiB:,.0f} MiB"


def _pct(x: float) -> str:
    return f"{x:g}"


def ctx(
    *, ctx_slot: int, slots: int, asked: int | None, trained: int, step: int, top: int,
    line_bytes: int, has_kv_cache: bool, demo_cap: int | None = None,
    commit_line_bytes: int | None = None,
) -> str:  # fmt: skip
    """n_ctx: the context asked for (padded), or the largest that fits and what bounds it
    (``commit_line_bytes``: the commit charge, not the peak, stopped the next step)."""
    n_ctx = ctx_slot * slots
    if asked is not None:
        padded = "" if ctx_slot == asked else say("ctx.padded", ctx_slot=ctx_slot)
        return say("ctx.asked", asked=asked, padded=padded, slots=slots, n_ctx=n_ctx)
    if ctx_slot == top and demo_cap is not None:
        why = say("ctx.demo", cap=demo_cap)
    elif ctx_slot == top:
        why = say("ctx.trained")
    elif commit_line_bytes is not None:
        why = say("ctx.commit", commit_line=mib(commit_line_bytes))
    else:
        why = say("ctx.line", line=mib(line_bytes))
    no_kv = "" if has_kv_cache else say("ctx.no_kv")
    return say(
        "ctx.largest", ctx_slot=ctx_slot, slots=slots, n_ctx=n_ctx, step=step, trained=trained,
        why=why, no_kv=no_kv,
    )  # fmt: skip


def slots(
    *, slots: int, asked: bool, more: int | None, min_slot_ctx: int, has_kv_cache: bool,
    kv_unified: bool,
) -> str:  # fmt: skip
    """n_parallel: as asked, or the most whose slots each keep a useful context."""
    if asked:
        return say("slots.asked", slots=slots)
    why = (
        say("slots.all")
        if more is None
        else say("slots.fewer", more=more, min_slot_ctx=min_slot_ctx)
    )
    kv = ""
    if has_kv_cache:
        kv = say("slots.kv_unified" if kv_unified else "slots.kv_per_slot")
    return say("slots.chosen", slots=slots, why=why, kv=kv)


def flash_attn(
    *, on: bool, reserved_on: int, reserved_off: int, peak_on: int, peak_off: int,
    asked: bool, kv_type: str,
) -> str:  # fmt: skip
    """flash_attn: the compute buffer and the peak with it on and off."""
    peaks = "" if peak_on == peak_off else say("flash.peaks", on=mib(peak_on), off=mib(peak_off))
    if asked:
        why = say("flash.asked")
    elif kv_type != "f16":
        why = say("flash.quantized")
    else:
        why = "" if on else say("flash.no_gain")
    return say(
        "flash", state="on" if on else "off", on=mib(reserved_on), off=mib(reserved_off),
        peaks=peaks, why=why,
    )  # fmt: skip


def batch(
    *, ubatch: int, reserved: int, asked: bool, first: int, smallest: int,
    saved: int | None, has_kv_cache: bool, arch: str,
) -> str:  # fmt: skip
    """n_batch (= n_ubatch): the compute buffer it reserves; a smaller one's saving."""
    if not has_kv_cache:
        how = say("batch.no_kv.asked" if asked else "batch.no_kv.ctx")
        return say("batch.no_kv", ubatch=ubatch, how=how, arch=arch, reserved=mib(reserved))
    default = say("batch.default") if ubatch == first else say("batch.first_failed", first=first)
    smaller = "" if saved is None else say("batch.smaller", smallest=smallest, saved=mib(saved))
    return say("batch", ubatch=ubatch, reserved=mib(reserved), first=default, smaller=smaller)


def kv_type(*, kv_type: str, kv_bytes: int, first: str, has_kv_cache: bool, arch: str) -> str:
    """kv_type: the KV cache's size, and the preferred type when it did not fit."""
    if not has_kv_cache:
        return say("kv.none", arch=arch, kv_type=kv_type)
    failed = "" if kv_type == first else say("kv.first_failed", first=first)
    return say("kv", kv_type=kv_type, kv=mib(kv_bytes), first=failed)


def swa(
    *, swa_layers: int, n_layer: int, window: int, kv_bytes: int, small_kv_bytes: int,
    checkpoint_bytes: int,
) -> str:  # fmt: skip
    """swa (--swa-full): the KV cache and the checkpoints the plan would have without it."""
    return say(
        "swa", swa_layers=swa_layers, n_layer=n_layer, window=window, kv=mib(kv_bytes),
        small=mib(small_kv_bytes), checkpoints=mib(checkpoint_bytes),
    )  # fmt: skip


def cache_ram(*, mib_asked: int) -> str:
    """cache_ram: llama-server's prompt cache, none unless asked for."""
    what = say("cache_ram.none" if mib_asked == 0 else "cache_ram.asked")
    return say("cache_ram", mib=mib_asked, what=what)


def threads(*, n: int, big: int, quota: bool) -> str:
    """n_threads: one per big core, or what the cgroup's CPU quota allows."""
    return say("threads.quota", n=n, big=big) if quota else say("threads", n=n)


def cpu_affinity(*, pinned: Sequence[int]) -> str:
    """cpu_affinity: the big cores of a mixed CPU, or none."""
    if not pinned:
        return say("affinity.none")
    return say("affinity.pinned", cores=",".join(map(str, pinned)))


def memory_max(
    *, ram_bytes: int, os_bytes: int, business_bytes: int, npu_bytes: int, outside_bytes: int
) -> str:
    """memory_max: the inference zone, less the GPU buffers outside the cgroup."""
    outside = "" if not outside_bytes else say("memory_max.outside", outside=mib(outside_bytes))
    return say(
        "memory_max", ram=mib(ram_bytes), os=mib(os_bytes), business=mib(business_bytes),
        npu=mib(npu_bytes), outside=outside,
    )  # fmt: skip


def memory_high(*, gap_bytes: int) -> str:
    """memory_high: the gap below MemoryMax."""
    return say("memory_high", gap=mib(gap_bytes))


def watermarks(
    *, shed: float, degrade: float, critical: float, recover: float, asked: bool,
    peak_bytes: int, device: bool, base_bytes: int, outside_bytes: int, line_bytes: int,
) -> str:  # fmt: skip
    """watermarks: fixed first; where the planned peak sits below them."""
    of_what = (
        say("watermarks.high_outside", outside=mib(outside_bytes))
        if outside_bytes
        else say("watermarks.high")
    )
    return say(
        "watermarks",
        source=say("watermarks.asked" if asked else "watermarks.source"),
        shed=_pct(shed), degrade=_pct(degrade), critical=_pct(critical), recover=_pct(recover),
        of_what=of_what, peak=mib(peak_bytes), device=say("watermarks.device") if device else "",
        pct=f"{peak_bytes * 100 / base_bytes:.1f}%", line=mib(line_bytes),
        headroom=mib(base_bytes * shed / 100 - peak_bytes),
    )  # fmt: skip


def cma(*, cma_bytes: int | None, npu_bytes: int) -> str:
    """cma: the NPU's pool sized to its reserve, or left as it boots."""
    if cma_bytes is None:
        return say("cma.unchanged")
    return say("cma", cma_mib=cma_bytes // MiB, npu=mib(npu_bytes))


def overcommit(
    *, ratio: int, ram_bytes: int, commit_bytes: int, service_bytes: int, compute_bytes: int,
    first_start_bytes: int, committed_bytes: int | None, headroom: float,
) -> str:  # fmt: skip
    """overcommit: mode 2 and the ratio whose CommitLimit admits the planned commit charge
    (``committed_bytes``: the host's Committed_AS when it is what counts, else None)."""
    first = say("overcommit.first_start", bytes=mib(first_start_bytes)) if first_start_bytes else ""
    others = (
        say("overcommit.reserves")
        if committed_bytes is None
        else say("overcommit.host", committed=mib(committed_bytes))
    )
    return say(
        "overcommit", ratio=ratio, limit=mib(ram_bytes * ratio // 100), commit=mib(commit_bytes),
        service=mib(service_bytes), compute=mib(compute_bytes), first_start=first,
        others=others, headroom=f"{headroom:.0%}",
    )  # fmt: skip


def parts_text(parts: Sequence[tuple[str, int]]) -> str:
    """``name 100 MiB, name 20 MiB``."""
    return ", ".join(f"{name} {mib(n)}" for name, n in parts)


def first_start(
    *, parts: Sequence[tuple[str, int]], peak_bytes: int, total_bytes: int, limit_bytes: int,
    outside: bool,
) -> str:  # fmt: skip
    """first_start: what a cold start adds, within MemoryMax (and the GPU buffers outside)."""
    limit = say("first_start.max_outside" if outside else "first_start.max", limit=mib(limit_bytes))
    return say(
        "first_start", parts=parts_text(parts), peak=mib(peak_bytes), total=mib(total_bytes),
        limit=limit,
    )  # fmt: skip


def gpu_layers(
    *, layers: int, n: int, title: str | None, device: str | None, device_bytes: int,
    in_cgroup: bool, kv_offload: bool, note: str, asked: int | None, no_offload: str | None,
    board_gpu: tuple[str, str] | None,
) -> str:  # fmt: skip
    """gpu_layers: the layers on the GPU, or why none (``title`` None: no GPU planned;
    ``board_gpu``: the board's (backend, title) when it has one that was not planned)."""
    if title is None:
        if board_gpu is not None:
            return say("gpu.cpu_only", backend=board_gpu[0], title=board_gpu[1])
        return say("gpu.no_gpu")
    if not layers:
        why = say("gpu.none.asked") if asked == 0 else no_offload or say("gpu.none.less_ctx")
        return say("gpu.none", n=n, title=title, why=why)
    return say(
        "gpu.layers", layers=layers, n=n, repeating=layers - 1,
        asked=say("gpu.layers.asked") if asked is not None else "", device=device, title=title,
        bytes=mib(device_bytes), where=say("gpu.inside" if in_cgroup else "gpu.outside"),
        kv=say("gpu.kv_device" if kv_offload else "gpu.kv_host"), note=note,
    )  # fmt: skip


def projector(
    *, name: str, kind: str, weights_bytes: int, compute_bytes: int, offload: bool,
    has_gpu: bool, peak_bytes: int, line_bytes: int, device_bytes: int,
) -> str:  # fmt: skip
    """projector: on the GPU (it fits there) or the host (no layer on a GPU, or offloaded
    it would not fit)."""
    if offload:
        why = say("projector.fits_gpu", peak=mib(peak_bytes), line=mib(line_bytes))
    elif not has_gpu:
        why = say("projector.no_gpu")
    else:
        why = say(
            "projector.no_fit_gpu", device=mib(device_bytes), peak=mib(peak_bytes),
            line=mib(line_bytes),
        )  # fmt: skip
    return say(
        "projector", name=name, type=kind, weights=mib(weights_bytes),
        compute=mib(compute_bytes), where=say("projector.gpu" if offload else "projector.host"),
        why=why,
    )  # fmt: skip


def image_tokens(
    *, tokens: int, kind: str, size: int, wrap: int, max_images: int, ctx_slot: int,
    ubatch: int, max_bytes: int, max_pixels: int, max_side: int,
) -> str:  # fmt: skip
    """image_tokens: an image's tokens in a slot and a batch, and the image bounds."""
    return say(
        "images", tokens=tokens, type=kind, size=size, wrap=wrap, max_images=max_images,
        room=max_images * (tokens + wrap), ctx_slot=ctx_slot, ubatch=ubatch,
        max_bytes=mib(max_bytes) if max_bytes >= MiB else f"{max_bytes:,} bytes",
        max_pixels=max_pixels, max_side=max_side,
    )  # fmt: skip


def no_offload_less_ctx(*, layers: int, ctx_slot: int, want: int) -> str:
    """Offloading was possible but left a slot less context than the CPU alone."""
    return say("no_offload.less_ctx", layers=layers, ctx_slot=ctx_slot, want=want)


def no_offload_nothing_fits() -> str:
    return say("no_offload.nothing_fits")


def no_offload_first_start(
    *, layers: int, slots: int, ctx_slot: int, peak_bytes: int, line_bytes: int,
    parts: Sequence[tuple[str, int]], over: str,
) -> str:  # fmt: skip
    """A cold first start, not the steady state, is what kept the layers off the GPU."""
    return say(
        "no_offload.first_start", layers=layers, slots=slots, ctx_slot=ctx_slot,
        peak=mib(peak_bytes), line=mib(line_bytes), parts=parts_text(parts), over=over,
    )  # fmt: skip


def over_memory_max(*, peak_bytes: int, total_bytes: int, limit_bytes: int, outside: bool) -> str:
    key = "no_offload.over_max_outside" if outside else "no_offload.over_max"
    return say(key, peak=mib(peak_bytes), total=mib(total_bytes), limit=mib(limit_bytes))


def over_commit_limit(*, commit_bytes: int, headroom: float, ram_bytes: int, ratio: int) -> str:
    return say(
        "no_offload.over_commit", commit=mib(commit_bytes), headroom=f"{headroom:.0%}",
        ram=mib(ram_bytes), ratio=ratio,
    )  # fmt: skip
