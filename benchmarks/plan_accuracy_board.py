"""The board cells of plan_accuracy.py: two models under one plan, both engines measured.

Each cell is a board plan made by the planner itself (:func:`slmguard.plan.boardinputs.
board_plan_for`, ``--board auto`` on this host): the embedded Gemma 3 270M for chat at a
given context and slots, beside a tiny BERT encoder written by ``tests/rerankmodel.py`` (the
reranker or the embedder: the same two-layer encoder, rank or mean pooling). Both engines
are started as ``serve`` starts them (``engine_argv`` with the plan's engine settings and
the encoder's pooling flag, ``engine_probe.start_engine``), each sampled from its spawn;
then both are filled at once, from two threads: every Gemma slot with a prompt as long as
the slot (``fill_slots``), and the encoder with one input as long as its context (a
``/rerank`` of one query and a document, or an ``/embedding``, of the encoder's whole
ubatch: what grows its output rows). A third sampler adds both processes' RssAnon and
RssFile every 4 ms: the board's measured peak. Then the encoder alone with its vocabulary
padded to 30,522 and 250,002 entries: what its heap grows by (``VOCABS``).

The prediction is the plan's own: each model's budget parts as ``plan`` writes them now
(``--report`` plans each cell again and refuses one whose engine settings moved; the
engines' parts: the front's are not running here), the primary's at full slots, the
encoder's at a full batch. Goal: the two-model total within 5 % of the measured peak.

Usage (writes nothing unless asked):
    .venv/bin/python benchmarks/plan_accuracy.py --board --measure build/board_cells.json
    .venv/bin/python benchmarks/plan_accuracy.py --board --report \\
        benchmarks/plan_accuracy_board_cells.json --write-results
(the cells measured for RESULTS.md are kept in ``plan_accuracy_board_cells.json``)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from accuracy_report import MiB, commands, err_pct, measured_span, mib, print_report

REPO = Path(__file__).resolve().parent.parent
SECTION = "## plan accuracy for a board"
#: (primary context per slot, slots, the encoder)
CELLS = (
    (2048, 1, "rerank"),
    (2048, 1, "embed"),
    (4096, 2, "rerank"),
    (8192, 1, "embed"),
)
ENGINE_ANON = (
    "weights_loaded", "weights_repacked", "kv_cache", "output_buffer", "compute_buffer",
    "ctx_checkpoints", "prompt_cache", "server_runtime", "slot_state", "gpu_runtime",
)  # fmt: skip
ENGINE_FILE = ("weights_mapped", "weights_mapped_cold", "server_binary")
#: The encoder's heap against its vocabulary: the tests' reranker (None: its own few hundred
#: entries) padded to a MiniLM's WordPiece list and to an XLM-R's (bge-reranker-v2-m3).
VOCABS = (None, 30_522, 250_002)


def _encoders(folder: Path) -> dict[str, Path]:
    sys.path.insert(0, str(REPO / "tests"))
    from rerankmodel import write_embedder, write_reranker

    return {
        "rerank": write_reranker(folder / "rerank.gguf"),
        "embed": write_embedder(folder / "embed.gguf"),
    }


def _padded_reranker(folder: Path, n_vocab: int | None) -> Path:
    """The tests' reranker, its vocabulary padded to ``n_vocab`` entries (continuation
    pieces no input here uses); the same weights otherwise."""
    import rerankmodel

    path = folder / f"rerank-{n_vocab or 'own'}.gguf"
    own = rerankmodel.vocabulary
    base = own()
    pad = [f"zz{i:06d}" for i in range(max(0, (n_vocab or 0) - len(base)))]
    rerankmodel.vocabulary = lambda: base + pad  # type: ignore[assignment]
    try:
        return rerankmodel.write_reranker(path)
    finally:
        rerankmodel.vocabulary = own  # type: ignore[assignment]


def _own_vocabulary() -> list[str]:
    import rerankmodel

    return rerankmodel.vocabulary()


def board_plan(ctx: int, slots: int, encoder: Path) -> Any:
    """The plan ``slmguard plan --model embedded,ctx=C,slots=S --model ENCODER`` makes here."""
    from slmguard.plan.boardargs import parse_model
    from slmguard.plan.boardinputs import board_plan_for

    models = [
        parse_model(f"embedded,ctx={ctx},slots={slots}", os.path.isfile),
        parse_model(f"file={encoder}", os.path.isfile),
    ]
    plan, _ = board_plan_for(Path("/"), models=models, board="auto", digest=False)
    return plan


def _sum_sampler(pids: list[int], peak: dict[str, int], stop: threading.Event) -> None:
    """The board's peak: both processes' RssAnon + RssFile, sampled together."""
    from engine_probe import status_fields

    while not stop.is_set():
        try:
            total = anon = 0
            for pid in pids:
                st = status_fields(Path(f"/proc/{pid}/status").read_text())
                anon += st.get("RssAnon", 0)
                total += st.get("RssAnon", 0) + st.get("RssFile", 0)
            peak["total"], peak["anon"] = max(peak["total"], total), max(peak["anon"], anon)
        except (OSError, ValueError):
            pass
        stop.wait(0.004)


def _encoder_input(eng: Any, n_ctx: int, rerank: bool) -> dict[str, Any]:
    """One input filling the encoder's batch: words of its vocabulary, tokens counted."""
    from rerankmodel import WORDS

    words = list(WORDS) * 4
    n = n_ctx - 8  # [CLS], [SEP]s and the query's tokens
    text = " ".join(words[:n])
    _, tok = eng.request("POST", "/tokenize", {"content": text, "add_special": False})
    text = " ".join(words[: n - max(0, len(tok["tokens"]) - n)])
    t0 = time.monotonic()
    if rerank:
        status, data = eng.request("POST", "/rerank", {"query": "city", "documents": [text]})
    else:
        status, data = eng.request("POST", "/embedding", {"content": text})
    if status != 200:
        raise RuntimeError(f"encoder: {status} {str(data)[:300]}")
    return {"fill_s": round(time.monotonic() - t0, 2), "words": len(text.split())}


