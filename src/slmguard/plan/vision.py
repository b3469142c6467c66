"""A vision projector in a budget: its parts, and the batch its images need.

Owns :func:`add_vision`, which puts what llama-server holds for a projector
(:class:`~slmguard.plan.projector.VisionInput`) into a model's budget
(:func:`slmguard.plan.budget.compute_budget` calls it, on the CPU's budget or offload's):
the weights and the mtmd context at load; the image encoder's compute and work buffers
and each slot's retained images from the first image on; and each slot's request in
flight, its images read, decoded and encoded (:func:`~slmguard.plan.projector.request_bytes`
at the plan's bounds). Offloaded (``spec.offload``), the weights and the compute buffer
are the GPU's. Also :func:`min_ubatch`, the smallest ubatch an image decodes in, and
:func:`spec_for`, the plan's section for a projector file. The arithmetic is
:mod:`slmguard.plan.projector`'s (measured: RESULTS.md, "plan accuracy with images");
pure: no I/O, no choice (the planner chooses the offload and the bounds).
"""

from __future__ import annotations

import dataclasses

from slmguard.plan.parts import Budget, BudgetInput
from slmguard.plan.projector import (
    BODY_COPIES,
    MTMD_CONTEXT_BYTES,
    ProjectorFacts,
    VisionInput,
    encoder_compute_bytes,
    encoder_work_bytes,
    retained_image_bytes,
)
from slmguard.plan.schema import BudgetPart, ProjectorSpec

MiB = 1 << 20
#: The budget's parts a projector adds, on the host; what the governor counts per
#: request itself (:data:`REQUEST_PART`) is one of them.
HOST_PARTS = (
    "projector_weights", "projector_context", "encoder_compute", "encoder_work",
    "image_slots", "image_requests",
)  # fmt: skip
REQUEST_PART = "image_requests"
#: On the GPU (an offloaded projector): its weights and the encoder's compute buffer.
DEVICE_PARTS = ("gpu_projector", "gpu_encoder_compute")


def min_ubatch(tokens_per_image: int) -> int:
    """The smallest n_ubatch (and n_batch) an image decodes in: all its tokens at once.

    llama.cpp decodes a Gemma 3 image's tokens with non-causal attention and asserts
    ``n_ubatch >= n_tokens`` for that (SIGABRT, llama-context.cpp); mtmd hands it batches
    of n_batch tokens, so n_batch == n_ubatch >= the tokens of one image."""
    return tokens_per_image


def spec_for(facts: ProjectorFacts, bounds: ProjectorSpec | None = None) -> ProjectorSpec:
    """The plan's section for ``facts`` (its file's path and size; the sha256 is hashed
    later), with the image bounds of ``bounds`` (None: the defaults); on the host."""
    base = bounds or ProjectorSpec(
        path=str(facts.path), file_bytes=facts.file_bytes, name=facts.name,
        projector_type=facts.projector_type, tokens_per_image=facts.tokens_per_image,
    )  # fmt: skip
    return dataclasses.replace(
        base, path=str(facts.path), file_bytes=facts.file_bytes, name=facts.name,
        projector_type=facts.projector_type, tokens_per_image=facts.tokens_per_image,
        offload=False, image_max_tokens=None,
    )  # fmt: skip


def _where(v: VisionInput) -> str:
    return "on the GPU" if v.spec.offload else "on the host (--no-mmproj-offload)"


def _load_parts(v: VisionInput, compute: int) -> list[BudgetPart]:
    f, s = v.facts, v.spec
    weights = f"{s.name}: {f.projector_type} projector, {f.matmul_type} matrices"
    if s.offload:
        return [
            BudgetPart(
                "gpu_projector", f.weights_bytes, "load", "device", f"{weights}, on the GPU"
            ),
            BudgetPart(
                "gpu_encoder_compute", compute, "load", "device",
                f"the image encoder's compute buffer on the GPU ({f.patches} patches)",
            ),
            BudgetPart("projector_context", MTMD_CONTEXT_BYTES, "load", "anon",
                       "mtmd context: clip's graph metadata, zeroed at load"),
        ]  # fmt: skip
    return [
        BudgetPart(
            "projector_weights", f.weights_bytes, "load", "anon",
            f"{weights}, read into memory {_where(v)}",
        ),
        BudgetPart("projector_context", MTMD_CONTEXT_BYTES, "load", "anon",
                   "mtmd context: clip's graph metadata, zeroed at load"),
    ]  # fmt: skip


def _use_parts(v: VisionInput, inp: BudgetInput, compute: int) -> list[BudgetPart]:
    f, s = v.facts, v.spec
    slots = inp.engine.n_parallel
    fa = "on" if inp.engine.flash_attn else "off"
    parts = []
    if not s.offload:
        parts += [
            BudgetPart(
                "encoder_compute", compute, "use", "anon",
                f"the image encoder's compute buffer: one {f.image_size} x {f.image_size} "
                f"image, {f.patches} patches, -fa {fa}; reserved at load, touched by the "
                "first image",
            ),
            BudgetPart(
                "encoder_work", encoder_work_bytes(f), "use", "anon",
                "the CPU backend's work buffer for the encoder's matrices",
            ),
        ]  # fmt: skip
    held = slots * s.max_images * retained_image_bytes(f)
    parts += [
        BudgetPart(
            "image_slots", held, "use", "anon",
            f"{slots} slot(s) x {s.max_images} image(s) kept with the prompt, preprocessed "
            f"({f.image_size} x {f.image_size}, RGB and f32)",
        ),
        BudgetPart(
            REQUEST_PART, slots * v.request_bytes_max(), "use", "anon",
            f"{slots} request(s) reading their images at once: {BODY_COPIES:g} copies of "
            f"up to {s.max_images} data URL(s) of {s.max_image_bytes / MiB:.1f} MiB, each "
            f"image decoded (up to {s.max_image_pixels:,} pixels) and encoded",
        ),
    ]  # fmt: skip
    return parts


def add_vision(budget: Budget, inp: BudgetInput) -> Budget:
    """``budget`` with the projector of ``inp.vision`` (unchanged without one): its parts
    before the server's own, and what they commit in the engine's commit charge (every
    host buffer at full size, the GPU's too where they are the process's memory)."""
    v = inp.vision
    if v is None:
        return budget
    compute = encoder_compute_bytes(v.facts, inp.engine.flash_attn)
    added = [*_load_parts(v, compute), *_use_parts(v, inp, compute)]
    parts = list(budget.parts)
    at = next((i for i, p in enumerate(parts) if p.name == "server_runtime"), len(parts))
    parts[at:at] = added
    committed = sum(p.bytes for p in added if p.kind == "anon")
    if inp.gpu is not None and inp.gpu.process_memory:
        committed += sum(p.bytes for p in added if p.kind == "device")
    notes = {
        **budget.notes,
        "image_tokens": f"{v.image_tokens} tokens an image, {v.slot_image_tokens} for "
        f"{v.spec.max_images} in one slot",
    }
    return dataclasses.replace(
        budget,
        parts=tuple(parts),
        engine_commit_bytes=budget.engine_commit_bytes + committed,
        notes=notes,
    )
