"""The offload cells of plan_accuracy.py: the plan against a Vulkan llama-server on lavapipe.

``plan_accuracy.py --offload --measure FILE --llama-server VULKAN_BUILD`` runs
these cells (``make gpu``), ``--offload --report FILE`` compares them with
the budget. The engine is started as ``serve`` starts it (``engine_argv``, now
with ``--n-gpu-layers``, ``--device``, ``--no-kv-offload``) plus
``GGML_VK_VISIBLE_DEVICES=0`` (llama.cpp uses a CPU-type Vulkan device such as
lavapipe only when it is named) and ``vkmemlog.so`` preloaded (gpu_memory.py):

* device side: the bytes the engine holds in Vulkan allocations at peak,
  against the budget's device parts (``Budget.device_bytes``: the offloaded
  weights, the weights copied into the host buffer type, the device KV, both
  compute buffers, the output buffer), which a real board's driver commits in
  full;
* host side: the engine's RssAnon without the resident device pages, against
  the budget's anonymous parts (``engine_anon_peak_bytes``: the host KV, the
  server's heap, the Vulkan runtime, the slots' state);
* file: RssFile, against ``engine_file_bytes``.

Cells (the issue's list): layers none (``--device none``, what the planner
writes when nothing is offloaded; and 0 layers on the default device, to show
what a GPU build does with ``-ngl 0``), half ((n_layer + 1) // 2) and all
(n_layer + 1), the KV on and off the device; n_ctx 2048 and 8192, 1 slot,
n_ubatch 512, f16 KV, flash attention off (``--flash-attn on`` adds or selects
the same cells with it on).

Mesa's on-disk shader cache decides how much heap the engine keeps: a start that
finds its pipelines there (the steady state ``serve`` keeps, the plan's budget)
holds about 100 MiB less than one that compiles them (the first start, the plan's
first-start part ``gpu_shader_compile``). ``--shader-cache warm`` (the default)
gives the engine a private cache directory beside the cells file and primes it:
every cell that uses the device is run once, unrecorded, before the measured
runs, so no measured cell is the first to compile. ``--shader-cache cold``
disables the cache (``MESA_SHADER_CACHE_DISABLE=true``): every start compiles, as
the first one does. Each entry records which (``shader_cache``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from accuracy_report import err_pct, measured_span, mib
from plan_accuracy import predict

SECTION = "## plan accuracy with offload (lavapipe)"
CTX = (2048, 8192)
ENV = {"GGML_VK_VISIBLE_DEVICES": "0"}


SHADER_CACHES = ("warm", "cold")


def shader_cache_env(state: str, cache_dir: Path) -> dict[str, str]:
    """The engine's environment for Mesa's shader cache: ``cold`` disables it (every
    start compiles its pipelines, as the first start after installing the engine or
    the driver does); ``warm`` points it at ``cache_dir``, which :func:`prime_cells`
    fills before the measured runs."""
    if state == "cold":
        return {"MESA_SHADER_CACHE_DISABLE": "true"}
    if state != "warm":
        raise ValueError(f"shader cache {state!r}: one of {', '.join(SHADER_CACHES)}")
    return {"MESA_SHADER_CACHE_DISABLE": "false", "MESA_SHADER_CACHE_DIR": str(cache_dir)}


def prime_cells(grid: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The cells to run once before measuring with a warm cache: every one whose engine
    uses the device (``--device none`` compiles no pipeline)."""
    return [c for c in grid if c["device"] != "none"]


def offload_grid(
    n_layer: int, ctx: tuple[int, ...] = CTX, flash: tuple[bool, ...] = (False,)
) -> list[dict[str, Any]]:
    """Every cell: the engine settings and the offload of each."""
    half, full = (n_layer + 1) // 2, n_layer + 1
    offloads = [
        {"n_gpu_layers": 0, "device": "none", "kv_offload": True},
        {"n_gpu_layers": 0, "device": None, "kv_offload": True},
        *(
            {"n_gpu_layers": n, "device": "Vulkan0", "kv_offload": kv}
            for n in (half, full)
            for kv in (True, False)
        ),
    ]
    return [
        {
            "n_ctx": n_ctx,
            "n_batch": 512,
            "n_ubatch": 512,
            "n_parallel": 1,
            "kv_type": "f16",
            "flash_attn": fa,
            **o,
        }
        for fa in flash
        for n_ctx in ctx
        for o in offloads
    ]


