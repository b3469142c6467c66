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
* **Weights on the host side.** Whenever a GPU device is in use, the CPU's
  buffer list starts with the device's *host* buffer type (``Vulkan_Host``,
  ``CUDA_Host``: pinned memory the GPU can read; ``make_cpu_buft_list``), which
  accepts every weight, so the rest of the model is *copied* there: neither
  mapped from the file nor repacked for the CPU's SIMD kernels. That memory is
  the GPU driver's like the device buffers (on lavapipe, process memory). The
  input embedding and a CPU-side output share one copy (same buffer type).
  Nothing stays in the file mapping, which llama.cpp then unmaps: the GGUF's
  pages are read once and left cold in the page cache.
* **KV cache.** Per layer, on the layer's device (``Vulkan0 KV buffer``) when
  the KV is offloaded (the default), in the CPU's buffer otherwise
  (``--no-kv-offload``), and always in the CPU's buffer for CPU layers.
* **Compute buffers.** One per backend that runs part of the graph: the device's
  (``Vulkan0 compute buffer``) and the CPU's, which is allocated from the host
  buffer type (``Vulkan_Host compute buffer``) when a device is in use. Sizes:
  :func:`device_compute_bytes`, fitted on the engine's reports.
* **Output buffer.** The logits, in the device's host buffer type.
* **Runtime.** The Vulkan loader, the driver and its compiled pipelines live in
  the process's heap: :data:`VULKAN_RUNTIME_BYTES` (lavapipe, measured); what a
  board's driver and CUDA's context take is not measured here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from slmguard.plan.modelfacts import ModelFacts

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
    """Bytes of weights on the device and in the host buffer type."""

    device_bytes: int
    host_bytes: int
    layers: int  # repeating layers on the device
    output: bool  # the output layer on the device


def split_weights(facts: ModelFacts, n_gpu_layers: int) -> WeightSplit:
    """Where each weight goes when a device is in use (see the module docstring)."""
    output, layers = offloaded_layers(facts.n_layer, n_gpu_layers)
    device = host = 0
    tied = facts.tensor("output.weight") is None
    for t in facts.tensors:
        il = layer_of(t.name)
        if il is not None:
            on_device = il in layers
        elif t.name in ("output.weight", "output_norm.weight"):
            on_device = output
        else:
            on_device = False  # token_embd and the other input-side tensors
        if on_device:
            device += t.n_bytes
        else:
            host += t.n_bytes
        if t.name == "token_embd.weight" and tied and output:
            device += t.n_bytes  # the output layer's own copy
    return WeightSplit(device, host, len(layers), output)


def split_kv(facts: ModelFacts, n_gpu_layers: int, kv_offload: bool) -> frozenset[int]:
    """The layers whose KV cache is on the device."""
    if not kv_offload:
        return frozenset()
    return offloaded_layers(facts.n_layer, n_gpu_layers)[1]


# ---------------------------------------------------------------- fitted on lavapipe
# The Vulkan runtime in the engine's heap (loader, lavapipe, LLVM's compiled
# pipelines) and its threads: measured on Mesa 22.3.6 lavapipe (see RESULTS.md).
VULKAN_RUNTIME_BYTES = 0
VULKAN_THREADS = 0


@dataclass(frozen=True)
class ComputeSplit:
    device: int  # the device's compute buffer
    host: int  # the CPU's, in the device's host buffer type


def split_compute(
    facts: ModelFacts, reserved: int, n_parallel: int, n_gpu_layers: int, kv_offload: bool
) -> ComputeSplit:
    """The two compute buffers from the CPU-only reservation of the same graph."""
    if n_gpu_layers <= 0:
        return ComputeSplit(0, reserved)
    return ComputeSplit(reserved, 0)
