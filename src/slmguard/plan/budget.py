"""The memory budget of one model and engine settings: :func:`compute_budget`.

Owns the CPU's budget (the weights mapped, repacked or read, the KV cache, the compute
buffer's reservation and the pages a prompt touches, the server's parts) and the one
entry point that hands a configuration with a GPU device in use to
:func:`slmguard.plan.offload.offload_budget`. Pure arithmetic on a
:class:`~slmguard.plan.parts.BudgetInput` (the rules are :mod:`slmguard.plan.allocation`'s,
the parts' shape :mod:`slmguard.plan.parts`'): no I/O, no engine, no choice (the planner
chooses, serve's re-budget compares).
"""

from __future__ import annotations

from dataclasses import dataclass

from slmguard.plan import offload, vision
from slmguard.plan.allocation import (
    KV_TYPES,
    SERVER_OTHER_THREADS,
    THREAD_STACK_BYTES,
    Cells,
    cells_in_use,
    checkpoint_bytes,
    compute_phases,
    compute_reserved_bytes,
    compute_resident_bytes,
    engine_cells,
    engine_commit_bytes,
    http_threads,
    kv_cache_bytes,
    mapped_bytes,
    output_bytes,
    repacked_split,
    server_base_anon_bytes,
    slot_state_bytes,
    ubatch_tokens,
)
from slmguard.plan.parts import (
    Budget,
    BudgetInput,
    front_commit_bytes,
    front_parts,
    growth_parts,
    kv_note,
    output_part,
    reserve_parts,
    server_parts,
)
from slmguard.plan.schema import BudgetPart

MiB = 1 << 20


def _check(inp: BudgetInput) -> None:
    if (
        min(
            inp.engine.n_ctx,
            inp.engine.n_batch,
            inp.engine.n_ubatch,
            inp.engine.n_threads,
            inp.engine.n_parallel,
        )
        <= 0
    ):
        raise ValueError("n_ctx, n_batch, n_ubatch, n_threads and n_parallel must be > 0")
    if inp.engine.kv_type not in KV_TYPES:
        raise ValueError(f"unknown KV type {inp.engine.kv_type!r} (f16, q8_0, q4_0)")
    if inp.engine.kv_type != "f16" and not inp.engine.flash_attn:
        raise ValueError(f"a {inp.engine.kv_type} V cache needs flash attention (-fa on)")
    if inp.engine.cache_ram_mib < 0:
        raise ValueError("cache_ram_mib must be >= 0 (-1, unlimited, cannot be budgeted)")


def _repacked_part(inp: BudgetInput, repacked: int) -> BudgetPart:
    return BudgetPart(
        "weights_repacked",
        repacked,
        "load",
        "anon",
        f"weights the CPU backend repacks for {inp.board.isa} (CPU_REPACK buffer)",
    )


def _weight_parts(inp: BudgetInput, repacked: int, tied: int, mapped: int) -> list[BudgetPart]:
    if not inp.engine.use_mmap:
        return [
            BudgetPart(
                "weights_loaded",
                mapped - repacked + tied,
                "load",
                "anon",
                "tensor data read into anonymous memory (no mmap)"
                + (", locked (mlock)" if inp.engine.use_mlock else ""),
            ),
            _repacked_part(inp, repacked),
        ]
    if inp.engine.use_mlock:
        return [
            BudgetPart(
                "weights_mapped",
                mapped,
                "load",
                "file",
                "mmap of the GGUF tensor data, locked (mlock): unevictable, the repacked "
                "tensors' pages too",
            ),
            _repacked_part(inp, repacked),
        ]
    cold = repacked - tied
    return [
        BudgetPart(
            "weights_mapped",
            mapped - cold,
            "load",
            "file",
            "mmap of the GGUF tensor data: page cache, hot on every token",
        ),
        BudgetPart(
            "weights_mapped_cold",
            cold,
            "load",
            "file",
            "file pages of the repacked tensors: read once at load, then reclaimable",
        ),
        _repacked_part(inp, repacked),
    ]


@dataclass(frozen=True)
class _Compute:
    """The compute buffer: its reservation (and the other -fa choice's), the
    pages a full prompt touches, and the CPU backend's work buffer beside it."""

    reserved_bytes: int
    other_bytes: int
    resident_bytes: int
    work_bytes: int


