"""What a cold Vulkan start adds: the committed cold cells against the same cells warm.

``plan/offload.py`` ``VULKAN_SHADER_COMPILE_BYTES`` (the plan's first-start part
``gpu_shader_compile``) is fitted from this: each cell of the cold file (measured with
``MESA_SHADER_CACHE_DISABLE=true``, so the engine compiled every pipeline itself) is
paired with the cell of the same settings in the warm file (Mesa's on-disk cache held
them), and the script prints, in MiB, the host anon of both (the engine's RssAnon
without the device's resident pages, as ``plan_accuracy.py --offload --report`` reads
it), their difference, the budget's steady state for the cell
(``Budget.engine_anon_peak_bytes``, the same prediction as the report) and the cold
cell over it, then the worst of the offloaded cells and the figure the plan takes.
Nothing runs: the cells are the committed ones.

Usage::

    python benchmarks/shader_cache.py [--warm FILE] [--cold FILE] [--model GGUF]
        [--write-results]

``--model``: the GGUF the cells were measured with, when it is no longer where they
say (the budget needs its header); without it readable the prediction columns are ``-``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
MiB = 1 << 20
SECTION = "## cold Vulkan start: the shader cache (lavapipe)"
SETTINGS = ("n_ctx", "n_batch", "n_ubatch", "n_parallel", "kv_type", "flash_attn")
OFFLOAD = ("n_gpu_layers", "device", "kv_offload")


def _key(cell: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(cell.get(k) for k in (*SETTINGS, *OFFLOAD))


def host_anon(entry: dict[str, Any]) -> int:
    """The host side as the offload report reads it: RssAnon without the device's
    resident pages where a device is in use, all of RssAnon with ``--device none``."""
    peak = entry["peak"]
    return int(peak["host_anon"] if entry["cell"]["device"] != "none" else peak["anon"])


def pairs(
    warm: list[dict[str, Any]], cold: list[dict[str, Any]]
) -> list[tuple[dict[str, Any] | None, dict[str, Any]]]:
    """(warm, cold) for every cold cell, in the cold file's order; None where no warm
    cell of the same settings was measured (the cold cell is then held against the
    budget only)."""
    by_key = {_key(e["cell"]): e for e in warm}
    return [(by_key.get(_key(c["cell"])), c) for c in cold]


def steady_bytes(entry: dict[str, Any], model: Path | None) -> int | None:
    """The budget's steady-state host anon for the cell (None without the model)."""
    from plan_accuracy import predict

    path = model or Path(entry["model"])
    if not path.is_file():
        return None
    return int(predict({**entry, "model": str(path)}).engine_anon_peak_bytes)


def rows(
    warm: list[dict[str, Any]], cold: list[dict[str, Any]], model: Path | None
) -> list[dict[str, Any]]:
    out = []
    for w, c in pairs(warm, cold):
        cell = c["cell"]
        pred = steady_bytes(c, model)
        out.append(
            {
                "cell": cell,
                "offloaded": cell["device"] != "none" and cell["n_gpu_layers"] > 0,
                "warm": None if w is None else host_anon(w),
                "cold": host_anon(c),
                "diff": None if w is None else host_anon(c) - host_anon(w),
                "pred": pred,
                "over": None if pred is None else host_anon(c) - pred,
            }
        )
    return out


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / MiB:.1f}"