def _err(pred: int, meas: int) -> float:
    """plan_accuracy's error, 0 where nothing was measured (the `--device none` cells'
    device side)."""
    return err_pct(pred, meas) if meas else 0.0


def rows(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for e in entries:
        b, pk, c = predict(e), e["peak"], e["cell"]
        host_meas = pk["host_anon"] if c["device"] != "none" else pk["anon"]
        r = {
            **c,
            "fill": e["fill_per_slot"],
            "dev_alloc": pk["device_allocated"],
            "device_pred": b.device_bytes,
            "fit_mib": (e["log"].get("fit_projected_mib") or [None])[0],
            "resident": pk["device_resident"],
            "host": host_meas,
            "host_pred": b.engine_anon_peak_bytes,
            "file": pk["file"],
            "file_pred": b.engine_file_bytes,
            "log": e["log"],
        }
        r["device_err"] = _err(r["device_pred"], r["dev_alloc"])
        r["host_err"] = _err(r["host_pred"], r["host"])
        r["file_err"] = _err(r["file_pred"], r["file"])
        out.append(r)
    return out


def table(rs: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| n_ctx | -fa | -ngl | --device | KV on device | device alloc | pred | err | (resident) "
        "| --fit's projection | host anon | pred | err | file | pred | err |",
        "|---:|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rs:
        lines.append(
            f"| {r['n_ctx']} | {'on' if r['flash_attn'] else 'off'} | {r['n_gpu_layers']} | "
            f"{r['device'] or '(default)'} | "
            f"{'yes' if r['kv_offload'] and r['n_gpu_layers'] else 'no'} | {mib(r['dev_alloc'])} | "
            f"{mib(r['device_pred'])} | {r['device_err']:+.1f}% | {mib(r['resident'])} | "
            f"{r['fit_mib'] if r['fit_mib'] is not None else '-'} | "
            f"{mib(r['host'])} | {mib(r['host_pred'])} | {r['host_err']:+.1f}% | "
            f"{mib(r['file'])} | {mib(r['file_pred'])} | {r['file_err']:+.1f}% |"
        )
    return lines


def load(path: Path) -> list[dict[str, Any]]:
    entries: list[dict[str, Any]] = json.loads(path.read_text())
    return entries


def _worst(rs: list[dict[str, Any]], col: str) -> str:
    return f"{max(abs(r[col]) for r in rs):.1f}%"


def _reading(rs: list[dict[str, Any]], entries: list[dict[str, Any]]) -> str:
    """The first sentences of the reading: what was fitted where, the shader cache."""
    on = [r for r in rs if r["flash_attn"]]
    fitted = (
        "Read with care. The weights and the KV cache follow llama.cpp's rules exactly; the "
        "split of the compute buffers between device and host and the Vulkan runtime's heap "
        "(`plan/offload.py`) were fitted on the `-fa off` cells (one model, one driver)"
    )
    if on:
        fitted += (
            f"; the `-fa on` cells are out of sample (device within {_worst(on, 'device_err')}, "
            f"host within {_worst(on, 'host_err')})"
        )
    if all(e.get("shader_cache") == "warm" for e in entries):
        cache = (
            ". Every cell is the steady state: Mesa's shader cache was primed before the "
            "measured runs (`--shader-cache warm`, `make gpu`'s default: a private cache "
            "directory, and every cell that uses the device run once, unrecorded, before "
            "them), so no measured engine compiled its pipelines, as no start of `serve` "
            "after the first does. The table of 2026-12-02 was measured with the cache as it "
            "came: its first offloaded cell, 2048/9 layers/KV on the device, found it empty "
            "and the budget's host side was 23.6% under it: a cold start. "
        )
    else:
        cache = (
            ". Mesa's shader cache was not primed (an older run): the first cell to use the "
            "device found it empty and compiled its pipelines, a cold start. "
        )
    return (
        fitted + cache + "A cold start (the first after installing or upgrading the driver "
        "or the engine, and every start where the service cannot write its cache directory) "
        "holds more heap, which the plan budgets apart as the first-start part "
        '`gpu_shader_compile` ("cold Vulkan start: the shader cache" below pairs the cold '
        "cells with these), within MemoryMax with the steady peak; `serve` keeps the "
        "engine's cache in its state directory, so only that first start is cold. A board's "
        "Mesa driver (v3dv, PanVK) has the same cache and was not measured. "
    )


def section(rs: list[dict[str, Any]], entries: list[dict[str, Any]], cells_file: str) -> str:
    """The RESULTS.md section, with the machine's state and the method."""
    import os

    first, last = measured_span(entries)
    e0 = entries[0]
    worst = {c: max(abs(r[c]) for r in rs) for c in ("device_err", "host_err", "file_err")}
    loads = [e["load_avg_1m"] for e in entries if "load_avg_1m" in e]
    load = (
        f"1-minute load average {min(loads):g} to {max(loads):g} at the cells' ends"
        if loads
        else "load average about 10"
    )
    lines = [
        SECTION,
        "",
        f"Measured {first} to {last} on this machine ({os.cpu_count()} CPUs, shared with "
        f"other builds and tests: {load}), model "
        f"`{Path(e0['model']).name}` ({e0['threads']} "
        f"threads), llama-server `{e0['engine']}` built with `-DGGML_VULKAN=ON` "
        "(`make gpu-engine`), on Mesa 22.3.6 lavapipe (Debian 12's `mesa-vulkan-drivers`), "
        "started through `engine_argv` as `serve` starts it, with "
        "`GGML_VK_VISIBLE_DEVICES=0`. Fill: "
        f"{e0['fill_per_slot']} prompt tokens per cell. Commands: `make gpu` "
        f"(`plan_accuracy.py --offload --measure {cells_file}`), then "
        f"`--offload --report {cells_file} --write-results`.",
        "",
        "Lavapipe's device memory is the engine's own anonymous memory (a `malloc` per "
        "`vkAllocateMemory`): there is no DMA-BUF and no driver memory here. The device "
        "side is what the engine holds in Vulkan allocations at peak, logged by "
        "`benchmarks/vkmemlog.c` (preloaded), against the budget's device parts "
        "(`Budget.device_bytes`); a board's driver commits those in full when they are "
        "allocated. `(resident)` is what lavapipe touched of them (from /proc/PID/pagemap). "
        "The host side is RssAnon without those resident pages, against the budget's "
        "anonymous parts. MiB.",
        "",
        *table(rs),
        "",
        "Worst cell: device "
        + f"{worst['device_err']:.2f}%, host {worst['host_err']:.2f}%, file "
        + f"{worst['file_err']:.2f}% (goal: every cell within 5%).",
        "",
        _reading(rs, entries) + "The `--device none` cells "
        "are predicted for the Vulkan build's binary (67.5 MiB of resident code with no "
        "device, the CPU build's 16.5: the Vulkan loader and every installed driver with "
        "lavapipe's libLLVM are mapped as well), so their file column is within 1%. Their "
        "host side is the CPU budget's plus the Vulkan instance: a Vulkan build creates it "
        "when its backend registers at start (`ggml_backend_vk_reg` -> "
        "`ggml_vk_instance_init`: `vkCreateInstance` and `vkEnumeratePhysicalDevices` load "
        "every installed ICD), even with `--device none`, and holds 12.4 MiB more anonymous "
        "memory than the CPU build with the same settings after load (both contexts; the "
        "instance alone in a small C program: +12.4 MiB, 8.1 MiB of it libLLVM's relocated "
        "data), budgeted as `gpu_runtime` (12.5 MiB). Before, these cells were +6.2% / +1.5% "
        "because two errors partly cancelled: the instance was missing, and the compute "
        "buffer's touched pages were those of a full 512-token ubatch where a 16-token "
        "prompt runs a 16-token one (the CPU build itself, filled with 16 tokens, "
        "`plan_accuracy_gpu_cpu_build_cells.json`: +7 to +20% with that rule, within 2% "
        "with the ubatch's own tokens; the CPU cells of the plan accuracy table fill whole "
        "ubatches and barely move). "
        "`-ngl 0` on the default device (what a GPU build does without `--device none`) "
        "reserves a device compute buffer and a host-side one (45 MiB at 2048) that the CPU "
        "budget does not have, and loses the CPU's weight repacking: that is why the planner "
        "writes `--device none` when it offloads nothing. `--fit's projection` is what "
        "llama.cpp's own `--fit` projects for the same settings (its log at "
        "`--log-verbosity 4`): the device buffers only, without the host buffer type's "
        "compute and output buffers (12.5-36.5 MiB here) that the same driver holds, and "
        "nothing of the host side. The fill is 16 tokens per cell: lavapipe ran prompts at "
        "about 0.6 tokens/s on this shared machine (256 tokens took 453 s), so the compute "
        "buffers' touched pages are those of a short prompt (the device side is allocated in "
        "full either way).",
        "",
    ]
    return "\n".join(lines)