def _compute(inp: BudgetInput, cells: Cells, n_ubatch: int) -> _Compute:
    f = inp.facts
    reserved = compute_reserved_bytes(
        f,
        cells,
        n_ubatch,
        inp.engine.flash_attn,
        swa_full=inp.engine.swa_full,
        kv_type=inp.engine.kv_type,
    )
    # The other -fa choice, for the plan's explanation (f16 KV when it is off).
    other = compute_reserved_bytes(
        f,
        cells,
        n_ubatch,
        not inp.engine.flash_attn,
        swa_full=inp.engine.swa_full,
        kv_type=inp.engine.kv_type if not inp.engine.flash_attn else "f16",
    )
    fill = None if inp.fill_tokens is None else min(inp.fill_tokens, cells.n_ctx_slot)
    resident = compute_resident_bytes(
        f,
        cells,
        n_ubatch,
        inp.engine.flash_attn,
        swa_full=inp.engine.swa_full,
        kv_type=inp.engine.kv_type,
        fill_tokens=fill,
    )
    # The work buffer is malloc'ed as the graphs need it: at the cells in use.
    work = compute_phases(
        f,
        cells,
        n_ubatch,
        inp.engine.flash_attn,
        swa_full=inp.engine.swa_full,
        kv_type=inp.engine.kv_type,
        n_kv=cells_in_use(cells, fill),
        n_tokens=ubatch_tokens(cells, fill),
    ).work
    return _Compute(reserved, other, resident, work)


def _compute_part(inp: BudgetInput, n_ubatch: int, comp: _Compute) -> BudgetPart:
    reserved = comp.reserved_bytes
    fa_on, fa_off = (
        (reserved, comp.other_bytes) if inp.engine.flash_attn else (comp.other_bytes, reserved)
    )
    return BudgetPart(
        "compute_buffer",
        comp.resident_bytes,
        "use",
        "anon",
        f"touched by a full prompt; {reserved / MiB:.1f} MiB reserved at n_ubatch "
        f"{n_ubatch} (-fa on {fa_on / MiB:.1f}, off {fa_off / MiB:.1f})",
    )


def compute_budget(inp: BudgetInput) -> Budget:
    """The budget for one model and engine settings (docs/plan.md, "What the budget
    counts"); ValueError for settings no engine runs (a quantized KV without -fa)."""
    _check(inp)
    if inp.gpu_device:
        return vision.add_vision(offload.offload_budget(inp), inp)
    f = inp.facts
    n_ubatch = min(inp.engine.n_ubatch, inp.engine.n_batch)
    cells = engine_cells(inp.engine.n_ctx, inp.engine.n_parallel, inp.engine.kv_unified)
    kv = kv_cache_bytes(
        f, cells, inp.engine.kv_type, n_ubatch=n_ubatch, swa_full=inp.engine.swa_full
    )
    repacked, tied = repacked_split(f, inp.board.isa)
    mapped = mapped_bytes(f)
    output = output_bytes(f, cells, n_ubatch)
    comp = _compute(inp, cells, n_ubatch)
    checkpoints = checkpoint_bytes(f, cells, inp.engine.kv_type, n_ubatch, inp.engine.swa_full)
    cache = inp.engine.cache_ram_mib * MiB
    slots = slot_state_bytes(f, cells.n_parallel)
    instance = offload.instance_bytes(inp.gpu_build)
    parts = [
        *_weight_parts(inp, repacked, tied, mapped),
        BudgetPart("kv_cache", kv, "load", "anon", kv_note(inp, cells, n_ubatch)),
        output_part(f, cells, n_ubatch, output),
        _compute_part(inp, n_ubatch, comp),
        *growth_parts(inp, checkpoints, cache),
        *offload.instance_parts(instance),
        *server_parts(
            slots, offload.cpu_binary_bytes(inp), server_base_anon_bytes(f.has_kv_cache, f.n_vocab)
        ),
        *front_parts(inp),
        *reserve_parts(inp),
    ]
    http = http_threads(cells.n_parallel, inp.board.n_cpus)
    threads = inp.engine.n_threads + http + SERVER_OTHER_THREADS
    loaded = 0 if inp.engine.use_mmap else mapped - repacked + tied  # weights read, not mapped
    buffers = kv + repacked + output + comp.reserved_bytes + comp.work_bytes + instance
    engine_commit = engine_commit_bytes(f, threads, buffers + checkpoints + cache + slots + loaded)
    front_commit = front_commit_bytes(inp)
    reserved = comp.reserved_bytes
    notes = {
        "compute_reserved": f"{reserved} bytes reserved, {comp.resident_bytes} resident at peak",
        "threads": f"{threads} engine threads ({inp.engine.n_threads} compute, "
        f"{http} HTTP), {THREAD_STACK_BYTES} B stack each",
    }
    budget = Budget(tuple(parts), cells, reserved, engine_commit, front_commit, notes)
    return vision.add_vision(budget, inp)
