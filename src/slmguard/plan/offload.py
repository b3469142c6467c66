"""Offload: which weights, KV cells and compute buffers go to the GPU, and their budget.

Owns llama.cpp's placement of a model on a GPU device for ``-ngl N`` (the llama.cpp
vendored in llama-cpp-python 0.3.36, commit 0c1e570: :func:`offloaded_layers`,
:func:`split_weights`, :func:`split_kv`, :func:`split_compute`), what a GPU build costs
with or without a device (the Vulkan runtime, instance and binary, a cold start's shader
compilation), and the budget of a configuration with a device in use
(:func:`offload_budget`, which :func:`slmguard.plan.budget.compute_budget` hands it).
Each rule is from the source, checked against the engine's load log and the memory
measured on lavapipe (``benchmarks/plan_accuracy.py --offload``, RESULTS.md "plan
accuracy with offload"); docs/plan.md "Offload" explains them. Pure: no I/O.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from slmguard.plan.allocation import (
    SERVER_FILE_BYTES,
    SERVER_OTHER_THREADS,
    Cells,
    checkpoint_bytes,
    compute_phases,
    engine_cells,
    engine_commit_bytes,
    http_threads,
    kv_cache_bytes,
    mapped_bytes,
    output_bytes,
    server_base_anon_bytes,
    slot_state_bytes,
)
from slmguard.plan.modelfacts import ModelFacts, TensorFacts
from slmguard.plan.parts import (
    DEVICE_PARTS,
    Budget,
    BudgetInput,
    front_commit_bytes,
    front_parts,
    growth_parts,
    kv_note,
    reserve_parts,
    server_parts,
)
from slmguard.plan.schema import BudgetPart

MiB = 1 << 20
_BLOCK = re.compile(r"blk\.(\d{1,4})\.")


def offloaded_layers(n_layer: int, n_gpu_layers: int) -> tuple[bool, frozenset[int]]:
    """(output layer on the device, repeating layers on the device) for ``-ngl``.

    ``-ngl N`` counts the output layer first: the device gets the output layer when
    N >= 1 and the last N - 1 repeating layers (``i_gpu_start = n_layer + 1 - N`` in
    ``llama_model::load_tensors``); all of them at N = n_layer + 1. The input embedding
    always stays on the CPU."""
    n = max(0, min(n_gpu_layers, n_layer + 1))
    if n == 0:
        return False, frozenset()
    return True, frozenset(range(n_layer + 1 - n, n_layer))


def layer_of(tensor_name: str) -> int | None:
    """The repeating layer a tensor belongs to (``blk.<i>.``), None for the others."""
    m = _BLOCK.match(tensor_name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class WeightSplit:
    """Bytes of weights on the device, in the host buffer type, and left to the CPU's own
    buffers (mapped from the file) because the device cannot hold them at all."""

    device_bytes: int
    host_bytes: int
    cpu_tensors: tuple[TensorFacts, ...]  # too large for the device's buffers
    layers: int  # repeating layers on the device
    output: bool  # the output layer on the device

    @property
    def cpu_bytes(self) -> int:
        return sum(t.n_bytes for t in self.cpu_tensors)


def _fits(t: TensorFacts, max_tensor_bytes: int | None) -> bool:
    return max_tensor_bytes is None or t.n_bytes <= max_tensor_bytes


def split_weights(
    facts: ModelFacts, n_gpu_layers: int, max_tensor_bytes: int | None = None
) -> WeightSplit:
    """Where each weight goes when a device is in use.

    The device gets the tensors of its layers and, for the output layer,
    ``output.weight`` (with tied embeddings a copy of ``token_embd``,
    ``TENSOR_DUPLICATED``) and ``output_norm``. The rest stay in the CPU's buffer,
    mapped from the file (``CPU_Mapped``), *not repacked* once a device is in use
    (measured: no ``CPU_REPACK`` buffer, even at ``-ngl 0`` on the default device); the
    offloaded tensors' file pages are read once to upload them: cold page cache.

    ``max_tensor_bytes`` is the device's largest buffer range (Vulkan's
    ``maxStorageBufferRange``): a larger tensor cannot be in the device's buffers and
    stays in the CPU's (mapped), where a tied output shares the embedding's mapping
    (one buffer type, one tensor)."""
    output, layers = offloaded_layers(facts.n_layer, n_gpu_layers)
    device = 0
    cpu: list[TensorFacts] = []
    tied = facts.tensor("output.weight") is None
    for t in facts.tensors:
        il = layer_of(t.name)
        if il is not None:
            on_device = il in layers
        elif t.name in ("output.weight", "output_norm.weight"):
            on_device = output
        else:
            on_device = False  # token_embd and the other input-side tensors
        if on_device and _fits(t, max_tensor_bytes):
            device += t.n_bytes
        else:
            cpu.append(t)
        if t.name == "token_embd.weight" and tied and output and _fits(t, max_tensor_bytes):
            device += t.n_bytes  # the output layer's own copy
    return WeightSplit(device, 0, tuple(cpu), len(layers), output)


def split_kv(facts: ModelFacts, n_gpu_layers: int, kv_offload: bool) -> frozenset[int]:
    """The layers whose KV cache is on the device: the offloaded ones, unless the KV is
    kept on the host (``--no-kv-offload``); a CPU layer's is always in the CPU's buffer."""
    if not kv_offload:
        return frozenset()
    return offloaded_layers(facts.n_layer, n_gpu_layers)[1]


# ---------------------------------------------------------------- fitted on lavapipe
# Fitted on the 11 offload cells of RESULTS.md "plan accuracy with offload (lavapipe)"
# (Gemma 3 270M, n_ctx 2048 and 8192, n_ubatch 512, -fa off): one model, one driver.
#
# The Vulkan runtime in the engine's heap: the loader, lavapipe and the pipelines LLVM
# compiled for it, which grow with the shaders a run used: 18-21 MiB with no layer
# offloaded, 82-87 MiB with the KV on the host, 115-121 MiB with it on the device (one
# cell, the first to compile its pipelines, 181 MiB). The budget takes the common value of
# each case; a board's driver (libmali, PanVK, v3dv, CUDA) is not measured. These are
# warm figures: Mesa's on-disk shader cache held the pipelines. A cold start is
# VULKAN_SHADER_COMPILE_BYTES more, below.
VULKAN_RUNTIME_BYTES = {"none": 21 * MiB, "kv_host": 88 * MiB, "kv_device": 121 * MiB}
# A Vulkan build that uses no device (--device none) still creates the Vulkan instance:
# ggml registers its backends when the program starts, and ggml_backend_vk_reg() calls
# ggml_vk_instance_init(), whose vkCreateInstance and vkEnumeratePhysicalDevices make the
# loader open every installed ICD (Debian's mesa-vulkan-drivers: lavapipe, and with it
# libLLVM, whose relocated data pages become the process's anonymous memory). Measured on
# this machine (Mesa 22.3.6, lvp + intel + hasvk + radeon ICDs): the instance and the
# enumeration alone, in a 30-line C program, +12.4 MiB anonymous (8.1 MiB of it libLLVM's
# relocations, 1.9 MiB heap) and +48.9 MiB file-backed; the engine with --device none
# against the CPU build with the same settings at load, +12.4 MiB anonymous (2048 and 8192
# cells alike). A board's ICD set (v3dv, PanVK and lavapipe on Debian arm64) not measured.
VULKAN_INSTANCE_BYTES = 12 * MiB + 512 * 1024
# A cold start (Mesa's shader cache empty or unwritable) compiles the pipelines in the
# engine, and the heap LLVM leaves behind stays for the process's life. Fitted from the
# six 2048 cells measured again with MESA_SHADER_CACHE_DISABLE=true
# (benchmarks/plan_accuracy_gpu_cells_cold.json) against the same cells warm
# (plan_accuracy_gpu_cells.json), by benchmarks/shader_cache.py; host anon, MiB:
#
#   -ngl 9, KV on the device:  cold 269.2  warm 253.2 (*)  +16.0  over the budget +75.7
#   -ngl 9, KV on the host:    cold 274.3  warm 174.5      +99.8  over the budget +97.8
#   -ngl 19, KV on the device: cold 255.3  warm 167.4      +87.9  over the budget +81.8
#   -ngl 19, KV on the host:   cold 253.7  warm 170.9      +82.8  over the budget +77.2
#   -ngl 0 (--device none and the default device): -0.1 and +2.8, so no part there.
#
# (*) that warm cell was itself the first to compile (the cache was empty): cold too.
# The part is the worst case of both columns, 99.8 MiB (-ngl 9, KV on the host), rounded
# up to 100 MiB, for every offloaded configuration: the differences do not follow the
# layers or the KV's place (82.8-99.8 over the warm cells), so no finer rule is fitted.
# One model, one driver (lavapipe, Mesa 22.3.6), -fa off: with flash attention on the
# engine compiles other shaders and no cold start was measured; a board's driver
# (v3dv, PanVK) has the same cache and was not measured either.
VULKAN_SHADER_COMPILE_BYTES = 100 * MiB
# With flash attention (-fa on), measured cold 2026-12-03 (the same cold file, n_ctx 2048,
# -ngl 9; the -ngl 19 cells did not finish in time): the engine took 4.4 minutes to load
# while LLVM compiled the flash-attention pipelines, and held 828.5 / 831.3 MiB of host
# anon (KV on the device / on the host) against the steady budget's 193.5 / 176.5:
# +635.0 / +654.8 MiB, rounded up. It is the compilation, not flash attention's steady
# state: the same -ngl 9 / KV on the device cell with the cache primed held 195.4 MiB
# (budget 193.5) and ran its prompt in 13 s where the cold one took 350 s.
VULKAN_SHADER_COMPILE_FA_BYTES = 655 * MiB
# The Vulkan build's code and the driver's libraries, resident (file-backed): 67.5 MiB
# with --device none, 77.3 MiB with the device in use (lavapipe's LLVM). With --device
# none the CPU does everything, but the Vulkan instance (VULKAN_INSTANCE_BYTES) still
# loads the Vulkan loader and every installed ICD with lavapipe's libLLVM (+48.9 MiB
# file-backed in the C program) beside the larger binary (its Vulkan backend's code and
# the shaders compiled into it): four times the CPU build's 16.5 MiB.
VULKAN_BINARY_FILE_BYTES = 77 * MiB + 300 * 1024
VULKAN_BINARY_NO_DEVICE_FILE_BYTES = 67 * MiB + 512 * 1024
VULKAN_THREADS = 6  # threads the Vulkan device adds (measured: 11 -> 17)
# Host-side compute buffer (Vulkan_Host) beside the attention masks, at n_ubatch 512
# and n_embd 640: per ubatch token and embedding element, bytes.
HOST_COMPUTE_PER_TOKEN_EMBD = 14.1  # 4.51 MiB / (512 x 640), KV on the device
HOST_ATTN_SAVED_PER_TOKEN_EMBD = 10.4  # 3.24 MiB / (512 x 640), KV on the host


def first_start_bytes(gpu_build: str | None, n_gpu_layers: int, flash_attn: bool = False) -> int:
    """The heap a cold start adds to :func:`runtime_bytes`: the shader compilation of
    :data:`VULKAN_SHADER_COMPILE_BYTES` (:data:`VULKAN_SHADER_COMPILE_FA_BYTES` with flash
    attention) when layers run on a Vulkan device, else 0 (no layer offloaded: measured
    within 4.3 MiB of a warm start and 1.2 MiB of the budget; CUDA: not measured)."""
    if gpu_build != "vulkan" or n_gpu_layers <= 0:
        return 0
    return VULKAN_SHADER_COMPILE_FA_BYTES if flash_attn else VULKAN_SHADER_COMPILE_BYTES


def instance_bytes(gpu_build: str | None) -> int:
    """The heap of an engine built with a GPU backend that uses no device: the Vulkan
    instance (:data:`VULKAN_INSTANCE_BYTES`); a CPU build's, and CUDA's (not measured), 0."""
    return VULKAN_INSTANCE_BYTES if gpu_build == "vulkan" else 0


def runtime_bytes(n_gpu_layers: int, kv_offload: bool) -> int:
    """The Vulkan loader, the driver and its compiled pipelines in the engine's heap
    (lavapipe, with the pipelines found in Mesa's shader cache; a board's driver and
    CUDA's context are not measured): :data:`VULKAN_RUNTIME_BYTES`."""
    if n_gpu_layers <= 0:
        return VULKAN_RUNTIME_BYTES["none"]
    return VULKAN_RUNTIME_BYTES["kv_device" if kv_offload else "kv_host"]


@dataclass(frozen=True)
class ComputeSplit:
    device: int  # the device's compute buffer
    host: int  # the CPU's, in the device's host buffer type


def split_compute(
    facts: ModelFacts,
    phases: tuple[int, int, int, int],
    n_ubatch: int,
    n_gpu_layers: int,
    kv_offload: bool,
) -> ComputeSplit:
    """The two compute buffers from the CPU graph's phases (masks, attention, ffn, total)
    of the same settings: with the KV on the device the device reserves the CPU's whole
    graph (partly offloaded: plus a third of the masks, less 3.3 MiB) and the host the
    masks and a few activations; with the KV on the host the attention moves to the host
    and the device keeps the FFN phase without the masks."""
    masks, attention, ffn, total = phases
    t_embd = n_ubatch * facts.n_embd
    full = n_gpu_layers > facts.n_layer
    if kv_offload or n_gpu_layers <= 0:
        device = total if full else max(0, total + int(0.345 * masks) - int(3.33 * MiB))
        return ComputeSplit(device, masks + int(HOST_COMPUTE_PER_TOKEN_EMBD * t_embd))
    device = max(0, ffn - masks - (4 * t_embd if full else 0))
    return ComputeSplit(device, max(0, attention - int(HOST_ATTN_SAVED_PER_TOKEN_EMBD * t_embd)))


# ---------------------------------------------------------------- the offload budget


def first_start_parts(inp: BudgetInput) -> tuple[BudgetPart, ...]:
    """What only a cold first start holds, beside the steady state: each of
    :data:`slmguard.plan.schema.FIRST_START_PARTS` that this configuration has."""
    shader = first_start_bytes(
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


def instance_parts(instance: int) -> list[BudgetPart]:
    """A GPU build's runtime when it uses no device (``--device none``): the Vulkan
    instance its backend creates at start (:func:`instance_bytes`)."""
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


def cpu_binary_bytes(inp: BudgetInput) -> int:
    """The resident code of an engine that offloads nothing: a Vulkan build's with
    ``--device none`` (measured, x86-64), else the CPU build's (CUDA's: not measured)."""
    if inp.gpu_build == "vulkan":
        return VULKAN_BINARY_NO_DEVICE_FILE_BYTES
    return SERVER_FILE_BYTES


def _offload_weight_parts(inp: BudgetInput, device: str) -> list[BudgetPart]:
    """The weights with a GPU device in use (plan.offload): the offloaded ones on the
    device, the rest mapped from the file and read by the CPU, nothing repacked."""
    split = split_weights(
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
    on_device = split_kv(f, inp.n_gpu_layers, inp.engine.kv_offload)
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
    note = kv_note(inp, cells, n_ubatch)
    return [
        BudgetPart(
            "kv_cache", kv["kv_cache"], "load", "anon", f"{len(host_layers)} layers: {note}"
        ),
        BudgetPart(
            "gpu_kv", kv["gpu_kv"], "load", "device", f"{len(on_device)} layers on the device"
        ),
    ]


def offload_budget(inp: BudgetInput) -> Budget:
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
    comp = split_compute(
        f,
        (ph.masks, ph.attention, ph.ffn, ph.total),
        n_ubatch,
        inp.n_gpu_layers,
        inp.engine.kv_offload,
    )
    runtime = runtime_bytes(inp.n_gpu_layers, inp.engine.kv_offload)
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
        *growth_parts(inp, checkpoints, cache),
        *server_parts(
            slots, VULKAN_BINARY_FILE_BYTES, server_base_anon_bytes(f.has_kv_cache, f.n_vocab)
        ),
        *front_parts(inp),
        *reserve_parts(inp),
    ]
    http = http_threads(cells.n_parallel, inp.board.n_cpus)
    threads = inp.engine.n_threads + http + SERVER_OTHER_THREADS + VULKAN_THREADS
    device = sum(p.bytes for p in parts if p.name in DEVICE_PARTS)
    host_kv = next(p.bytes for p in parts if p.name == "kv_cache")
    buffers = host_kv + checkpoints + cache + slots + runtime
    if inp.gpu is not None and inp.gpu.process_memory:
        buffers += device
    engine_commit = engine_commit_bytes(f, threads, buffers)
    front_commit = front_commit_bytes(inp)
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
