"""A budget's shape: what it is computed from, its named parts and their totals.

Owns :class:`BudgetInput` (the model, the engine's :class:`EngineSettings`, the board's
side and the GPU's), :class:`Budget` (the parts, in bytes, with the totals the planner,
the governor and the benchmarks read: the hot peak, the device side, the commit charge)
and the parts every budget has whatever runs the model: the KV cache's note, the output
buffer, what grows with use, llama-server's own process, the HTTP front and the board's
reserves. No arithmetic of its own beyond sums (:mod:`slmguard.plan.allocation` has the
rules); :mod:`slmguard.plan.budget` and :mod:`slmguard.plan.offload` build on it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from slmguard.plan.allocation import (
    CTX_CHECKPOINTS,
    FRONT_ANON_BYTES,
    FRONT_COMMIT_BYTES,
    FRONT_FILE_BYTES,
    FRONT_THREADS,
    SERVER_BASE_ANON_BYTES,
    SERVER_FILE_BYTES,
    THREAD_STACK_BYTES,
    Cells,
    output_rows,
    swa_cells,
)
from slmguard.plan.modelfacts import ModelFacts
from slmguard.plan.projector import VisionInput
from slmguard.plan.schema import BudgetBoard, BudgetGpu, BudgetPart, EngineSettings

MiB = 1 << 20

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
    ``front_process``: the HTTP front's own parts are counted. ``vision``: a projector
    served beside the model (:mod:`slmguard.plan.vision` adds its parts).
    """

    facts: ModelFacts
    engine: EngineSettings
    board: BudgetBoard = X86_HOST
    gpu: BudgetGpu | None = None
    front_process: bool = True
    fill_tokens: int | None = None
    vision: VisionInput | None = None

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
        return hot_bytes(self.parts)

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
        # a vision projector (plan.vision)
        "projector_weights",
        "projector_context",
        "encoder_compute",
        "encoder_work",
        "image_slots",
        "image_requests",
    }
)
ENGINE_FILE = frozenset({"weights_mapped", "weights_mapped_cold", "server_binary"})
# Offload: the engine's buffers in the GPU driver's memory, and the runtime in its heap.
DEVICE_PARTS = frozenset(
    {
        "gpu_weights", "gpu_kv", "gpu_compute", "gpu_host_compute", "gpu_output",
        "gpu_projector", "gpu_encoder_compute",  # an offloaded projector (plan.vision)
    }
)  # fmt: skip


def hot_bytes(parts: Iterable[BudgetPart]) -> int:
    """The planned peak of a budget's parts (:attr:`Budget.hot_bytes`): the service's anon
    and file parts but the cold page cache, and the engine's buffers on a device. A plan's
    recorded parts give the same figure as the budget they came from."""
    parts = tuple(parts)
    service = sum(
        p.bytes for p in parts if p.kind in ("anon", "file") and p.name != "weights_mapped_cold"
    )
    return service + sum(p.bytes for p in parts if p.name in DEVICE_PARTS)


def kv_note(inp: BudgetInput, cells: Cells, n_ubatch: int) -> str:
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


def output_part(f: ModelFacts, cells: Cells, n_ubatch: int, output: int) -> BudgetPart:
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


def growth_parts(inp: BudgetInput, checkpoints: int, cache: int) -> list[BudgetPart]:
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


def server_parts(
    slot_state: int, binary_bytes: int = SERVER_FILE_BYTES, runtime: int = SERVER_BASE_ANON_BYTES
) -> list[BudgetPart]:
    """llama-server's own process: its heap (``runtime``: :func:`server_base_anon_bytes`),
    each slot's request state, its code."""
    return [
        BudgetPart(
            "server_runtime",
            runtime,
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


def front_parts(inp: BudgetInput) -> list[BudgetPart]:
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


def reserve_parts(inp: BudgetInput) -> list[BudgetPart]:
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


def front_commit_bytes(inp: BudgetInput) -> int:
    """The HTTP front's commit charge: its heap and its threads' stacks (0 without it)."""
    return (FRONT_COMMIT_BYTES + FRONT_THREADS * THREAD_STACK_BYTES) if inp.front_process else 0
