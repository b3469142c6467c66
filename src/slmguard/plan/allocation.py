"""What llama.cpp allocates for one model and context: its rules, as byte counts.

Owns the rules of the ``llama-server`` slmguard runs (the llama.cpp vendored in
llama-cpp-python 0.3.36, commit 0c1e570) for a CPU: the KV cells and cache, the compute
graph's phases and buffers, the output buffer, the weights the CPU backend repacks, the
server's own heap, threads and commit charge, and the constants measured for them (each
rule checked against the engine's load log and RSS: ``benchmarks/plan_accuracy.py``,
``benchmarks/RESULTS.md``; docs/plan.md "What the budget counts" explains them). Pure
numbers: no part names, no board, no I/O; :mod:`slmguard.plan.budget` and
:mod:`slmguard.plan.offload` make parts of them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from slmguard.plan.modelfacts import ModelFacts

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
# The same heap for a model llama.cpp runs without a KV cache (an encoder: BERT and its
# kin, no decoding warm-up, no sampler): a base and its vocabulary's entries (text, scores,
# the lookup maps). Fitted on the tests' two-layer BERT with its vocabulary padded to 0.5k,
# 30.5k and 250k entries: 6.1 MiB + 139 B an entry measured (RESULTS.md "plan accuracy for a
# board"); budgeted 7 MiB + 150 B, so a MiniLM reranker gets 11.4 MiB, not the 50 a decoder's.
ENCODER_BASE_ANON_BYTES = 7 * MiB
ENCODER_ANON_PER_VOCAB_BYTES = 150


def server_base_anon_bytes(has_kv_cache: bool, n_vocab: int) -> int:
    """llama-server's heap after load: :data:`SERVER_BASE_ANON_BYTES` for a model with a
    KV cache, an encoder's by its vocabulary (:data:`ENCODER_BASE_ANON_BYTES`)."""
    if has_kv_cache:
        return SERVER_BASE_ANON_BYTES
    return ENCODER_BASE_ANON_BYTES + ENCODER_ANON_PER_VOCAB_BYTES * n_vocab


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
    """The engine's cell layout (``llama_context`` constructor): ``-c`` padded to 256;
    without ``--kv-unified`` each of the ``-np`` slots gets ``pad256(n_ctx / slots)`` cells
    in its own stream (and ``n_ctx`` becomes that times the slots); with it, one stream
    of ``n_ctx`` cells that every slot may use."""
    if n_ctx <= 0 or n_parallel <= 0:
        raise ValueError("n_ctx and n_parallel must be > 0")
    total = _pad(n_ctx, CELL_PAD)
    if kv_unified:
        return Cells(total, total, 1, n_parallel, True)
    per_slot = _pad(total // n_parallel, CELL_PAD) if total >= n_parallel else CELL_PAD
    return Cells(per_slot * n_parallel, per_slot, n_parallel, n_parallel, False)


def swa_cells(facts: ModelFacts, cells: Cells, n_ubatch: int, swa_full: bool) -> int:
    """KV cells per stream of a sliding-window layer: all of them with ``--swa-full``,
    else ``pad256(min(cells, n_swa x (slots if unified else 1) + n_ubatch))``
    (``llama_kv_cache_iswa``)."""
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


def cells_in_use(cells: Cells, fill_tokens: int | None) -> int | None:
    """The KV view a ubatch sees per stream after ``fill_tokens`` per slot (padded)."""
    if fill_tokens is None:
        return None
    used = fill_tokens * (cells.n_parallel if cells.unified else 1)
    return _pad(max(used, 1), CELL_PAD)


def ubatch_tokens(cells: Cells, fill_tokens: int | None) -> int | None:
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
        n_kv=cells_in_use(cells, fill_tokens),
        n_tokens=ubatch_tokens(cells, fill_tokens),
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


def engine_commit_bytes(facts: ModelFacts, threads: int, buffers: int) -> int:
    """llama-server's commit charge: its measured heap and data, every private
    buffer (``buffers``) at full size, and the stack of each thread but the main one."""
    return (
        SERVER_BASE_COMMIT_BYTES
        + SERVER_COMMIT_PER_TENSOR_BYTES * len(facts.tensors)
        + SERVER_COMMIT_PER_TOKEN_BYTES * facts.n_vocab
        + buffers
        + (threads - 1) * THREAD_STACK_BYTES
    )