def table(rs: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| n_ctx | -ngl | --device | KV on device | -fa | warm host anon | cold | cold - warm "
        "| budget (steady) | cold - budget |",
        "|---:|---:|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rs:
        c = r["cell"]
        kv = "yes" if c["kv_offload"] and c["n_gpu_layers"] else "no"
        lines.append(
            f"| {c['n_ctx']} | {c['n_gpu_layers']} | {c['device'] or '(default)'} | {kv} | "
            f"{'on' if c['flash_attn'] else 'off'} | {_mib(r['warm'])} | {_mib(r['cold'])} | "
            f"{_signed(r['diff'])} | {_mib(r['pred'])} | {_signed(r['over'])} |"
        )
    return lines


def _signed(n: int | None) -> str:
    return "-" if n is None else f"{n / MiB:+.1f}"


def worst(rs: list[dict[str, Any]]) -> tuple[int | None, int | None]:
    """(the largest cold - warm, the largest cold - budget) over the offloaded cells."""
    off = [r for r in rs if r["offloaded"]]
    if not off:
        raise SystemExit("no offloaded cell in the cold file")
    overs = [r["over"] for r in off if r["over"] is not None]
    diffs = [r["diff"] for r in off if r["diff"] is not None]
    return (max(diffs) if diffs else None), (max(overs) if overs else None)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--warm", type=Path, default=HERE / "plan_accuracy_gpu_cells.json")
    ap.add_argument("--cold", type=Path, default=HERE / "plan_accuracy_gpu_cells_cold.json")
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--write-results", action="store_true", help="its RESULTS.md section")
    args = ap.parse_args(argv)
    cold = json.loads(args.cold.read_text())
    rs = rows(json.loads(args.warm.read_text()), cold, args.model)
    from slmguard.plan.offload import first_start_bytes

    summary: list[str] = []
    short = False
    for fa in (False, True):
        sub = [r for r in rs if r["cell"]["flash_attn"] == fa and r["offloaded"]]
        name = f"Flash attention {'on' if fa else 'off'}"
        if not sub:
            summary.append(f"{name}: no cold cell (not measured).")
            continue
        d, o = worst(sub)
        fitted = math.ceil(max(d or 0, o or 0) / MiB)
        budgeted = first_start_bytes("vulkan", 1, flash_attn=fa) // MiB
        short = short or budgeted < fitted
        summary.append(
            f"{name}: {len(sub)} offloaded cells, cold - warm at most "
            + ("- (no warm cell)" if d is None else f"{_signed(d)} MiB")
            + f", cold - budget at most {_signed(o)} MiB; the worst of both rounded up: "
            f"{fitted} MiB. The plan's `gpu_shader_compile` there: {budgeted} MiB "
            + ("(covers it)." if budgeted >= fitted else "(LOWER: refit it).")
        )
    for line in [*table(rs), *summary]:
        print(line)
    if args.write_results:
        from results_md import write_section

        write_section(SECTION, section(rs, cold, summary, json.loads(args.warm.read_text())))
    return 1 if short else 0


def section(
    rs: list[dict[str, Any]],
    cold: list[dict[str, Any]],
    summary: list[str],
    warm: list[dict[str, Any]],
) -> str:
    """The RESULTS.md section: what was compared, the pairs, the figure the plan takes."""
    first = min(e["measured_at"] for e in cold)
    last = max(e["measured_at"] for e in cold)
    paired = {_key(r["cell"]) for r in rs}
    primed = all(e.get("shader_cache") == "warm" for e in warm if _key(e["cell"]) in paired)
    held = (
        "(measured with Mesa's shader cache primed first, `plan_accuracy.py --offload "
        "--shader-cache warm`: no warm cell compiled its pipelines)"
        if primed
        else "(Mesa's on-disk shader cache held them, but for 2048/9 layers/KV on the device, "
        "the first cell to compile: cold too)"
    )
    fa_rows = [r for r in rs if r["cell"]["flash_attn"] and r["offloaded"]]
    fa_layers = sorted({r["cell"]["n_gpu_layers"] for r in fa_rows})
    fa_on = bool(fa_rows)
    unmeasured = (
        "a cold start with flash attention on beyond -ngl "
        + ", ".join(map(str, fa_layers))
        + " (those cells took 9-11 minutes each on this loaded machine), n_ctx 8192 cold, "
        "another model, a board's Mesa driver (v3dv, PanVK)."
        if fa_on
        else "a cold start with flash attention on (the part is the `-fa off` figure "
        "there), n_ctx 8192 cold, another model, a board's Mesa driver (v3dv, PanVK)."
    )
    fa_reading = (
        "With flash attention on the cold start is of another order on lavapipe: the "
        "engine loaded in about 4.4 minutes (LLVM compiling the flash-attention pipelines) "
        "and held 830 MiB of host anon where the steady budget says 177-194, so the plan's "
        "part follows `-fa` (`plan/offload.py` VULKAN_SHADER_COMPILE_FA_BYTES, the worst "
        "cold - budget rounded up). "
        if fa_on
        else ""
    )
    return "\n".join(
        [
            SECTION,
            "",
            "`benchmarks/shader_cache.py --write-results`: no engine runs. The cold cells "
            f"(`plan_accuracy_gpu_cells_cold.json`, measured {first} to {last} with "
            "`MESA_SHADER_CACHE_DISABLE=true`, so the engine compiled every Vulkan pipeline "
            "itself) against the cells of the same settings in `plan_accuracy_gpu_cells.json` "
            f"{held}, and against the budget's steady state "
            "for the cell (`Budget.engine_anon_peak_bytes`, as `plan_accuracy.py --offload "
            '--report` predicts it). Host anon, MiB, as in "plan accuracy with offload".',
            "",
            *table(rs),
            "",
            *summary,
            "",
            f"{fa_reading}"
            "The plan budgets this as the first-start part `gpu_shader_compile` (one "
            "figure per `-fa` for every offloaded configuration on a Vulkan device: the "
            "differences follow neither the layers nor the KV's place), apart from the "
            "steady state: "
            "held with the planned peak within MemoryMax and counted in the commit charge, "
            "not in the watermarks, since `serve` keeps the engine's shader cache in its "
            "state directory and only the first start after installing or upgrading the "
            f"engine or the driver is cold. Not measured: {unmeasured}",
            "",
        ]
    )


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    sys.exit(main())