def _measure_cell(binary: Path, plan: Any, encoder_kind: str) -> dict[str, Any]:
    """Both engines of the plan started, both filled at once; every peak."""
    from engine_probe import fill_slots, parse_engine_log, start_engine

    from slmguard.plan.modelfacts import read_model_facts
    from slmguard.plan.residency import planned_models
    from slmguard.serve.llamaserver import EngineConfig

    primary, encoder = planned_models(plan)
    with tempfile.TemporaryDirectory(prefix="slmguard-board-") as tmp:
        engines = []
        for i, m in enumerate((primary, encoder)):
            path = str(m.model.path)
            cfg = EngineConfig.of(
                m.engine, model_path=path, pooling_type=read_model_facts(Path(path)).pooling_type
            )
            work = Path(tmp) / str(i)
            work.mkdir()
            engines.append(start_engine(binary, cfg, work))
        gemma, enc = engines
        peak, stop = {"total": 0, "anon": 0}, threading.Event()
        joint = threading.Thread(
            target=_sum_sampler, args=([e.proc.pid for e in engines], peak, stop), daemon=True
        )
        joint.start()
        try:
            fill = primary.engine.n_ctx_slot - 4
            out: dict[str, Any] = {}
            t = threading.Thread(
                target=lambda: out.update(
                    encoder=_encoder_input(enc, encoder.engine.n_ctx, encoder_kind == "rerank")
                )
            )
            t.start()
            out["primary"] = fill_slots(gemma, primary.engine.n_parallel, fill)
            t.join()
            logs = [parse_engine_log(e.log()) for e in engines]
        finally:
            stop.set()
            joint.join()
            for e in engines:
                e.close()
    return {
        "fill_per_slot": fill,
        "fill": out,
        "peaks": [vars(e.peak) for e in engines],
        "board_peak": peak,
        "logs": logs,
    }


def _measure_vocab(binary: Path, plan: Any) -> dict[str, Any]:
    """The board's encoder alone, one full batch reranked: its peaks and its buffers."""
    from engine_probe import parse_engine_log, start_engine

    from slmguard.plan.residency import planned_models
    from slmguard.serve.llamaserver import RANK_POOLING, EngineConfig

    encoder = planned_models(plan)[1]
    cfg = EngineConfig.of(
        encoder.engine, model_path=str(encoder.model.path), pooling_type=RANK_POOLING
    )
    with tempfile.TemporaryDirectory(prefix="slmguard-vocab-") as tmp:
        eng = start_engine(binary, cfg, Path(tmp))
        try:
            fill = _encoder_input(eng, encoder.engine.n_ctx, True)
            log = parse_engine_log(eng.log())
        finally:
            eng.close()
    return {"fill": fill, "peaks": [vars(eng.peak)], "logs": [log]}


def _record(done: list[dict[str, Any]], cell: dict[str, Any], plan: Any, result: dict[str, Any],
            engine: str, t0: float) -> None:  # fmt: skip
    from slmguard.plan.planfile import dumps_plan

    done.append(
        {
            "cell": cell,
            "plan": json.loads(dumps_plan(plan)),
            "engine": engine,
            "load_avg_1m": round(os.getloadavg()[0], 1),
            "n_cpus": len(os.sched_getaffinity(0)),
            "wall_s": round(time.monotonic() - t0, 1),
            "measured_at": datetime.datetime.now(datetime.timezone.utc).strftime(
                "%Y-%m-%d %H:%M UTC"
            ),
            **result,
        }
    )


