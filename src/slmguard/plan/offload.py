"""Offload: which weights, KV cells and compute buffers go to the GPU for ``-ngl N``.

Owns the rules of llama.cpp (the llama.cpp vendored in llama-cpp-python 0.3.36,
commit 0c1e570) for placing a model on a GPU device, as byte counts the budget
turns into parts. Pure: no I/O. Each rule is from the source, checked against
the engine's load log and the memory measured on lavapipe
(``benchmarks/plan_accuracy.py --offload``, RESULTS.md "plan accuracy with offload"):

* **Layers.** ``--n-gpu-layers N`` counts the output layer first: the device
  gets the output layer when N >= 1 and the last N - 1 repeating layers
  (``i_gpu_start = n_layer + 1 - N`` in ``llama_model::load_tensors``); all of
  them at N = n_layer + 1. The input embedding always stays on the CPU.
* **Weights on the device** (``Vulkan0``/``CUDA0 model buffer``): the tensors of
  those layers, and for the output layer ``output.weight`` or, with tied
  embeddings, a copy of ``token_embd`` (``TENSOR_DUPLICATED`` in another buffer
  type), plus ``output_norm``.
* **Weights on the host side.** The other weights stay in the CPU's buffer,
  mapped from the file (``CPU_Mapped``), and are *not repacked* for the CPU's SIMD
  kernels once a GPU device is in use (measured: no ``CPU_REPACK`` buffer, even at
  ``-ngl 0`` on the default device). A tensor larger than the device's buffer range
  (Vulkan's ``maxStorageBufferRange``: 128 MiB on lavapipe, so Gemma 3's 170 MiB
  embedding) cannot be offloaded at all and stays there too, a tied output then
  sharing the embedding's mapping. The file pages of the offloaded tensors are read
  once to upload them and unmapped: cold page cache.
* **KV cache.** Per layer, on the layer's device (``Vulkan0 KV buffer``) when
  the KV is offloaded (the default), in the CPU's buffer otherwise
  (``--no-kv-offload``), and always in the CPU's buffer for CPU layers.
* **Compute buffers.** One per backend that runs part of the graph: the device's
  (``Vulkan0 compute buffer``) and the CPU's, which is allocated from the host
  buffer type (``Vulkan_Host compute buffer``) when a device is in use. Sizes:
  :func:`split_compute`, fitted on the engine's reports on lavapipe.
* **Output buffer.** The logits, in the device's host buffer type.
* **Runtime.** The Vulkan loader, the driver and its compiled pipelines live in
  the process's heap: :data:`VULKAN_RUNTIME_BYTES` (lavapipe, measured with the
  pipelines found in Mesa's shader cache); what a board's driver and CUDA's context
  take is not measured here.
* **No device.** A Vulkan build run with ``--device none`` (what the plan writes when
  it offloads nothing) still creates the Vulkan instance at start, which loads the
  installed drivers: :data:`VULKAN_INSTANCE_BYTES` of heap (:func:`instance_bytes`).
* **A cold start.** When Mesa's on-disk shader cache is empty (the first start after
  installing or upgrading the driver or the engine) or cannot be written, the engine
  compiles its pipelines itself and keeps :data:`VULKAN_SHADER_COMPILE_BYTES` more heap
  for its life (lavapipe, measured; :func:`first_start_bytes`). Not the steady state:
  ``serve`` gives the engine a cache that persists, so later starts are warm.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from slmguard.plan.modelfacts import ModelFacts, TensorFacts

MiB = 1 << 20
_BLOCK = re.compile(r"blk\.(\d{1,4})\.")


def offloaded_layers(n_layer: int, n_gpu_layers: int) -> tuple[bool, frozenset[int]]:
    """(output layer on the device, repeating layers on the device) for ``-ngl``."""
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
    """Where each weight goes when a device is in use (see the module docstring).

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
    """The layers whose KV cache is on the device."""
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
