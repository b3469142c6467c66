"""The memory budget: pure arithmetic from model facts and engine settings.

Owns the rules for what llama-cpp-python 0.3.36 (and the llama.cpp it
bundles) allocates for one model and context, as named parts in bytes
(:class:`slmguard.plan.schema.BudgetPart`), plus the reserved address space and
the commit charge that ``vm.overcommit_memory=2`` accounts. No I/O, no engine.

The rules, each checked against the engine's verbose load log and measured
RSS (``benchmarks/plan_accuracy.py``, results in ``benchmarks/RESULTS.md``):

* **Weights.** The GGUF is mapped read-only (``load_mode = mmap``): its tensor
  data is file-backed page cache ("CPU_Mapped model buffer"), reclaimable but
  charged to the cgroup that faults it in; loading touches all of it. Weights
  the CPU backend *repacks* for its SIMD kernels ("CPU_REPACK model buffer")
  are copied into anonymous memory, same size, and their file pages stay
  mapped too. Which tensors are repacked depends on the ISA
  (``ggml_repack_get_optimal_repack_type`` in ggml-cpu/repack.cpp): 2-D
  matmul weights (never ``token_embd``) of Q4_0/Q4_K/IQ4_NL with a row count
  divisible by the interleave (8 on AVX2, 4 or 8 on ARM dotprod). With
  ``use_mlock`` the mapped pages are locked (unevictable).
* **KV cache.** Allocated and zeroed when the context is created, so resident
  at load whatever the conversation length. Per layer: cells x KV heads x
  (key_length + value_length) x type size (f16 2 B; q8_0 34 B and q4_0 18 B
  per 32 elements). Sliding-window layers (Gemma 3: 15 of 18) get n_ctx cells
  when ``swa_full`` (llama-cpp-python's default, logged as "using full-size
  SWA cache"), otherwise min(n_ctx, pad256(n_swa + n_ubatch)) cells
  (``llama_kv_cache_iswa``; measured 768 cells at n_ubatch 64, 1024 at 512).
* **Compute buffer.** Reserved for the worst-case ubatch: all n_ubatch tokens
  produce logits, so at least n_ubatch x (n_vocab + 2 n_embd) x 4 B (514.5 MiB
  for Gemma 3's 262,144-token vocabulary at n_ubatch 512), or the attention
  scores n_ubatch x n_kv x n_head x 4 B x 2 (scores + softmax, no flash
  attention) when larger. Only what the real graph touches becomes resident:
  one logits row, the activations and the attention scores of the largest
  ubatch (:func:`compute_resident_bytes`, fitted on measurements).
* **Output buffer.** n_vocab x 4 B per sequence for the logits.
* **Runtime.** The worker process (CPython + llama_cpp + the tokenizer's
  per-token tables) and the HTTP front process, measured on x86-64 CPython
  3.11; shared libraries are file-backed.
* **Commit charge.** What mode-2 overcommit accounts: private writable
  mappings, i.e. every reserved buffer at its full size (not only what is
  resident), llama-cpp-python's n_batch x n_vocab float32 logits array, and
  each thread's stack (``ulimit -s``, 8 MiB by default). The read-only model
  mapping is not charged.

Resident at load: weights, repacked weights, KV cache, output buffer, runtimes.
Grows with use: the touched part of the compute buffer (bounded by its
reservation), allocator slack.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from slmguard.plan.modelfacts import ModelFacts
from slmguard.plan.schema import BudgetPart

MiB = 1 << 20
KV_TYPES: Mapping[str, tuple[int, int]] = {
    # ggml type -> (elements per block, bytes per block); ggml-common.h
    "f16": (1, 2),
    "q8_0": (32, 34),
    "q4_0": (32, 18),
}

# Measured on this project's engine build (benchmarks/plan_accuracy.py, the
# "imported" and "loaded" phases of the default model): a worker that has
# imported llama_cpp holds 20.8 MiB anonymous and 26.2 MiB file-backed; after
# loading, the tokenizer tables and llama-cpp-python's per-vocabulary arrays
# add about 176 bytes per vocabulary entry (43.9 MiB for 262,144 tokens) not
# reported in any engine buffer; running the first request pages in about
# 7.5 MiB more library code.
WORKER_BASE_ANON_BYTES = 21 * MiB
WORKER_ANON_PER_TOKEN_BYTES = 176
WORKER_FILE_BYTES = 34 * MiB
# Commit charge of the same worker before loading (95.6 MiB measured) and per
# vocabulary entry after loading (about 340 B).
WORKER_BASE_COMMIT_BYTES = 96 * MiB
WORKER_COMMIT_PER_TOKEN_BYTES = 340
# The serve worker on top of the bare engine process the benchmark measures:
# its own imports (3 MiB) and allocator/sampler growth over requests (7 MiB),
# measured on `slmguard serve` (n_ctx 512, n_batch 64) after three chats.
# The growth stops there: the worker collects each request's garbage, and
# `benchmarks/worker_memory.py` measures +3 MiB from the 3rd to the 80th
# request (a bare llama-cpp-python process: +141 MiB).
WORKER_SERVE_EXTRA_BYTES = 10 * MiB
# The HTTP front process, measured on the same server: 35.3 MiB anonymous,
# 15.4 MiB file-backed, 43.9 MiB of private writable mappings with 2 threads;
# a few MiB are added for request bodies in flight and 2 more executor threads.
FRONT_ANON_BYTES = 40 * MiB
FRONT_FILE_BYTES = 16 * MiB
FRONT_COMMIT_BYTES = 40 * MiB
FRONT_THREADS = 4
# Default pthread stack = RLIMIT_STACK (8 MiB on Debian/Ubuntu/Armbian/L4T).
THREAD_STACK_BYTES = 8 * MiB

# Weights repacked into anonymous memory by the CPU backend, per ISA family:
# ggml type -> the row count a tensor must be divisible by.
# Source: ggml/src/ggml-cpu/repack.cpp ggml_repack_get_optimal_repack_type.
REPACK_RULES: Mapping[str, Mapping[str, int]] = {
    "x86_avx2": {"Q4_0": 8, "Q4_K": 8, "IQ4_NL": 8},
    "x86_avx512": {"Q4_0": 8, "Q4_K": 8, "IQ4_NL": 8, "Q2_K": 8},
    "arm_dotprod": {"Q4_0": 4, "Q4_K": 8, "IQ4_NL": 4},  # Cortex-A76/A78: RK3588, Pi 5, Orin
    "arm_i8mm": {"Q4_0": 4, "Q4_K": 8, "IQ4_NL": 4},
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


def swa_cells(facts: ModelFacts, n_ctx: int, n_ubatch: int, swa_full: bool) -> int:
    """KV cells of a sliding-window layer (see module docstring)."""
    if swa_full or not facts.swa_layers:
        return n_ctx
    return min(n_ctx, _pad(facts.sliding_window + n_ubatch, 256))


def kv_cache_bytes(
    facts: ModelFacts,
    n_ctx: int,
    kv_type: str = "f16",
    *,
    n_ubatch: int = 512,
    swa_full: bool = True,
) -> int:
    """The whole KV cache for one sequence of ``n_ctx`` cells."""
    small = swa_cells(facts, n_ctx, n_ubatch, swa_full)
    total = 0
    for il in range(facts.n_layer):
        cells = small if facts.is_swa(il) else n_ctx
        k, v = facts.kv_elements_per_cell(il)
        total += kv_type_bytes(kv_type, k * cells) + kv_type_bytes(kv_type, v * cells)
    return total


def _head_max(facts: ModelFacts) -> int:
    return max(facts.n_head) if isinstance(facts.n_head, tuple) else facts.n_head


def compute_reserved_bytes(facts: ModelFacts, n_ctx: int, n_ubatch: int, flash_attn: bool) -> int:
    """Size of the CPU compute buffer the engine reserves (address space)."""
    logits_phase = n_ubatch * (facts.n_vocab + 2 * facts.n_embd) * 4
    attn_phase = 0 if flash_attn else 2 * n_ubatch * n_ctx * _head_max(facts) * 4
    return max(logits_phase, attn_phase)


def compute_resident_bytes(
    facts: ModelFacts, n_kv: int, n_ubatch: int, flash_attn: bool, n_ctx: int
) -> int:
    """Pages of the compute buffer a full prompt touches (fitted rule).

    Activations of one ubatch (about 4 B x (2 n_ff + 2 n_embd + n_head x
    key_length / 2) per token, which also covers the f32 Q/K/V views), the
    attention scores and their softmax for ``n_kv`` visible cells (with flash
    attention: no scores, see below), one logits row and a fixed 4.4 MiB of
    graph slack; never more than the reservation. Fitted on the default model
    at n_ctx 512/2048 x n_ubatch 64/512 (within 1 MiB); the structure follows
    ggml-alloc's reuse of one buffer per graph.
    """
    per_token = 4 * (2 * facts.n_ff + 2 * facts.n_embd + _head_max(facts) * facts.key_length // 2)
    if flash_attn:
        # No score matrix; f32 copies of Q and of the output per token and a
        # mask over the visible cells (fitted on q8_0 KV at n_ctx 512/2048).
        attn = 12 * n_ubatch * _head_max(facts) * facts.key_length + 14 * n_ubatch * n_kv // 3
    else:
        attn = 2 * n_ubatch * n_kv * _head_max(facts) * 4
    touched = 4_400 * 1024 + n_ubatch * per_token + attn + facts.n_vocab * 4
    return min(touched, compute_reserved_bytes(facts, n_ctx, n_ubatch, flash_attn))


def _rows(shape: tuple[int, ...]) -> int:
    return shape[1] if len(shape) >= 2 else 1


def repacked_bytes(facts: ModelFacts, isa: str) -> int:
    """Weight bytes the CPU backend copies into anonymous memory at load."""
    rules = REPACK_RULES.get(isa, {})
    total = 0
    for t in facts.tensors:
        mult = rules.get(t.type_name)
        if mult is None or len(t.shape) != 2 or t.name == "token_embd.weight":
            continue
        if t.name.endswith(".weight") and _rows(t.shape) % mult == 0:
            total += t.n_bytes
    return total


def mapped_bytes(facts: ModelFacts) -> int:
    """File-backed bytes of the mapped tensor data (all of it is touched at load)."""
    return max(facts.file_bytes - facts.data_offset_bytes, facts.tensor_bytes)


@dataclass(frozen=True)
class BudgetInput:
    """Everything the arithmetic depends on."""

    facts: ModelFacts
    n_ctx: int
    n_batch: int = 512
    n_ubatch: int = 512
    n_threads: int = 4
    kv_type: str = "f16"
    swa_full: bool = True  # llama-cpp-python 0.3.36's default
    use_mlock: bool = False
    isa: str = "x86_avx2"
    npu_reserve_bytes: int = 0
    os_reserve_bytes: int = 0
    business_reserve_bytes: int = 0
    front_process: bool = True  # serving: add the front process and serve-worker overheads
    # Tokens in the context when the peak is reached; None = a full context.
    # Only the attention scores depend on it (the KV cache is allocated in full).
    fill_tokens: int | None = None


@dataclass(frozen=True)
class Budget:
    """Named parts plus the derived totals the planner and benchmark use."""

    parts: tuple[BudgetPart, ...]
    compute_reserved_bytes: int
    engine_commit_bytes: int
    front_commit_bytes: int
    notes: Mapping[str, str] = field(default_factory=dict)

    def part(self, name: str) -> BudgetPart | None:
        return next((p for p in self.parts if p.name == name), None)

    def _sum(self, *, kinds: tuple[str, ...], procs: tuple[str, ...] = ()) -> int:
        return sum(
            p.bytes for p in self.parts if p.kind in kinds and (not procs or p.name in procs)
        )

    @property
    def engine_anon_peak_bytes(self) -> int:
        """Peak anonymous RSS of the worker process (the benchmark's anon column)."""
        return sum(p.bytes for p in self.parts if p.name in _ENGINE_ANON)

    @property
    def engine_anon_load_bytes(self) -> int:
        return sum(p.bytes for p in self.parts if p.name in _ENGINE_ANON and p.when == "load")

    @property
    def engine_file_bytes(self) -> int:
        """File-backed RSS of the worker (mapped weights + libraries)."""
        return sum(p.bytes for p in self.parts if p.name in _ENGINE_FILE)

    @property
    def service_bytes(self) -> int:
        """Everything charged to the service's cgroup at peak (anon + file)."""
        return self._sum(kinds=("anon", "file"))

    @property
    def service_hot_bytes(self) -> int:
        """What the service needs resident to run without thrashing (no cold file pages)."""
        return self.service_bytes - sum(
            p.bytes for p in self.parts if p.name == "weights_mapped_cold"
        )

    @property
    def service_anon_bytes(self) -> int:
        return self._sum(kinds=("anon",))

    @property
    def service_load_bytes(self) -> int:
        return sum(p.bytes for p in self.parts if p.kind in ("anon", "file") and p.when == "load")

    @property
    def service_commit_bytes(self) -> int:
        return self.engine_commit_bytes + self.front_commit_bytes

    @property
    def reserve_bytes(self) -> int:
        """OS, business and device reserves beside the service."""
        return self._sum(kinds=("reserve", "device"))


_ENGINE_ANON = frozenset(
    {
        "weights_repacked",
        "kv_cache",
        "output_buffer",
        "compute_buffer",
        "worker_runtime",
    }
)
_ENGINE_FILE = frozenset({"weights_mapped", "weights_mapped_cold", "worker_libraries"})


def compute_budget(inp: BudgetInput) -> Budget:
    """The budget for one model + settings (see the module docstring for rules)."""
    f = inp.facts
    if inp.n_ctx <= 0 or inp.n_batch <= 0 or inp.n_ubatch <= 0 or inp.n_threads <= 0:
        raise ValueError("n_ctx, n_batch, n_ubatch and n_threads must be > 0")
    n_ubatch = min(inp.n_ubatch, inp.n_batch)
    flash = inp.kv_type != "f16"  # the worker enables flash attention for quantized KV
    kv = kv_cache_bytes(f, inp.n_ctx, inp.kv_type, n_ubatch=n_ubatch, swa_full=inp.swa_full)
    repacked = repacked_bytes(f, inp.isa)
    mapped = mapped_bytes(f)
    output = f.n_vocab * 4
    reserved = compute_reserved_bytes(f, inp.n_ctx, n_ubatch, flash)
    filled = inp.n_ctx if inp.fill_tokens is None else min(inp.fill_tokens, inp.n_ctx)
    n_kv = min(inp.n_ctx, _pad(max(filled, 1), 256))  # llama.cpp pads the KV view to 256
    resident = compute_resident_bytes(f, n_kv, n_ubatch, flash, inp.n_ctx)
    runtime = WORKER_BASE_ANON_BYTES + WORKER_ANON_PER_TOKEN_BYTES * f.n_vocab
    mib = MiB
    parts = [
        BudgetPart(
            "weights_mapped",
            mapped - repacked,
            "load",
            "file",
            "mmap of the GGUF tensor data: page cache, hot on every token"
            + (", locked (mlock)" if inp.use_mlock else ""),
        ),
        BudgetPart(
            "weights_mapped_cold",
            repacked,
            "load",
            "file",
            "file pages of the repacked tensors: read once at load, then reclaimable",
        ),
        BudgetPart(
            "weights_repacked",
            repacked,
            "load",
            "anon",
            f"weights the CPU backend repacks for {inp.isa} (CPU_REPACK buffer)",
        ),
        BudgetPart(
            "kv_cache",
            kv,
            "load",
            "anon",
            f"{inp.n_ctx} cells x {f.n_layer} layers, {inp.kv_type}, allocated and zeroed at load"
            + (
                ""
                if inp.swa_full or not f.swa_layers
                else f"; SWA layers {swa_cells(f, inp.n_ctx, n_ubatch, False)} cells"
            ),
        ),
        BudgetPart("output_buffer", output, "load", "anon", "logits of one sequence (f32)"),
        BudgetPart(
            "compute_buffer",
            resident,
            "use",
            "anon",
            f"resident when a full prompt runs; {reserved / mib:.1f} MiB reserved "
            f"(address space) at n_ubatch {n_ubatch}",
        ),
        BudgetPart(
            "worker_runtime",
            runtime,
            "load",
            "anon",
            "engine worker: CPython, llama_cpp, tokenizer tables",
        ),
        BudgetPart("worker_libraries", WORKER_FILE_BYTES, "load", "file", "shared libraries"),
    ]
    if inp.front_process:
        parts += [
            BudgetPart(
                "worker_serve_extra",
                WORKER_SERVE_EXTRA_BYTES,
                "use",
                "anon",
                "serve worker imports and growth over requests (measured)",
            ),
            BudgetPart("front_runtime", FRONT_ANON_BYTES, "load", "anon", "HTTP front process"),
            BudgetPart(
                "front_libraries", FRONT_FILE_BYTES, "load", "file", "HTTP front's libraries"
            ),
        ]
    if inp.npu_reserve_bytes:
        parts.append(
            BudgetPart(
                "npu_reserve",
                inp.npu_reserve_bytes,
                "load",
                "device",
                "NPU/GPU DMA-BUF and CMA pool, outside the service",
            )
        )
    if inp.os_reserve_bytes:
        parts.append(
            BudgetPart(
                "os_reserve", inp.os_reserve_bytes, "load", "reserve", "kernel, sshd, journald"
            )
        )
    if inp.business_reserve_bytes:
        parts.append(
            BudgetPart(
                "business_reserve",
                inp.business_reserve_bytes,
                "load",
                "reserve",
                "guaranteed to the business-logic zone",
            )
        )
    scores = inp.n_batch * f.n_vocab * 4  # llama-cpp-python's logits array (untouched)
    engine_commit = (
        WORKER_BASE_COMMIT_BYTES
        + WORKER_COMMIT_PER_TOKEN_BYTES * f.n_vocab
        + kv
        + repacked
        + output
        + reserved
        + scores
        + inp.n_threads * THREAD_STACK_BYTES
        + (mapped if inp.use_mlock else 0)
    )
    front_commit = (
        (FRONT_COMMIT_BYTES + FRONT_THREADS * THREAD_STACK_BYTES) if inp.front_process else 0
    )
    notes = {
        "compute_reserved": f"{reserved} bytes reserved, {resident} resident at peak",
        "scores_array": f"{scores} bytes of llama-cpp-python logits array (n_batch x n_vocab "
        "x 4), committed but untouched",
    }
    return Budget(tuple(parts), reserved, engine_commit, front_commit, notes)
