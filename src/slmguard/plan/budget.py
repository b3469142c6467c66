"""The memory budget: pure arithmetic from model facts and engine settings.

Owns the rules for what llama.cpp's ``llama-server`` (the one built from the
llama.cpp vendored in llama-cpp-python 0.3.36, commit 0c1e570) allocates for
one model, context and slot count, as named parts in bytes
(:class:`slmguard.plan.schema.BudgetPart`), plus the reserved address space and
the commit charge that ``vm.overcommit_memory=2`` accounts. No I/O, no engine.

The rules, each checked against the engine's load log ("KV buffer size",
"compute buffer size", "output buffer size", "CPU_REPACK model buffer size",
``llama_kv_cache: size = ... cells``) and the measured RSS
(``benchmarks/plan_accuracy.py``, results in ``benchmarks/RESULTS.md``):

* **Cells.** ``-c`` is padded to 256; without ``--kv-unified`` each of the
  ``-np`` slots gets ``pad256(n_ctx / slots)`` cells in its own stream (and
  ``n_ctx`` becomes that times the slots); with it, one stream of ``n_ctx``
  cells that every slot may use (``llama_context`` constructor).
* **Weights.** The GGUF is mapped read-only and populated at load
  (``--load-mode mmap``): its tensor data is file-backed page cache
  ("CPU_Mapped model buffer"), reclaimable but charged to the cgroup that
  faults it in. Weights the CPU backend *repacks* for its SIMD kernels
  ("CPU_REPACK model buffer") are copied into anonymous memory, same size,
  and their file pages stay mapped but cold. Which tensors are repacked
  depends on the ISA (``ggml_repack_get_optimal_repack_type`` in
  ggml-cpu/repack.cpp, :data:`REPACK_RULES`): 2-D matmul weights whose type
  has a kernel and whose row count divides its interleave. ``token_embd`` is
  read with get_rows and stays mapped, but a model with tied embeddings also
  uses it as the output matmul, and that copy is repacked where its type can
  be. With mlock the whole mapping is locked (nothing is cold); without mmap
  the weights are read into anonymous memory.
* **KV cache.** Allocated and zeroed when the context is created: resident at
  load whatever the conversation length. Per layer: cells x streams x KV
  heads x (key_length + value_length) x type size (f16 2 B; q8_0 34 B and q4_0
  18 B per 32 elements). Sliding-window layers (Gemma 3: 15 of 18) get the full
  cells only with ``--swa-full``; otherwise
  ``pad256(min(cells, n_swa x (slots if unified else 1) + n_ubatch))`` per
  stream (``llama_kv_cache_iswa``).
* **No KV cache.** An architecture llama.cpp runs without a memory module
  (``ModelFacts.has_kv_cache`` False: BERT and its kin, EmbeddingGemma, the
  diffusion decoders; ``llama_model::create_memory``) has no KV cache at all,
  whatever ``-c``: the ``kv_cache`` part is 0 bytes, there are no context
  checkpoints, and every input is computed whole in one ubatch (llama.cpp
  asserts ``n_ubatch >= n_tokens`` for non-causal attention; llama-server
  refuses a longer input). Its compute buffer is that of a ubatch attending to
  itself: one ``T x T`` mask (two with sliding-window layers) and, without flash
  attention, ``T x T x n_head x 4`` bytes of scores, ``T = min(n_ctx,
  n_ubatch)``; an embedding graph has no logits phase. Its output buffer grows:
  the first batch of ``T`` tokens makes it ``T`` rows of ``n_vocab`` logits
  (allocated for every model) plus ``n_embd`` embeddings, f32, zeroed
  (``llama_context::output_reserve`` from ``encode``).
* **Context checkpoints.** Without ``--swa-full`` llama-server saves up to 32
  copies of a slot's sliding-window cache per slot (``--ctx-checkpoints``,
  default 32) so it can reuse a prompt prefix; they live in the server's heap.
* **Compute buffer.** Reserved once for the worst-case ubatch of
  ``T = min(n_ctx, n_ubatch)`` tokens with one output per slot
  (``sched_reserve``; llama-server caps the outputs at the slot count). It is
  the largest of three phases of the graph, each fitted on the engine's own
  report (:func:`compute_reserved_bytes`); the attention masks (one per KV
  cache, f32, or f16 with flash attention) are live throughout. Without flash
  attention the attention phase holds the scores of the largest layer,
  ``n_kv x T x n_head x 4`` bytes: this is what grows with the context.
  Only what the real graph touches becomes resident: the phases evaluated at
  the cells actually in use and the tokens of the ubatch actually run (a
  prompt shorter than a ubatch builds a smaller graph;
  :func:`compute_resident_bytes`).
* **Output buffer.** ``n_vocab x 4`` bytes of logits per slot.
* **Prompt cache.** ``--cache-ram`` MiB at most, in the heap, as it fills.
* **Runtime.** The server process itself: its heap after load (the
  vocabulary, the chat template, the HTTP server), the touched pages of
  its code, each request's state per slot; measured (:data:`SERVER_RUNTIME`
  and the constants below say on what). A Vulkan build that offloads nothing
  (``--device none``) also holds the Vulkan instance its backend creates at
  start (``plan.offload.VULKAN_INSTANCE_BYTES``).
* **Commit charge.** What mode-2 overcommit accounts: private writable
  mappings, i.e. every reserved buffer at its full size (not only what is
  resident) and each thread's stack (``ulimit -s``, 8 MiB by default); the
  HTTP thread pool alone is ``max(slots + 4, CPUs - 1)`` threads. The
  read-only model mapping is not charged.

Resident at load: weights, repacked weights, KV cache, output buffer, runtime.
Grows with use: the touched part of the compute buffer (bounded by its
reservation), context checkpoints, the prompt cache, per-request state.
After a cold first start only (:attr:`Budget.first_start`, not the steady state):
a Vulkan engine's shader compilation (``plan.offload``), for as long as that engine runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from slmguard.plan import offload
from slmguard.plan.modelfacts import ModelFacts
from slmguard.plan.schema import BudgetBoard, BudgetGpu, BudgetPart, EngineSettings

MiB = 1 << 20
KiB = 1 << 10
KV_TYPES: Mapping[str, tuple[int, int]] = {
    # ggml type -> (elements per block, bytes per block); ggml-common.h
    "f16": (1, 2),
    "q8_0": (32, 34),
    "q4_0": (32, 18),
}
CELL_PAD = 256  # llama_context pads n_ctx and n_ctx_seq to 256; the SWA cache too
CTX_CHECKPOINTS = 32  # llama-server's --ctx-checkpoints default

# ---------------------------------------------------------------- fitted constants
# Measured on llama-server 0.5.0-dev (build 1, commit 0c1e570), x86-64 static
# AVX2/FMA/F16C build, 2 threads, Debian 12 (glibc 2.36), Gemma 3 270M Q4_K_M
# (262,144-token SentencePiece vocabulary) and zero-weight GGUFs with the
# Qwen2.5 0.5B/1.5B/3B and Llama 3.2 1B/3B shapes and a 151,936 / 128,256-token
# byte-level BPE vocabulary (benchmarks/shape_model.py); see
# benchmarks/plan_accuracy.py and RESULTS.md "plan accuracy".

# The server's anonymous memory after load that no engine buffer accounts for
# (heap: vocabulary tables, chat template, HTTP server; the warm-up run's
# pages of the compute buffer): 43 to 55 MiB over 618 loads of the six shapes,
# with no trend in the vocabulary (128k BPE 43-44, 152k BPE 46-52, 262k
# SentencePiece 47-55), so a constant.
SERVER_BASE_ANON_BYTES = 50 * MiB
# Growth while serving, per slot, beyond the compute buffer: the sampler's
# candidate arrays (llama_token_data, 12 B per vocabulary entry; not every page
# is touched), the request's JSON and tokens. Fitted on the in-sample cells:
# 2.2 to 3.1 MiB per slot for a 262,144-token vocabulary.
SLOT_ANON_PER_TOKEN_BYTES = 10
# File-backed pages of the binary and the few shared libraries it links,
# touched after load and a request (x86-64 static build; an ARM build differs).
SERVER_FILE_BYTES = 16 * MiB + 512 * KiB  # 16.2 to 16.6 MiB measured
# Commit charge of the server beyond its buffers and thread stacks (heap,
# writable data, malloc arenas) after load: a constant, bytes per tensor of the
# GGUF and per vocabulary entry (least squares on the six shapes, then the
# constant raised by the largest under-estimate, 2.6 MiB, to err high).
SERVER_BASE_COMMIT_BYTES = 38 * MiB + 512 * KiB
SERVER_COMMIT_PER_TENSOR_BYTES = 185 * KiB
SERVER_COMMIT_PER_TOKEN_BYTES = 33
# Threads besides the compute and HTTP pools: main, the task loop, the
# listener and log threads (measured: 11 threads at 2 compute + 5 HTTP).
SERVER_OTHER_THREADS = 4

# The HTTP front process (FRONT_*): the front that proxies to llama-server,
# measured by benchmarks/serve_overhead.py after its runs (2026-12-01): 38.9 MiB
# anonymous and 16.3 MiB file-backed of 55.2 MiB RSS. The anonymous budget keeps
# ~1 MiB for request bodies in flight; the file part is rounded (libraries are
# shared with other Python processes on the board).
FRONT_ANON_BYTES = 40 * MiB
FRONT_FILE_BYTES = 16 * MiB
FRONT_COMMIT_BYTES = 40 * MiB
FRONT_THREADS = 4
# Default pthread stack = RLIMIT_STACK (8 MiB on Debian/Ubuntu/Armbian/L4T).
THREAD_STACK_BYTES = 8 * MiB

# The compute buffer's phases (see compute_reserved_bytes): bytes per ubatch
# token as 4 x (coefficients . (n_embd, n_head x key_length, n_head_kv x key_length,
# n_ff)), fitted on
# the engine's reported reservations for the six shapes above at n_ubatch 64 to
# 512, n_ctx 512 to 32768, slots 1 and 4, f16/q8_0 KV, flash attention on/off.
ATTN_COEF = (2.0, 3.0, 2.0, 0.0)
FFN_COEF = (3.0, 1.0, 0.0, 3.0)
OUT_ROW_BYTES = 72 * KiB  # per output row beside its n_vocab logits
# An ungated FFN (BERT's: up, bias and GELU in place, down) holds one n_ff row per
# token where a gated one holds three. Checked on the no-KV graph with flash attention,
# where the buffer is the larger of the attention and FFN phases: 5.76 MiB reported for
# a MiniLM-shaped BERT (n_embd 384, n_ff 1536) at n_ubatch 512, the attention phase's
# 5.75 MiB; FFN_COEF would say 12.5 MiB.
UNGATED_FFN_COEF = (3.0, 0.0, 0.0, 1.0)
# A quantized KV cache adds about 0.55 MiB to the FFN phase on Gemma 3 (the
# other shapes need less with q8_0 than with f16: this errs on their safe side).
QUANT_KV_COMPUTE_BYTES = 563 * KiB

# Weights repacked into anonymous memory by the CPU backend, per ISA family:
# ggml type -> the row count a tensor must be divisible by.
# Source: ggml/src/ggml-cpu/repack.cpp ggml_repack_get_optimal_repack_type
# (llama.cpp 0c1e570). Checked: x86_avx2 on this machine; arm_dotprod with the
# aarch64 build under qemu -cpu cortex-a76 (Gemma 3 270M: 193.38 MiB, exact).
REPACK_RULES: Mapping[str, Mapping[str, int]] = {
    "x86_avx2": {"Q4_0": 8, "Q4_K": 8, "IQ4_NL": 8, "MXFP4": 8},
    "x86_avx512": {"Q4_0": 8, "Q4_K": 8, "IQ4_NL": 8, "MXFP4": 8, "Q2_K": 8},
    # Cortex-A76/A78 (RK3588, Pi 5, Orin Nano): NEON + dotprod
    "arm_dotprod": {
        "Q4_0": 4,
        "Q4_K": 8,
        "Q5_K": 8,
        "Q6_K": 8,
        "IQ4_NL": 4,
        "MXFP4": 4,
        "Q8_0": 4,
        "Q1_0": 4,
    },
    "arm_i8mm": {
        "Q4_0": 4,
        "Q4_K": 8,
        "Q5_K": 8,
        "Q6_K": 8,
        "IQ4_NL": 4,
        "MXFP4": 4,
        "Q8_0": 4,
        "Q1_0": 4,
    },
    "none": {},
}


def _pad(x: int, n: int) -> int:
    return (x + n - 1) // n * n


def kv_type_bytes(kv_type: str, n_elements: int) -> int:
    """Bytes of ``n_elements`` KV values stored as ``kv_type``."""
    try:
        block, size = KV_TYPES[kv_type]
    except KeyError as err:
        raise ValueError(f"unknown KV type {kv_type!r} (f16, q8_0, q4_0)") from err
    if n_elements % block:
        raise ValueError(f"{n_elements} {kv_type} elements are not whole blocks of {block}")
    return n_elements // block * size


@dataclass(frozen=True)
class Cells:
    """How llama-server lays out the KV cells for ``-c``/``-np``/``--kv-unified``.

    ``n_ctx`` is what the engine ends up with (padded), ``n_ctx_slot`` what one
    slot may use, ``n_stream`` how many separate KV streams hold them.
    """

    n_ctx: int
    n_ctx_slot: int
    n_stream: int
    n_parallel: int
    unified: bool

    @property
    def stream_cells(self) -> int:
        """Cells in one stream (all of them when unified)."""
        return self.n_ctx if self.unified else self.n_ctx_slot


def engine_cells(n_ctx: int, n_parallel: int = 1, kv_unified: bool = False) -> Cells:
    """The engine's cell layout (``llama_context`` constructor, see module docstring)."""
    if n_ctx <= 0 or n_parallel <= 0:
        raise ValueError("n_ctx and n_parallel must be > 0")
    total = _pad(n_ctx, CELL_PAD)
    if kv_unified:
        return Cells(total, total, 1, n_parallel, True)
    per_slot = _pad(total // n_parallel, CELL_PAD) if total >= n_parallel else CELL_PAD
    return Cells(per_slot * n_parallel, per_slot, n_parallel, n_parallel, False)


def swa_cells(facts: ModelFacts, cells: Cells, n_ubatch: int, swa_full: bool) -> int:
    """KV cells per stream of a sliding-window layer (see module docstring)."""
    base = cells.stream_cells
    if swa_full or not facts.swa_layers:
        return base
    seqs = cells.n_parallel if cells.unified else 1
    return _pad(min(base, facts.sliding_window * seqs + n_ubatch), CELL_PAD)


def _layer_cells(facts: ModelFacts, il: int, cells: Cells, n_ubatch: int, swa_full: bool) -> int:
    if facts.is_swa(il):
        return swa_cells(facts, cells, n_ubatch, swa_full)
    return cells.stream_cells


def kv_cache_bytes(
    facts: ModelFacts,
    cells: Cells,
    kv_type: str = "f16",
    *,
    n_ubatch: int = 512,
    swa_full: bool = True,
    swa_only: bool = False,
    layers: frozenset[int] | None = None,
) -> int:
    """The whole KV cache (every stream); ``swa_only``: its sliding-window layers;
    ``layers``: only those layers (None: all). 0 for a model without one."""
    if not facts.has_kv_cache:
        return 0
    total = 0
    for il in range(facts.n_layer):
        if swa_only and not facts.is_swa(il):
            continue
        if layers is not None and il not in layers:
            continue
        n = _layer_cells(facts, il, cells, n_ubatch, swa_full) * cells.n_stream
        k, v = facts.kv_elements_per_cell(il)
        total += kv_type_bytes(kv_type, k * n) + kv_type_bytes(kv_type, v * n)
    return total


def checkpoint_bytes(
    facts: ModelFacts, cells: Cells, kv_type: str, n_ubatch: int, swa_full: bool
) -> int:
    """Context checkpoints at most: 32 per slot, each a slot's sliding-window cache."""
    if swa_full or not facts.swa_layers or not facts.has_kv_cache:
        return 0
    swa = kv_cache_bytes(facts, cells, kv_type, n_ubatch=n_ubatch, swa_full=False, swa_only=True)
    per_slot = swa // cells.n_stream if not cells.unified else swa // cells.n_parallel
    return CTX_CHECKPOINTS * cells.n_parallel * per_slot


def _head_max(facts: ModelFacts) -> int:
    return max(facts.n_head) if isinstance(facts.n_head, tuple) else facts.n_head


def _dims(facts: ModelFacts) -> tuple[int, int, int, int]:
    kv_heads = max(facts.n_head_kv) if isinstance(facts.n_head_kv, tuple) else facts.n_head_kv
    return (
        facts.n_embd,
        _head_max(facts) * facts.key_length,
        kv_heads * facts.key_length,
        facts.n_ff,
    )


def _per_token(facts: ModelFacts, coef: tuple[float, float, float, float]) -> int:
    return round(4 * sum(c * d for c, d in zip(coef, _dims(facts), strict=True)))


def _mask_kinds(facts: ModelFacts) -> tuple[bool, ...]:
    """One attention mask per KV cache: (is_swa,) for each (base, then SWA)."""
    kinds = [False] if len(facts.swa_layers) < facts.n_layer else []
    return (*kinds, True) if facts.swa_layers else tuple(kinds)


@dataclass(frozen=True)
class ComputePhases:
    """The compute graph's phases, bytes each (the buffer is the largest)."""

    masks: int
    scores: int
    attention: int
    ffn: int
    output: int
    work: int  # the CPU backend's work buffer, outside the compute buffer

    @property
    def total(self) -> int:
        return max(self.attention, self.ffn, self.output)


def compute_phases(
    facts: ModelFacts,
    cells: Cells,
    n_ubatch: int,
    flash_attn: bool,
    *,
    swa_full: bool = True,
    kv_type: str = "f16",
    n_kv: int | None = None,
    n_tokens: int | None = None,
) -> ComputePhases:
    """The phases for a ubatch of ``n_tokens`` tokens (None: a full one) that sees
    ``n_kv`` cells per stream (None: all); for a model without a KV cache, of a batch of
    ``n_kv`` tokens (None: a full ubatch)."""
    t = min(cells.n_ctx, n_ubatch)
    if not facts.has_kv_cache:
        return _no_cache_phases(facts, cells, t if n_kv is None else min(t, n_kv), flash_attn)
    if n_tokens is not None:
        t = max(1, min(t, n_tokens))  # the graph is built for the ubatch's own tokens
    full = cells.stream_cells if n_kv is None else min(n_kv, cells.stream_cells)
    swa = swa_cells(facts, cells, n_ubatch, swa_full)
    if n_kv is not None:
        swa = min(swa, full)
    mask_elt = 2 if flash_attn else 4
    masks = sum((swa if s else full) * t * mask_elt for s in _mask_kinds(facts))
    scores = 0
    if not flash_attn:
        heads = facts.n_head if isinstance(facts.n_head, tuple) else (facts.n_head,) * facts.n_layer
        scores = max(
            (swa if facts.is_swa(il) else full) * t * heads[il] * 4 for il in range(facts.n_layer)
        )
    attention = masks + scores + t * _per_token(facts, ATTN_COEF)
    ffn = masks + t * _per_token(facts, FFN_COEF)
    if kv_type != "f16":
        ffn += QUANT_KV_COMPUTE_BYTES
    output = cells.n_parallel * (facts.n_vocab * 4 + OUT_ROW_BYTES)
    # Without flash attention, the softmaxed scores are converted to f16 for the
    # V product in the CPU backend's work buffer (ggml_graph_plan): half their size.
    return ComputePhases(masks, scores, attention, ffn, output, scores // 2)


def _no_cache_phases(facts: ModelFacts, cells: Cells, t: int, flash_attn: bool) -> ComputePhases:
    """A model without a KV cache: a ubatch of ``t`` tokens attends to itself
    (``build_attn_inp_no_cache``: a ``t x t`` mask, a second one for SWA layers), a
    pooled (embedding or rerank) graph computes no logits, and an FFN without a gate
    (no ``ffn_gate`` tensor: BERT) holds less (:data:`UNGATED_FFN_COEF`)."""
    mask_elt = 2 if flash_attn else 4
    masks = (2 if facts.swa_layers else 1) * t * t * mask_elt
    scores = 0 if flash_attn else t * t * _head_max(facts) * 4
    attention = masks + scores + t * _per_token(facts, ATTN_COEF)
    gated = any(x.name.endswith("ffn_gate.weight") for x in facts.tensors) or not facts.tensors
    ffn = masks + t * _per_token(facts, FFN_COEF if gated else UNGATED_FFN_COEF)
    output = 0
    if facts.pooling_type is None:
        output = cells.n_parallel * (facts.n_vocab * 4 + OUT_ROW_BYTES)
    return ComputePhases(masks, scores, attention, ffn, output, scores // 2)


def output_rows(facts: ModelFacts, cells: Cells, n_ubatch: int) -> int:
    """Rows of the output buffer at most: one per slot, unless every token of a batch
    is output: an embedding model's (``--embeddings``/``--reranking``: ``output_all``
    in ``decode``) and any model without a KV cache (``encode``), up to a full ubatch
    (``output_reserve`` grows the buffer to the batch)."""
    if facts.has_kv_cache and facts.pooling_type is None:
        return cells.n_parallel
    return max(min(cells.n_ctx, n_ubatch), cells.n_parallel)


def output_bytes(facts: ModelFacts, cells: Cells, n_ubatch: int) -> int:
    """The output buffer (f32): ``n_vocab`` logits per row (sized for every model, even
    one that computes none), plus ``n_embd`` embeddings for an embedding model."""
    per_row = facts.n_vocab + (facts.n_embd if facts.pooling_type is not None else 0)
    return output_rows(facts, cells, n_ubatch) * per_row * 4


def compute_reserved_bytes(
    facts: ModelFacts,
    cells: Cells,
    n_ubatch: int,
    flash_attn: bool,
    *,
    swa_full: bool = True,
    kv_type: str = "f16",
) -> int:
    """The CPU compute buffer the engine reserves (address space, all of it committed)."""
    return compute_phases(
        facts, cells, n_ubatch, flash_attn, swa_full=swa_full, kv_type=kv_type
    ).total


def _cells_in_use(cells: Cells, fill_tokens: int | None) -> int | None:
    """The KV view a ubatch sees per stream after ``fill_tokens`` per slot (padded)."""
    if fill_tokens is None:
        return None
    used = fill_tokens * (cells.n_parallel if cells.unified else 1)
    return _pad(max(used, 1), CELL_PAD)


def _ubatch_tokens(cells: Cells, fill_tokens: int | None) -> int | None:
    """The largest ubatch's tokens when every slot's prompt of ``fill_tokens`` arrives at
    once (llama-server batches them together, then splits the batch into ubatches): the
    slots' tokens together, capped by n_ubatch in :func:`compute_phases`. None: a full
    ubatch. A prompt shorter than a ubatch makes a smaller graph, which the allocator lays
    out from the start of the buffer: fewer pages touched (measured on the CPU build: a
    16-token prompt at n_ctx 2048 and 8192 grew the engine by 4.3-4.9 MiB, its request
    state included, where the rule at a full ubatch said 19.8 MiB of compute pages)."""
    if fill_tokens is None:
        return None
    return max(fill_tokens, 1) * cells.n_parallel


def compute_resident_bytes(
    facts: ModelFacts,
    cells: Cells,
    n_ubatch: int,
    flash_attn: bool,
    *,
    swa_full: bool = True,
    kv_type: str = "f16",
    fill_tokens: int | None = None,
) -> int:
    """Pages of the compute buffer (and the CPU work buffer) a prompt of
    ``fill_tokens`` per slot touches.

    The graph allocator lays each graph out from the start of the buffer, so
    the pages touched are the reservation rule evaluated at the cells in use
    (padded to 256, as llama.cpp pads its KV view). None: a full context.
    """
    phases = compute_phases(
        facts,
        cells,
        n_ubatch,
        flash_attn,
        swa_full=swa_full,
        kv_type=kv_type,
        n_kv=_cells_in_use(cells, fill_tokens),
        n_tokens=_ubatch_tokens(cells, fill_tokens),
    )
    return phases.total + phases.work


def _rows(shape: tuple[int, ...]) -> int:
    return shape[1] if len(shape) >= 2 else 1


def repacked_split(facts: ModelFacts, isa: str) -> tuple[int, int]:
    """(bytes the CPU backend copies into anonymous memory at load, of which the
    copy of a tied token embedding). The embedding's file pages stay in use
    (get_rows reads them), so only the rest of the repacked tensors' file pages
    go cold."""
    rules = REPACK_RULES.get(isa, {})

    def repackable(type_name: str, shape: tuple[int, ...]) -> bool:
        mult = rules.get(type_name)
        return mult is not None and len(shape) == 2 and _rows(shape) % mult == 0

    total = 0
    for t in facts.tensors:
        if t.name == "token_embd.weight" or not t.name.endswith(".weight"):
            continue
        if repackable(t.type_name, t.shape):
            total += t.n_bytes
    tied = 0
    embd = facts.tensor("token_embd.weight")
    if (
        embd is not None
        and facts.tensor("output.weight") is None
        and repackable(embd.type_name, embd.shape)
    ):
        tied = embd.n_bytes  # tied embeddings: the output matmul's copy
    return total + tied, tied


def repacked_bytes(facts: ModelFacts, isa: str) -> int:
    """Weight bytes the CPU backend copies into anonymous memory at load."""
    return repacked_split(facts, isa)[0]


def mapped_bytes(facts: ModelFacts) -> int:
    """File-backed bytes of the mapped tensor data (all of it populated at load)."""
    return max(facts.file_bytes - facts.data_offset_bytes, facts.tensor_bytes)


def http_threads(n_parallel: int, n_cpus: int) -> int:
    """llama-server's HTTP pool when ``--threads-http`` is not given (server-http.cpp)."""
    return max(n_parallel + 4, n_cpus - 1)


def slot_state_bytes(facts: ModelFacts, n_parallel: int) -> int:
    return n_parallel * SLOT_ANON_PER_TOKEN_BYTES * facts.n_vocab


#: The board a budget is computed for when none is given: an x86-64 AVX2 host with
#: 4 CPUs and no reserves (the benchmarks' and the tests' host).
X86_HOST = BudgetBoard(isa="x86_avx2", n_cpus=4)


@dataclass(frozen=True)
class BudgetInput:
    """Everything the arithmetic depends on: the model, the engine's settings, the
    board's side (:class:`~slmguard.plan.schema.BudgetBoard`: the ISA, the CPUs the
    engine sees, the reserves) and the GPU the engine is built for (None: a CPU build).

    ``engine.n_ctx`` is llama-server's ``-c``: all slots' cells together. A GPU build
    uses a device unless ``engine.device`` is ``none`` (its default one when None, even
    at ``-ngl 0``: nothing is repacked then). ``fill_tokens`` is the tokens per slot when
    the peak is reached (None: full contexts); only the compute buffer's touched pages
    depend on it.
    ``front_process``: the HTTP front's own parts are counted.
    """

    facts: ModelFacts
    engine: EngineSettings
    board: BudgetBoard = X86_HOST
    gpu: BudgetGpu | None = None
    front_process: bool = True
    fill_tokens: int | None = None

    @property
    def gpu_device(self) -> bool:
        """A GPU device is in use: a GPU build, not ``--device none``."""
        return self.gpu is not None and self.engine.device != "none"

    @property
    def n_gpu_layers(self) -> int:
        """The layers on the device (0 when none is in use)."""
        return self.engine.n_gpu_layers if self.gpu_device else 0

    @property
    def gpu_build(self) -> str | None:
        """The engine's GPU backend, even without a device in use."""
        return self.gpu.backend if self.gpu is not None else None


@dataclass(frozen=True)
class Budget:
    """Named parts plus the derived totals the planner and the benchmark use."""

    parts: tuple[BudgetPart, ...]
    cells: Cells
    compute_reserved_bytes: int
    engine_commit_bytes: int
    front_commit_bytes: int
    notes: Mapping[str, str] = field(default_factory=dict)
    #: What a cold first start holds beyond the parts (:func:`first_start_parts`): not the
    #: steady state (no total below but the ``first_start_*`` ones counts them).
    first_start: tuple[BudgetPart, ...] = ()

    def part(self, name: str) -> BudgetPart | None:
        return next((p for p in self.parts if p.name == name), None)

    @property
    def first_start_bytes(self) -> int:
        """What a cold first start holds beyond the steady state (anonymous, in the
        engine's heap, committed)."""
        return sum(p.bytes for p in self.first_start)

    @property
    def first_start_hot_bytes(self) -> int:
        """:attr:`hot_bytes` after a cold first start: what the planner holds against
        MemoryMax (plus the device bytes outside the cgroup)."""
        return self.hot_bytes + self.first_start_bytes

    @property
    def first_start_commit_bytes(self) -> int:
        """:attr:`service_commit_bytes` after a cold first start."""
        return self.service_commit_bytes + self.first_start_bytes

    def _bytes(self, *names: str) -> int:
        return sum(p.bytes for p in self.parts if p.name in names)

    @property
    def engine_anon_peak_bytes(self) -> int:
        """Peak anonymous RSS of the llama-server process (the benchmark's anon column)."""
        return self._bytes(*ENGINE_ANON)

    @property
    def engine_anon_load_bytes(self) -> int:
        return sum(p.bytes for p in self.parts if p.name in ENGINE_ANON and p.when == "load")

    @property
    def engine_file_bytes(self) -> int:
        """File-backed RSS of the engine (mapped weights + its binary)."""
        return self._bytes(*ENGINE_FILE)

    @property
    def service_bytes(self) -> int:
        """Everything charged to the service's cgroup at peak (anon + file)."""
        return sum(p.bytes for p in self.parts if p.kind in ("anon", "file"))

    @property
    def service_hot_bytes(self) -> int:
        """What the service needs resident to run without thrashing (no cold file pages).

        This is the governor's working set at the planned peak (cgroup usage
        minus inactive file pages). The device side is :attr:`device_bytes`.
        """
        return self.service_bytes - self._bytes("weights_mapped_cold")

    @property
    def device_bytes(self) -> int:
        """The engine's buffers in the GPU driver's memory (offload), at their full size."""
        return self._bytes(*DEVICE_PARTS)

    @property
    def hot_bytes(self) -> int:
        """Host and device side together: what the board's one DRAM must hold at peak."""
        return self.service_hot_bytes + self.device_bytes

    @property
    def service_anon_bytes(self) -> int:
        return sum(p.bytes for p in self.parts if p.kind == "anon")

    @property
    def service_load_bytes(self) -> int:
        return sum(p.bytes for p in self.parts if p.kind in ("anon", "file") and p.when == "load")

    @property
    def service_commit_bytes(self) -> int:
        return self.engine_commit_bytes + self.front_commit_bytes

    @property
    def reserve_bytes(self) -> int:
        """OS, business and device reserves beside the service."""
        return sum(p.bytes for p in self.parts if p.kind in ("reserve", "device"))


ENGINE_ANON = frozenset(
    {
        "gpu_runtime",
        "weights_loaded",
        "weights_repacked",
        "kv_cache",
        "output_buffer",
        "compute_buffer",
        "ctx_checkpoints",
        "prompt_cache",
        "server_runtime",
        "slot_state",
    }
)
ENGINE_FILE = frozenset({"weights_mapped", "weights_mapped_cold", "server_binary"})
# Offload: the engine's buffers in the GPU driver's memory, and the runtime in its heap.
DEVICE_PARTS = frozenset({"gpu_weights", "gpu_kv", "gpu_compute", "gpu_host_compute", "gpu_output"})


def first_start_parts(inp: BudgetInput) -> tuple[BudgetPart, ...]:
    """What only a cold first start holds, beside the steady state: each of
    :data:`slmguard.plan.schema.FIRST_START_PARTS` that this configuration has."""
    shader = offload.first_start_bytes(
        inp.gpu_build, inp.n_gpu_layers if inp.gpu_device else 0, inp.engine.flash_attn
    )
    if not shader:
        return ()
    return (
        BudgetPart(
            "gpu_shader_compile",
            shader,
            "load",
            "anon",
            "a cold start (Mesa's shader cache empty or unwritable) compiles the Vulkan "
            "pipelines in the engine and keeps this much more heap for its life (lavapipe, "
            + ("-fa on: its flash-attention pipelines" if inp.engine.flash_attn else "-fa off")
            + "); with the cache serve keeps, only the first start after installing or "
            "upgrading the engine or the driver",
        ),
    )


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
        n_kv=_cells_in_use(cells, fill),
        n_tokens=_ubatch_tokens(cells, fill),
    ).work
    return _Compute(reserved, other, resident, work)


def _kv_note(inp: BudgetInput, cells: Cells, n_ubatch: int) -> str:
    f = inp.facts
    if not f.has_kv_cache:
        return (
            f"none: llama.cpp runs {f.arch} without a KV cache (no memory module); each "
            f"input is computed whole in one ubatch of at most {n_ubatch} tokens"
        )
    note = (
        f"{cells.n_parallel} slot{'s' if cells.n_parallel > 1 else ''} x "
        f"{cells.n_ctx_slot} cells"
        + (" (unified)" if cells.unified else "")
        + f" x {f.n_layer} layers, {inp.engine.kv_type}, allocated and zeroed at load"
    )
    if f.swa_layers:
        note += (
            "; SWA layers full size (--swa-full)"
            if inp.engine.swa_full
            else f"; SWA layers {swa_cells(f, cells, n_ubatch, False)} cells"
        )
    return note


def _output_part(f: ModelFacts, cells: Cells, n_ubatch: int, output: int) -> BudgetPart:
    """The output buffer: one row per slot at load; an embedding model's, or one without
    a KV cache, grows to a full ubatch's rows (zeroed) with the first such batch."""
    rows = output_rows(f, cells, n_ubatch)
    what = "logits" + (" and embeddings" if f.pooling_type is not None else "")
    if rows == cells.n_parallel:
        return BudgetPart(
            "output_buffer",
            output,
            "load",
            "anon",
            f"{what} of {rows} output row{'s' if rows > 1 else ''} (f32)",
        )
    return BudgetPart(
        "output_buffer",
        output,
        "use",
        "anon",
        f"{what} of up to {rows} rows (f32): every token of a batch is an output; "
        f"{cells.n_parallel} at load, grown by the first batch of {rows} tokens",
    )


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


def _growth_parts(inp: BudgetInput, checkpoints: int, cache: int) -> list[BudgetPart]:
    """The optional parts that fill as the server works: checkpoints, the prompt cache."""
    parts = []
    if checkpoints:
        parts.append(
            BudgetPart(
                "ctx_checkpoints",
                checkpoints,
                "use",
                "anon",
                f"up to {CTX_CHECKPOINTS} copies of each slot's SWA cache (no --swa-full)",
            )
        )
    if cache:
        parts.append(
            BudgetPart(
                "prompt_cache",
                cache,
                "use",
                "anon",
                f"--cache-ram {inp.engine.cache_ram_mib}: saved prompts, at most",
            )
        )
    return parts


def _server_parts(slot_state: int, binary_bytes: int = SERVER_FILE_BYTES) -> list[BudgetPart]:
    """llama-server's own process: its heap, each slot's request state, its code."""
    return [
        BudgetPart(
            "server_runtime",
            SERVER_BASE_ANON_BYTES,
            "load",
            "anon",
            "llama-server's heap after load: vocabulary, chat template, HTTP server",
        ),
        BudgetPart(
            "slot_state",
            slot_state,
            "use",
            "anon",
            "per slot while it serves: sampler arrays, request and token buffers",
        ),
        BudgetPart("server_binary", binary_bytes, "load", "file", "llama-server's code"),
    ]


def _front_parts(inp: BudgetInput) -> list[BudgetPart]:
    if not inp.front_process:
        return []
    return [
        BudgetPart(
            "front_runtime",
            FRONT_ANON_BYTES,
            "load",
            "anon",
            "HTTP front process (measured on the previous front)",
        ),
        BudgetPart("front_libraries", FRONT_FILE_BYTES, "load", "file", "HTTP front's libraries"),
    ]


def _reserve_parts(inp: BudgetInput) -> list[BudgetPart]:
    """The board's reserves beside the service (those that are not zero)."""
    return [
        BudgetPart(name, size, "load", kind, note + ", outside the service")
        for name, size, kind, note in (
            ("npu_reserve", inp.board.npu_reserve_bytes, "device", "NPU/GPU DMA-BUF and CMA pool"),
            ("os_reserve", inp.board.os_reserve_bytes, "reserve", "kernel, sshd, journald"),
            (
                "business_reserve",
                inp.board.business_reserve_bytes,
                "reserve",
                "guaranteed to the business-logic zone",
            ),
        )
        if size
    ]


def _engine_commit_bytes(facts: ModelFacts, threads: int, buffers: int) -> int:
    """llama-server's commit charge: its measured heap and data, every private
    buffer (``buffers``) at full size, and the stack of each thread but the main one."""
    return (
        SERVER_BASE_COMMIT_BYTES
        + SERVER_COMMIT_PER_TENSOR_BYTES * len(facts.tensors)
        + SERVER_COMMIT_PER_TOKEN_BYTES * facts.n_vocab
        + buffers
        + (threads - 1) * THREAD_STACK_BYTES
    )


def compute_budget(inp: BudgetInput) -> Budget:
    """The budget for one model + settings (see the module docstring for rules)."""
    _check(inp)
    if inp.gpu_device:
        return _offload_budget(inp)
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
        BudgetPart("kv_cache", kv, "load", "anon", _kv_note(inp, cells, n_ubatch)),
        _output_part(f, cells, n_ubatch, output),
        _compute_part(inp, n_ubatch, comp),
        *_growth_parts(inp, checkpoints, cache),
        *_instance_parts(instance),
        *_server_parts(slots, _cpu_binary_bytes(inp)),
        *_front_parts(inp),
        *_reserve_parts(inp),
    ]
    http = http_threads(cells.n_parallel, inp.board.n_cpus)
    threads = inp.engine.n_threads + http + SERVER_OTHER_THREADS
    loaded = 0 if inp.engine.use_mmap else mapped - repacked + tied  # weights read, not mapped
    buffers = kv + repacked + output + comp.reserved_bytes + comp.work_bytes + instance
    engine_commit = _engine_commit_bytes(f, threads, buffers + checkpoints + cache + slots + loaded)
    front_commit = (
        (FRONT_COMMIT_BYTES + FRONT_THREADS * THREAD_STACK_BYTES) if inp.front_process else 0
    )
    reserved = comp.reserved_bytes
    notes = {
        "compute_reserved": f"{reserved} bytes reserved, {comp.resident_bytes} resident at peak",
        "threads": f"{threads} engine threads ({inp.engine.n_threads} compute, "
        f"{http} HTTP), {THREAD_STACK_BYTES} B stack each",
    }
    return Budget(tuple(parts), cells, reserved, engine_commit, front_commit, notes)


def _instance_parts(instance: int) -> list[BudgetPart]:
    """A GPU build's runtime when it uses no device (``--device none``): the Vulkan
    instance its backend creates at start (:func:`slmguard.plan.offload.instance_bytes`)."""
    if not instance:
        return []
    return [
        BudgetPart(
            "gpu_runtime",
            instance,
            "load",
            "anon",
            "the Vulkan instance a Vulkan build creates at start even with --device none: "
            "the loader and every installed driver (lavapipe's libLLVM relocations)",
        )
    ]


def _cpu_binary_bytes(inp: BudgetInput) -> int:
    """The resident code of an engine that offloads nothing: a Vulkan build's with
    ``--device none`` (measured, x86-64), else the CPU build's (CUDA's: not measured)."""
    if inp.gpu_build == "vulkan":
        return offload.VULKAN_BINARY_NO_DEVICE_FILE_BYTES
    return SERVER_FILE_BYTES


# ---------------------------------------------------------------- offload


def _offload_weight_parts(inp: BudgetInput, device: str) -> list[BudgetPart]:
    """The weights with a GPU device in use (plan.offload): the offloaded ones on the
    device, the rest mapped from the file and read by the CPU, nothing repacked."""
    split = offload.split_weights(
        inp.facts, inp.n_gpu_layers, (inp.gpu.max_tensor_bytes if inp.gpu else None)
    )
    where = f"{split.layers} of {inp.facts.n_layer} layers" + (
        " and the output layer" if split.output else ""
    )
    cpu = split.cpu_bytes
    return [
        BudgetPart("gpu_weights", split.device_bytes, "load", "device", f"{where} on {device}"),
        BudgetPart(
            "weights_mapped",
            cpu,
            "load",
            "file",
            "mmap of the weights the CPU reads (not repacked once a GPU is in use)",
        ),
        BudgetPart(
            "weights_mapped_cold",
            max(0, mapped_bytes(inp.facts) - cpu),
            "load",
            "file",
            "the offloaded weights' file pages: read once to upload them, still mapped, "
            "then reclaimable",
        ),
    ]


def _offload_kv_parts(inp: BudgetInput, cells: Cells, n_ubatch: int) -> list[BudgetPart]:
    f = inp.facts
    on_device = offload.split_kv(f, inp.n_gpu_layers, inp.engine.kv_offload)
    host_layers = frozenset(range(f.n_layer)) - on_device
    kv = {
        name: kv_cache_bytes(
            f,
            cells,
            inp.engine.kv_type,
            n_ubatch=n_ubatch,
            swa_full=inp.engine.swa_full,
            layers=layers,
        )
        for name, layers in (("kv_cache", host_layers), ("gpu_kv", on_device))
    }
    note = _kv_note(inp, cells, n_ubatch)
    return [
        BudgetPart(
            "kv_cache", kv["kv_cache"], "load", "anon", f"{len(host_layers)} layers: {note}"
        ),
        BudgetPart(
            "gpu_kv", kv["gpu_kv"], "load", "device", f"{len(on_device)} layers on the device"
        ),
    ]


def _offload_budget(inp: BudgetInput) -> Budget:
    """The budget with a GPU device in use (see plan.offload for the rules)."""
    f = inp.facts
    n_ubatch = min(inp.engine.n_ubatch, inp.engine.n_batch)
    cells = engine_cells(inp.engine.n_ctx, inp.engine.n_parallel, inp.engine.kv_unified)
    ph = compute_phases(
        f,
        cells,
        n_ubatch,
        inp.engine.flash_attn,
        swa_full=inp.engine.swa_full,
        kv_type=inp.engine.kv_type,
    )
    comp = offload.split_compute(
        f,
        (ph.masks, ph.attention, ph.ffn, ph.total),
        n_ubatch,
        inp.n_gpu_layers,
        inp.engine.kv_offload,
    )
    runtime = offload.runtime_bytes(inp.n_gpu_layers, inp.engine.kv_offload)
    output = output_bytes(f, cells, n_ubatch)
    checkpoints = checkpoint_bytes(f, cells, inp.engine.kv_type, n_ubatch, inp.engine.swa_full)
    cache = inp.engine.cache_ram_mib * MiB
    slots = slot_state_bytes(f, cells.n_parallel)
    parts = [
        *_offload_weight_parts(inp, "the device"),
        *_offload_kv_parts(inp, cells, n_ubatch),
        BudgetPart("gpu_output", output, "load", "device", "logits, in the device's host buffer"),
        BudgetPart("gpu_compute", comp.device, "load", "device", "the device's compute buffer"),
        BudgetPart(
            "gpu_host_compute",
            comp.host,
            "load",
            "device",
            "the CPU's compute buffer, host buffer type",
        ),
        BudgetPart(
            "gpu_runtime",
            runtime,
            "load",
            "anon",
            "the Vulkan loader, driver and compiled pipelines in the engine's heap (lavapipe)",
        ),
        *_growth_parts(inp, checkpoints, cache),
        *_server_parts(slots, offload.VULKAN_BINARY_FILE_BYTES),
        *_front_parts(inp),
        *_reserve_parts(inp),
    ]
    http = http_threads(cells.n_parallel, inp.board.n_cpus)
    threads = inp.engine.n_threads + http + SERVER_OTHER_THREADS + offload.VULKAN_THREADS
    device = sum(p.bytes for p in parts if p.name in DEVICE_PARTS)
    host_kv = next(p.bytes for p in parts if p.name == "kv_cache")
    buffers = host_kv + checkpoints + cache + slots + runtime
    if inp.gpu is not None and inp.gpu.process_memory:
        buffers += device
    engine_commit = _engine_commit_bytes(f, threads, buffers)
    front_commit = (
        (FRONT_COMMIT_BYTES + FRONT_THREADS * THREAD_STACK_BYTES) if inp.front_process else 0
    )
    notes = {
        "compute_reserved": f"device {comp.device} bytes, host {comp.host} bytes reserved",
        "threads": f"{threads} engine threads ({inp.engine.n_threads} compute, {http} HTTP)",
    }
    return Budget(
        tuple(parts),
        cells,
        comp.device + comp.host,
        engine_commit,
        front_commit,
        notes,
        first_start_parts(inp),
    )