def measure(args: argparse.Namespace) -> int:
    from slmguard.serve.llamaserver import engine_version, find_llama_server

    binary = find_llama_server(args.llama_server)
    out: Path = args.measure
    done: list[dict[str, Any]] = json.loads(out.read_text()) if out.exists() else []
    have = {json.dumps(d["cell"]) for d in done}
    folder = out.parent / (out.stem + ".models")
    folder.mkdir(parents=True, exist_ok=True)
    encoders = _encoders(folder)
    engine = engine_version(binary)
    for ctx, slots, kind in CELLS:
        cell: dict[str, Any] = {"ctx": ctx, "slots": slots, "encoder": kind}
        if json.dumps(cell) in have:
            continue
        plan = board_plan(ctx, slots, encoders[kind])
        t0 = time.monotonic()
        _record(done, cell, plan, _measure_cell(binary, plan, kind), engine, t0)
        out.write_text(json.dumps(done, indent=1) + "\n")
        bp = done[-1]["board_peak"]
        print(f"{cell}: board peak {bp['total'] / MiB:.1f} MiB in {done[-1]['wall_s']} s")
    for n_vocab in VOCABS:
        cell = {"encoder_vocab": n_vocab}
        if json.dumps(cell) in have:
            continue
        plan = board_plan(2048, 1, _padded_reranker(folder, n_vocab))
        t0 = time.monotonic()
        _record(done, cell, plan, _measure_vocab(binary, plan), engine, t0)
        out.write_text(json.dumps(done, indent=1) + "\n")
        print(f"{cell}: encoder anon {done[-1]['peaks'][0]['anon'] / MiB:.1f} MiB")
    return 0


def _parts(parts: list[dict[str, Any]], names: tuple[str, ...]) -> int:
    return sum(p["bytes"] for p in parts if p["name"] in names)


def replan(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each measured cell's plan as the planner makes it now (the budget's rules may have
    moved since), refused if its engines would not start as the measured ones did."""
    with tempfile.TemporaryDirectory(prefix="slmguard-board-") as tmp:
        return _replan(entries, Path(tmp))


def _replan(entries: list[dict[str, Any]], folder: Path) -> list[dict[str, Any]]:
    from slmguard.plan.planfile import dumps_plan

    encoders = _encoders(folder)
    out = []
    for e in entries:
        c = e["cell"]
        if "encoder_vocab" in c:
            plan = board_plan(2048, 1, _padded_reranker(folder, c["encoder_vocab"]))
        else:
            plan = board_plan(c["ctx"], c["slots"], encoders[c["encoder"]])
        now = json.loads(dumps_plan(plan))
        engines = [now["engine"], now["models"][0]["engine"]]
        if engines != [e["plan"]["engine"], e["plan"]["models"][0]["engine"]]:
            raise SystemExit(f"cell {c}: the plan's engine settings changed: measure it again")
        out.append({**e, "plan": now})
    return out


def rows(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each board cell: each engine's measured and planned anon and file, and the board's."""
    out = []
    for e in entries:
        if "encoder_vocab" in e["cell"]:
            continue
        plan = e["plan"]
        budgets = [plan["budget"], plan["models"][0]["budget"]]
        row: dict[str, Any] = {**e["cell"], "fill": e["fill_per_slot"]}
        for i, (parts, pk) in enumerate(zip(budgets, e["peaks"], strict=True)):
            row[f"anon{i}"], row[f"anon{i}_pred"] = pk["anon"], _parts(parts, ENGINE_ANON)
            row[f"file{i}"], row[f"file{i}_pred"] = pk["file"], _parts(parts, ENGINE_FILE)
        row["total"] = e["board_peak"]["total"]
        row["total_pred"] = sum(row[f"{k}{i}_pred"] for k in ("anon", "file") for i in (0, 1))
        row["n_ctx"] = plan["engine"]["n_ctx"]
        row["enc_ctx"] = plan["models"][0]["engine"]["n_ctx"]
        for col in ("anon0", "file0", "anon1", "file1", "total"):
            row[f"{col}_err"] = err_pct(row[f"{col}_pred"], row[col])
        out.append(row)
    return out


