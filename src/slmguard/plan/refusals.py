"""Why nothing fits: the planner's refusals, each a PlanError with its numbers.

Owns the words of the four ways a plan can fail once its inputs are valid (the GPU's
heap, a cold first start over MemoryMax, the commit charge over the CommitLimit, the
planned peak over the recovery line), their ``need_bytes``/``have_bytes`` and a hint
that names what would change the outcome. Pure: the planner finds the numbers and the
best configuration it tried; this module only says them, as :mod:`~slmguard.plan.reasons`
says why a plan is what it is.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from slmguard.errors import PlanError
from slmguard.plan.overrides import flag
from slmguard.plan.reasons import mib


def configuration(*, slots: int, ctx_slot: int, ubatch: int, kv_type: str, flash: bool) -> str:
    """``2 slot(s) x 4096, n_ubatch 512, f16 KV, -fa on``."""
    return (
        f"{slots} slot(s) x {ctx_slot}, n_ubatch {ubatch}, {kv_type} KV, "
        f"-fa {'on' if flash else 'off'}"
    )


def gpu_heap(
    *, model: str, board: str, what: str, device_bytes: int, title: str, heap_bytes: int
) -> PlanError:
    """The GPU's buffers are larger than its memory heap."""
    return PlanError(
        f"{model} on {board} at {what}: the GPU's buffers need {mib(device_bytes)} but "
        f"{title} has {mib(heap_bytes)}",
        need_bytes=device_bytes,
        have_bytes=heap_bytes,
        hint=f"offload fewer layers ({flag('n_gpu_layers')} N) or keep the KV cache on the host "
        f"({flag('kv_offload').replace('--', '--no-', 1)})",
    )


def first_start(
    *, model: str, board: str, what: str, start_bytes: int, peak_bytes: int,
    first_start_bytes: int, parts: Sequence[str], memory_max_bytes: int, limit_bytes: int,
) -> PlanError:  # fmt: skip
    """The steady peak fits, the peak after a cold first start does not fit MemoryMax."""
    outside = (
        f" (+ {mib(limit_bytes - memory_max_bytes)} outside the cgroup)"
        if limit_bytes > memory_max_bytes
        else ""
    )
    return PlanError(
        f"{model} on {board} at {what}: a cold first start (Mesa's shader cache empty) holds "
        f"{mib(start_bytes)}, the planned peak {mib(peak_bytes)} + {mib(first_start_bytes)} of "
        f"{', '.join(parts)}, but MemoryMax is {mib(memory_max_bytes)}{outside}",
        need_bytes=start_bytes,
        have_bytes=limit_bytes,
        hint=f"offload fewer layers ({flag('n_gpu_layers')} N) or none (--gpu none), or use a "
        "smaller context",
    )


def commit_limit(
    *, model: str, board: str, what: str, commit_bytes: int, headroom: float, ram_bytes: int
) -> PlanError:
    """The peak fits, the commit charge does not fit mode 2's largest CommitLimit."""
    return PlanError(
        f"{model} on {board}: {what} needs a commit charge of {mib(commit_bytes)} "
        f"(+{headroom:.0%}) but vm.overcommit_memory=2 admits at most {mib(ram_bytes)} "
        "(ratio 100, no swap)",
        need_bytes=math.ceil(commit_bytes * (1 + headroom)),
        have_bytes=ram_bytes,
        hint="use a smaller context, fewer slots or a smaller model, or a board with more RAM",
    )


def peak(
    *, model: str, board: str, what: str, peak_bytes: int, device_bytes: int, best: str,
    line_bytes: int, recover_pct: float, memory_high_bytes: int, zone_bytes: int,
    ram_bytes: int, os_bytes: int, business_bytes: int, npu_bytes: int, hint: str,
    beside: str = "",
) -> PlanError:  # fmt: skip
    """The planned peak of the smallest configuration tried is over the recovery line
    (``beside``: the board's other models counted in it, by name and size)."""
    gpu = f"({mib(device_bytes)} of it on the GPU) " if device_bytes else ""
    others = f"with the board's other models beside it ({beside}) " if beside else ""
    return PlanError(
        f"{model} does not fit {board} at {what}: its planned peak {others}is "
        f"{mib(peak_bytes)} {gpu}"
        f"(at best: {best}) but the recovery line is {mib(line_bytes)} ({recover_pct:g}% of "
        f"MemoryHigh {mib(memory_high_bytes)}; the zone is {mib(zone_bytes)} = {mib(ram_bytes)} "
        f"RAM - OS {mib(os_bytes)} - business {mib(business_bytes)} - NPU {mib(npu_bytes)})",
        need_bytes=peak_bytes,
        have_bytes=line_bytes,
        hint=hint,
    )


def image_room(
    *, model: str, board: str, max_images: int, image_tokens: int, room: int, text: int,
    ctx_slot: int | None, asked: bool,
) -> PlanError:  # fmt: skip
    """A slot cannot hold the images a request may carry (with some text and answer)."""
    have = (
        f"--ctx {ctx_slot} gives a slot {ctx_slot}"
        if asked
        else f"the largest context per slot that fits is {ctx_slot}"
        if ctx_slot is not None
        else "no context fits"
    )
    return PlanError(
        f"{model} on {board}: {max_images} image(s) a request of {image_tokens} tokens each "
        f"need {room} tokens per slot ({text} of them text and answer) but {have}",
        hint=f"allow fewer images a request (--max-images N), fewer slots "
        f"({flag('n_parallel')} N) or ask for a larger --ctx",
    )


def image_batch(*, batch: int, tokens: int, kind: str) -> PlanError:
    """A batch smaller than one image's tokens: the engine aborts on such an image."""
    return PlanError(
        f"{flag('n_batch')} {batch}: a {kind} projector's image is {tokens} tokens, decoded "
        f"in one ubatch (llama.cpp aborts on a smaller one)",
        hint=f"give {flag('n_batch')} {tokens} or more, or leave it to the planner",
    )
