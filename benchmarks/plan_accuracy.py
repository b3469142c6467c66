"""How close `slmguard plan`'s memory budget is to what the real llama-server uses.

For each cell of n_ctx x n_ubatch x slots x KV type x flash attention, a fresh
llama-server child loads the model with exactly the command line ``serve``
gives it (:func:`slmguard.serve.llamaserver.engine_argv`, see
``engine_probe.py``), then every slot runs one completion at once whose prompt
fills the slot's context (capped, see below) and generates 2 tokens. The
parent samples the child's /proc/PID/status every few milliseconds (peak
RssAnon, RssFile) and its /proc/PID/maps every 100 ms (the commit charge: the
private writable mappings, what vm.overcommit_memory=2 accounts), and parses
the engine's own buffer reports from its load log. The prediction comes from
:mod:`slmguard.plan.budget` for the same settings and the tokens actually
filled; the table compares them.

The cells (the issue's list): n_ctx 512, 2048, 8192, 32768 x n_ubatch 64, 512
(n_batch = n_ubatch, as the planner sets it) x slots 1, 4 (per-slot KV, each
slot gets n_ctx / slots) x {f16 KV with flash attention off, f16 on, q8_0 on}
(a quantized V cache needs flash attention). 48 cells.

Usage (writes nothing unless asked):
    .venv/bin/python benchmarks/plan_accuracy.py --measure benchmarks/plan_accuracy_cells.json
    .venv/bin/python benchmarks/plan_accuracy.py --report benchmarks/plan_accuracy_cells.json
    .venv/bin/python benchmarks/plan_accuracy.py --report benchmarks/plan_accuracy_cells.json \\
        --write-results

``--vision`` runs the vision cells instead (``plan_accuracy_vision.py``: a projector
loaded, images encoded; its own RESULTS.md section, "plan accuracy with images").
``--board`` runs the board cells (``plan_accuracy_board.py``: two models under one plan,
both engines at once; "plan accuracy for a board").

``--measure FILE`` appends each finished cell to FILE as it goes (a rerun
skips the cells already there, so an interrupted run resumes). ``--report``
predicts every measured cell with the current budget and prints (or writes)
the table. ``--max-fill`` caps the tokens filled per cell (all slots
together) so the large contexts stay bounded in time: the table says how many
tokens each slot filled, and the prediction uses that fill for the parts that
depend on it (the attention scores); the KV cache is allocated in full at load
either way.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from accuracy_report import MiB, commands, err_pct, measured_span, mib, print_report, shown_path
from engine_probe import probe

SECTION = "## plan accuracy"

CTX = (512, 2048, 8192, 32768)
UBATCH = (64, 512)
SLOTS = (1, 4)
ATTENTION = (("f16", False), ("f16", True), ("q8_0", True))
# Cells the budget's fitted constants were fitted on (see RESULTS.md).
IN_SAMPLE_CTX = (512, 2048)


def cell_grid(
    ctx: tuple[int, ...] = CTX,
    ubatch: tuple[int, ...] = UBATCH,
    slots: tuple[int, ...] = SLOTS,
) -> list[dict[str, Any]]:
    """The cells, small contexts first (they are the fitted ones)."""
    return [
        {
            "n_ctx": n_ctx,
            "n_batch": ub,
            "n_ubatch": ub,
            "n_parallel": np_,
            "kv_type": kv,
            "flash_attn": fa,
        }
        for n_ctx in ctx
        for np_ in slots
        for ub in ubatch
        for kv, fa in ATTENTION
    ]


def slot_cells(n_ctx: int, n_parallel: int) -> int:
    """Cells per slot as llama-server sizes them (n_ctx / slots, padded to 256)."""
    return -(-(n_ctx // n_parallel) // 256) * 256


def fill_per_slot(cell: dict[str, Any], max_fill: int) -> int:
    return min(slot_cells(cell["n_ctx"], cell["n_parallel"]) - 4, max_fill // cell["n_parallel"])


def _key(cell: dict[str, Any]) -> str:
    return json.dumps({k: cell[k] for k in sorted(cell)})


def measure(args: argparse.Namespace) -> int:
    from slmguard.serve.llamaserver import EngineConfig, engine_version, find_llama_server

    binary = find_llama_server(args.llama_server)
    version = engine_version(binary)
    out: Path = args.measure
    done: list[dict[str, Any]] = json.loads(out.read_text()) if out.exists() else []
    have = {_key(d["cell"]) for d in done}
    probe_args: dict[str, Any] = {}
    if args.offload:
        import plan_accuracy_offload as off
        from gpu_memory import build_shim

        from slmguard.plan.modelfacts import read_model_facts

        flash = tuple(dict.fromkeys(f == "on" for f in args.flash_attn))
        grid = off.offload_grid(read_model_facts(args.model).n_layer, tuple(args.ctx), flash)
        shim_dir = Path(tempfile.mkdtemp(prefix="slmguard-vkmemlog-"))
        cache_dir = out.parent / (out.stem + ".shader-cache")
        env = {**off.ENV, **off.shader_cache_env(args.shader_cache, cache_dir)}
        probe_args = {"env": env, "vulkan_shim": build_shim(shim_dir)}
        if args.shader_cache == "warm":
            cache_dir.mkdir(mode=0o700, exist_ok=True)
            todo = [c for c in off.prime_cells(grid) if _key(c) not in have]
            _prime(binary, todo, args, env)
    else:
        grid = cell_grid(tuple(args.ctx), tuple(args.ubatch), tuple(args.slots))
    started = time.monotonic()
    for cell in grid:
        if _key(cell) in have:
            continue
        cfg = EngineConfig(model_path=str(args.model), n_threads=args.threads, **cell)
        fill = fill_per_slot(cell, args.max_fill)
        t0 = time.monotonic()
        for attempt in range(3):
            try:
                result = probe(binary, cfg, fill, **probe_args)
                break
            except RuntimeError as err:  # a shared machine: a stray signal, a busy socket
                print(f"cell {cell}: attempt {attempt + 1} failed: {str(err)[:300]}", flush=True)
        else:
            raise SystemExit(f"cell {cell} failed three times")
        entry = {
            "cell": cell,
            "threads": args.threads,
            "model": str(args.model),
            "engine": version,
            "fill_per_slot": fill,
            **({"shader_cache": args.shader_cache} if args.offload else {}),
            "load_avg_1m": round(os.getloadavg()[0], 1),  # the shared machine's, at the end
            "n_cpus": len(os.sched_getaffinity(0)),
            "wall_s": round(time.monotonic() - t0, 1),
            "measured_at": datetime.datetime.now(datetime.timezone.utc).strftime(
                "%Y-%m-%d %H:%M UTC"
            ),
            **result,
        }
        done.append(entry)
        out.write_text(json.dumps(done, indent=1) + "\n")
        pk = result["peak"]
        print(
            f"{cell} fill {fill}/slot in {result['fill']['fill_s']:.1f} s: anon "
            f"{pk['anon'] / MiB:.1f} file {pk['file'] / MiB:.1f} commit "
            f"{pk['commit'] / MiB:.1f} MiB (cell {entry['wall_s']} s, run "
            f"{time.monotonic() - started:.0f} s)",
            flush=True,
        )
    return 0


def _prime(binary: Path, cells: list[dict[str, Any]], args: Any, env: dict[str, str]) -> None:
    """Run each cell once, unrecorded, so that Mesa's shader cache holds its pipelines
    before the measured run (plan_accuracy_offload.py: the steady state)."""
    from slmguard.serve.llamaserver import EngineConfig

    for cell in cells:
        t0 = time.monotonic()
        cfg = EngineConfig(model_path=str(args.model), n_threads=args.threads, **cell)
        for attempt in range(3):
            try:
                probe(binary, cfg, fill_per_slot(cell, args.max_fill), env=env)
                break
            except RuntimeError as err:  # a shared machine: as in measure()
                print(f"priming {cell}: attempt {attempt + 1} failed: {str(err)[:300]}")
        print(f"primed the shader cache with {cell} in {time.monotonic() - t0:.0f} s", flush=True)


def predict(entry: dict[str, Any]) -> Any:
    """The budget for one measured cell (same settings, the tokens it filled)."""
    from slmguard.plan.budget import compute_budget
    from slmguard.plan.modelfacts import read_model_facts
    from slmguard.plan.parts import BudgetInput
    from slmguard.plan.schema import BudgetBoard, BudgetGpu, EngineSettings

    c = entry["cell"]
    facts = read_model_facts(Path(entry["model"]))
    gpu, offload = None, {}
    if "n_gpu_layers" in c:  # an offload cell (plan_accuracy_offload.py), on lavapipe
        # every offload cell runs the Vulkan build; lavapipe's device memory is the
        # process's own, its maxStorageBufferRange 128 MiB
        gpu = BudgetGpu("vulkan", process_memory=True, max_tensor_bytes=128 << 20)
        offload = {k: c[k] for k in ("n_gpu_layers", "device", "kv_offload")}
    engine = EngineSettings(
        n_ctx=c["n_ctx"],
        n_batch=c["n_batch"],
        n_ubatch=c["n_ubatch"],
        n_threads=entry["threads"],
        n_parallel=c["n_parallel"],
        kv_type=c["kv_type"],
        flash_attn=c["flash_attn"],
        swa_full=True,
        **offload,
    )
    board = BudgetBoard(isa="x86_avx2", n_cpus=entry.get("n_cpus", 2))
    return compute_budget(
        BudgetInput(
            facts, engine, board, gpu, front_process=False, fill_tokens=entry["fill_per_slot"]
        )
    )


def report_rows(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for e in entries:
        b = predict(e)
        pk = e["peak"]
        c = e["cell"]
        rows.append(
            {
                **c,
                "in_sample": c["n_ctx"] in IN_SAMPLE_CTX,
                "fill": e["fill_per_slot"],
                "fill_s": e["fill"]["fill_s"],
                "anon": pk["anon"],
                "anon_pred": b.engine_anon_peak_bytes,
                "file": pk["file"],
                "file_pred": b.engine_file_bytes,
                "commit": pk["commit"],
                "commit_pred": b.engine_commit_bytes,
                "log": e["log"],
            }
        )
    for r in rows:
        r["anon_err"] = err_pct(r["anon_pred"], r["anon"])
        r["file_err"] = err_pct(r["file_pred"], r["file"])
        r["commit_err"] = err_pct(r["commit_pred"], r["commit"])
    return rows


def table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| n_ctx | ub | slots | kv | -fa | filled/slot | fill s | anon peak | pred | err "
        "| file peak | pred | err | commit | pred | err |",
        "|---:|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        mark = " *" if r["in_sample"] else ""
        lines.append(
            f"| {r['n_ctx']}{mark} | {r['n_ubatch']} | {r['n_parallel']} | {r['kv_type']} | "
            f"{'on' if r['flash_attn'] else 'off'} | {r['fill']} | {r['fill_s']:.0f} | "
            f"{mib(r['anon'])} | {mib(r['anon_pred'])} | {r['anon_err']:+.1f}% | "
            f"{mib(r['file'])} | {mib(r['file_pred'])} | {r['file_err']:+.1f}% | "
            f"{mib(r['commit'])} | {mib(r['commit_pred'])} | {r['commit_err']:+.1f}% |"
        )
    return lines


def worst(rows: list[dict[str, Any]], col: str, sample: bool | None = None) -> float:
    vals = [abs(r[col]) for r in rows if sample is None or r.get("in_sample") == sample]
    return max(vals) if vals else 0.0


def report_offload(args: argparse.Namespace) -> int:
    import plan_accuracy_offload as off

    rows = off.rows(off.load(args.report))
    cols = ("device_err", "host_err", "file_err")
    return print_report(
        off.table(rows), "worst: " + ", ".join(f"{c} {worst(rows, c):.2f}%" for c in cols),
        off.SECTION, lambda: off.section(rows, off.load(args.report), shown_path(args.report)),
        args.write_results,
    )  # fmt: skip


def report(args: argparse.Namespace) -> int:
    if args.offload:
        return report_offload(args)
    entries: list[dict[str, Any]] = json.loads(args.report.read_text())
    order = {_key(c): i for i, c in enumerate(cell_grid())}
    entries.sort(key=lambda e: order.get(_key(e["cell"]), len(order)))
    rows = report_rows(entries)
    cols = ("anon_err", "file_err", "commit_err")
    return print_report(
        table(rows), "worst: " + ", ".join(f"{c} {worst(rows, c):.2f}%" for c in cols),
        SECTION, lambda: section(rows, entries, args), args.write_results,
    )  # fmt: skip


def section(rows: list[dict[str, Any]], entries: list[dict[str, Any]], args: Any) -> str:
    first, last = measured_span(entries)
    total_s = sum(e["wall_s"] for e in entries)
    e0 = entries[0]
    lines = [
        SECTION,
        "",
        f"Measured {first} to {last} on this machine ({os.cpu_count()} CPUs visible, "
        f"shared with other work), model `{Path(e0['model']).name}`, llama-server "
        f"`{e0['engine']}` (x86-64, AVX2/FMA/F16C, no AMX, static), {e0['threads']} threads, "
        "started through `engine_argv` exactly as `serve` starts it, per-slot KV "
        "(`--no-kv-unified`), full-size SWA cache, `--cache-ram 0`, n_batch = n_ubatch. "
        f"{len(entries)} cells, {total_s / 60:.0f} min of wall time in the cells kept (load, "
        f"fill, stop), {_elapsed(first, last)} from the first to the last (the 4-slot cells "
        "were measured again after the fill method changed, see below; the machine's two "
        "cores were shared with other builds and tests). The binary "
        "is started through a symlink with a private name (same file), so that another "
        "session's `pkill llama-server` on this shared machine cannot end a cell.",
        commands(args.report),
        "",
        "Every slot runs one completion at once (one `/completion` request whose `prompt` "
        "is a list of one prompt per slot, so llama-server queues them together and every "
        "run batches them alike; separate concurrent requests raced, and a slot that started "
        "alone ran smaller ubatches: up to 8 MiB lower peaks) whose prompt fills its context, "
        f"capped at {args.max_fill} tokens per cell (all slots together) to bound the run "
        "time: the "
        "larger contexts are filled partly, and the prediction uses the filled tokens where "
        "they matter (the attention part of the compute buffer); the KV cache is allocated in "
        "full at load either way.",
        "",
        "Peak RssAnon / RssFile of the engine process (sampled every 4 ms from "
        "/proc/PID/status from the spawn to the end of the fill) and the peak commit charge "
        "(private writable mappings in /proc/PID/maps, every 100 ms: what "
        "`vm.overcommit_memory=2` accounts) against `slmguard.plan.budget`'s prediction "
        "(`engine_anon_peak_bytes`, `engine_file_bytes`, `engine_commit_bytes`). MiB. "
        "`*`: in-sample (the fitted constants were fitted on the n_ctx 512 and 2048 cells).",
        "",
        *table(rows),
        "",
        "Worst cell per column (all / out-of-sample only): "
        + "; ".join(
            f"{name} {worst(rows, col):.2f}% / {worst(rows, col, False):.2f}%"
            for name, col in (
                ("anon", "anon_err"),
                ("file", "file_err"),
                ("commit", "commit_err"),
            )
        )
        + " (goal: every cell within 5%).",
        "",
        "Method notes: one model (Gemma 3 270M, 262,144-token vocabulary, 15 of 18 layers "
        "sliding-window) on one ISA. Out of sample the anonymous peak is predicted slightly "
        "low, more so with longer fills (-0.4 to -2.8 %: a few MiB of the server's heap per "
        "8k prompt tokens that no rule models); the budget's planning margin is the band "
        "between the recovery line and MemoryHigh. `fill s` is wall time on a shared, loaded "
        "machine, not a speed figure. The engine's own buffer reports (KV, compute, output, "
        "repack) are checked against the budget's rules for every cell in "
        "`tests/test_plan_engine.py` (from the cell file) and, for the presets' shapes, in "
        "`tests/test_plan_budget.py` "
        "(from zero-weight GGUFs with the presets' exact tensor tables, "
        "`benchmarks/shape_model.py`).",
        "",
    ]
    return "\n".join(lines)


def _elapsed(first: str, last: str) -> str:
    fmt = "%Y-%m-%d %H:%M UTC"
    d = datetime.datetime.strptime(last, fmt) - datetime.datetime.strptime(first, fmt)
    minutes = int(d.total_seconds() // 60)
    return f"{minutes // 60} h {minutes % 60:02d} min"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--vision" in argv:  # the vision cells: plan_accuracy_vision.py, its own section
        import plan_accuracy_vision

        return plan_accuracy_vision.main([a for a in argv if a != "--vision"])
    if "--board" in argv:  # two models under one plan: plan_accuracy_board.py, its section
        import plan_accuracy_board

        return plan_accuracy_board.main([a for a in argv if a != "--board"])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--measure", type=Path, help="measure the cells, appending to FILE")
    mode.add_argument("--report", type=Path, help="predict the cells measured in FILE")
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--llama-server", default=None, help="engine binary (default: as serve)")
    ap.add_argument("--ctx", type=int, nargs="+", default=None, help="default: the mode's")
    ap.add_argument("--ubatch", type=int, nargs="+", default=list(UBATCH))
    ap.add_argument("--slots", type=int, nargs="+", default=list(SLOTS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-fill", type=int, default=8192, help="tokens filled per cell")
    ap.add_argument("--write-results", action="store_true")
    ap.add_argument(
        "--offload",
        action="store_true",
        help="the offload cells (plan_accuracy_offload.py): a Vulkan build on lavapipe",
    )
    ap.add_argument(
        "--flash-attn",
        nargs="+",
        choices=("off", "on"),
        default=["off"],
        help="--offload: the cells with flash attention off, on, or both (default: off)",
    )
    ap.add_argument(
        "--shader-cache",
        choices=("warm", "cold"),
        default="warm",
        help="--offload: Mesa's shader cache primed before the cells (warm, the steady "
        "state) or disabled (cold, every start compiles); see plan_accuracy_offload.py",
    )
    args = ap.parse_args(argv)
    if args.ctx is None:
        from plan_accuracy_offload import CTX as OFFLOAD_CTX

        args.ctx = list(OFFLOAD_CTX if args.offload else CTX)
    if args.model is None:
        from slmguard import paths
        from slmguard.default_model import ensure_default_model

        args.model = ensure_default_model(paths.model_dir())
    return measure(args) if args.measure else report(args)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