def vocab_table(entries: list[dict[str, Any]]) -> list[str]:
    """The encoder alone against its vocabulary: its anon, measured and planned, and the
    heap (anon less the planned output, compute and slot parts) against the budget's."""
    lines = [
        "| encoder vocabulary | anon | plan | err | heap | server_runtime planned |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for e in entries:
        if "encoder_vocab" not in e["cell"]:
            continue
        parts = e["plan"]["models"][0]["budget"]
        anon, pred = e["peaks"][0]["anon"], _parts(parts, ENGINE_ANON)
        runtime = _parts(parts, ("server_runtime",))
        heap = anon - (pred - runtime)
        n_vocab = e["cell"]["encoder_vocab"] or f"{len(_own_vocabulary())} (its own)"
        lines.append(
            f"| {n_vocab} | {anon / MiB:.1f} | {pred / MiB:.1f} | "
            f"{err_pct(pred, anon):+.1f}% | {heap / MiB:.1f} | {runtime / MiB:.1f} |"
        )
    return lines


def table(rs: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| Gemma -c | slots | encoder (-c) | Gemma anon | pred | err | Gemma file | pred | err "
        "| encoder anon | pred | err | encoder file | pred | err | **board peak** | **plan** "
        "| **err** |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rs:
        cols = " | ".join(
            f"{mib(r[c])} | {mib(r[c + '_pred'])} | {r[c + '_err']:+.1f}%"
            for c in ("anon0", "file0", "anon1", "file1")
        )
        lines.append(
            f"| {r['n_ctx']} | {r['slots']} | {r['encoder']} ({r['enc_ctx']}) | {cols} | "
            f"**{mib(r['total'])}** | **{mib(r['total_pred'])}** | **{r['total_err']:+.1f}%** |"
        )
    return lines


def report(args: argparse.Namespace) -> int:
    entries = replan(json.loads(args.report.read_text()))
    rs = rows(entries)
    worst = max(abs(r["total_err"]) for r in rs)
    return print_report(
        [*table(rs), "", *vocab_table(entries)], f"worst board total: {worst:.2f}%", SECTION,
        lambda: section(rs, entries, args.report), args.write_results,
    )  # fmt: skip


def section(rs: list[dict[str, Any]], entries: list[dict[str, Any]], path: Path) -> str:
    first, last = measured_span(entries)
    loads = ", ".join(f"{e['load_avg_1m']:g}" for e in entries)
    worst = max(abs(r["total_err"]) for r in rs)
    return "\n".join(
        [
            SECTION,
            "",
            f"Measured {first} to {last} on this machine ({entries[0]['n_cpus']} CPUs usable, "
            f"shared; load average at the end of each cell: {loads}), llama-server "
            f"`{entries[0]['engine']}`. Each cell is the board plan `slmguard plan --model "
            "embedded,ctx=C,slots=S --model ENCODER` makes on this host (the encoder: "
            "`tests/rerankmodel.py`'s reranker or embedder, a two-layer BERT); both engines "
            "started as `serve` starts them, each sampled from its spawn, then filled at once "
            "(every Gemma slot full, the encoder with one input of its whole context). "
            "Measured: each engine's peak RssAnon / RssFile, and the board's peak (both "
            "processes' RssAnon + RssFile sampled together every 4 ms). Planned: the plan's "
            "own budget parts of each engine, planned again at report time with the engine "
            "settings measured (the front's parts are not running here). MiB.",
            commands(path, "board"),
            "",
            *table(rs),
            "",
            f"Worst board total: {worst:.2f}% (goal: within 5%). The encoder's file pages are "
            "over-planned by about 5 MiB: it touches less of llama-server's code than a "
            "decoder (no sampler, no chat templates), and `server_binary` is a decoder's.",
            "",
            "The encoder's heap against its vocabulary: the same reranker, its vocabulary "
            "padded with pieces no input uses (a MiniLM's 30,522 entries, an XLM-R's 250,002 "
            "as bge-reranker-v2-m3's), alone, one full batch of 512 tokens reranked. Heap: "
            "the measured anon less the plan's output, compute and slot parts. Fitted from "
            "these: 6.1 MiB + 139 B an entry; the planner's `server_runtime` for an encoder "
            "is 7 MiB + 150 B an entry (plan/allocation.py). The output buffer (n_vocab x "
            "512 floats: 488 MiB at 250k entries) is real resident memory of a reranker and "
            "was planned already.",
            "",
            *vocab_table(entries),
            "",
        ]
    )


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--measure", type=Path, help="measure the cells, appending to FILE")
    mode.add_argument("--report", type=Path, help="compare the cells measured in FILE")
    ap.add_argument("--llama-server", default=None, help="engine binary (default: as serve)")
    ap.add_argument("--write-results", action="store_true")
    args = ap.parse_args(argv)
    return measure(args) if args.measure else report(args)
