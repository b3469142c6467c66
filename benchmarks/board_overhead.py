"""What routing several models costs: each model's decode through one serve vs its bare engine.

``benchmarks/serve_overhead.py --board`` (issue 39). One ``slmguard serve --plan`` of a
board this host's planner made: the embedded Gemma 3 270M pinned (``gemma``), a second
Gemma on demand with twice the context (``gemma-b``) and the tests' tiny embedder on
demand (``embed``: loaded once, idle, so three engines run). For each generative model,
a bare ``llama-server`` is started with *that model's engine's own command line*
(``/proc/PID/cmdline``, loopback TCP instead of the private socket, no API key, no slot
directory) and environment, in a session of its own as serve's engines are (with the
kernel's autogroup a session is a CPU scheduling group: see ``serve_overhead.start_bare``).
Then, per model, the same streamed ``/v1/completions`` alternate request by request
between the served model (by its name) and its bare engine: decode tokens/s = (tokens -
1) / (last - first token), medians and their ratio (goal >= 0.98 for each model), each
round's served / bare, and each engine's own decode over the same requests (llama.cpp's
``/metrics``) with the sampling parameters its slot ran (``/slots``), compared. Ratios
only: the machine is shared. Its section: ``## serve overhead of a board``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from results_md import write_section
from serve_overhead import (
    SLMGUARD,
    fairness_words,
    free_port,
    load_average,
    single_stream,
    start_bare,
    wait_http,
)
from serveprobe import EngineView, cmdline, differences, environ

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
SECTION = "## serve overhead of a board"


def board_plan(args: argparse.Namespace, tmp: Path) -> Path:
    """This host's plan for the board (see the module docstring)."""
    from rerankmodel import write_embedder

    embed = write_embedder(tmp / "embed.gguf")
    out = tmp / "board.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLMGUARD_")}
    ctx, slots = args.n_ctx, 1
    subprocess.run(
        [str(SLMGUARD), "plan", "--board", "auto", "--gpu", "none", "--json", "--out", str(out),
         "--model", f"embedded,name=gemma,ctx={ctx},slots={slots}",
         "--model", f"embedded,on-demand,name=gemma-b,ctx={2 * ctx},slots={slots},idle-unload=1h",
         "--model", f"{embed},on-demand,name=embed,idle-unload=1h"],
        check=True, capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    return out


def start_board(plan: Path, args: argparse.Namespace, tmp: Path) -> tuple[Any, str]:
    port = free_port()
    argv = [str(SLMGUARD), "serve", "--plan", str(plan), "--port", str(port),
            "--n-threads", str(args.threads), "--state-dir", str(tmp / "state"),
            "--no-governor", "--canary-interval-s", "0", "--queue-size", "16"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLMGUARD_")}
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    url = f"http://127.0.0.1:{port}"
    wait_http(url)
    return proc, url


def _engine(url: str, name: str) -> dict[str, Any]:
    models = httpx.get(url + "/health", timeout=10).json()["models"]
    found: dict[str, Any] = next(m for m in models if m["model"] == name)
    return found


def load(url: str, name: str) -> int:
    """Load ``name`` (one request): its engine's pid."""
    body: dict[str, Any] = (
        {"model": name, "input": "hello"}
        if name == "embed"
        else {"model": name, "prompt": "Hi", "max_tokens": 2}
    )
    route = "/v1/embeddings" if name == "embed" else "/v1/completions"
    resp = httpx.post(url + route, json=body, timeout=900)
    resp.raise_for_status()
    return int(_engine(url, name)["engine"]["pid"])


def run_board(args: argparse.Namespace) -> int:
    tmp = Path(tempfile.mkdtemp(prefix="slmguard-board-bench-"))
    t0, load0 = time.monotonic(), load_average()
    procs: list[Any] = []
    results: dict[str, dict[str, Any]] = {}
    unlike: list[str] = []
    try:
        served_p, served = start_board(board_plan(args, tmp), args, tmp)
        procs.append(served_p)
        pids = {name: load(served, name) for name in ("gemma", "gemma-b", "embed")}
        for name in ("gemma", "gemma-b"):
            argv = cmdline(pids[name])
            bare_p, bare = start_bare(argv, environ(pids[name]))
            procs.append(bare_p)
            unlike += [f"{name} {d}" for d in differences(bare_p.pid, pids[name])]
            views = {"bare": EngineView(url=bare), "served": EngineView(argv=argv)}
            results[name] = single_stream(bare, served, served_p.pid, args.rounds,
                                          args.max_tokens, model=name, views=views)  # fmt: skip
            results[name]["argv"] = argv
            bare_p.terminate()
            bare_p.wait(30)
            procs.remove(bare_p)
        states = {m: _engine(served, m)["state"] for m in pids}
    finally:
        for p in procs:
            p.terminate()
            p.wait(30)
        shutil.rmtree(tmp, ignore_errors=True)  # the plan, the embedder, serve's state
    elapsed = time.monotonic() - t0
    lines = [
        SECTION,
        "",
        f"`benchmarks/serve_overhead.py --board`, {datetime.date.today()}, "
        f"{platform.machine()}, {os.cpu_count()} CPUs, {args.threads} engine threads; one "
        "`serve --plan` of three models (gemma: the embedded Gemma 3 270M, pinned, n_ctx "
        f"{args.n_ctx}; gemma-b: the same file on demand, n_ctx {2 * args.n_ctx}; embed: the "
        "tests' tiny embedder on demand, loaded and idle) against a bare llama-server per "
        "model with that model's engine command line; "
        f"{args.max_tokens} tokens a request, greedy, alternating request by request; "
        f"took {elapsed:.0f} s (load average {load0} at the start, {load_average()} at the "
        "end, 1/5/15 min: "
        "the machine is shared, so only ratios within one run count). "
        f"States at the end: {', '.join(f'{k} {v}' for k, v in states.items())}.",
        "",
        "| model | bare llama-server (median tok/s) | through serve (median tok/s) | "
        "served / bare (medians) | each round's served / bare (median) | "
        "first token, served - bare (median ms) | the engines' own decode, bare / served "
        "(median tok/s, `/metrics`) | engines' own, served / bare |",
        "|---|---|---|---|---|---|---|---|",
        *(
            f"| {name} | {r['bare']['decode_tps']:.1f} | {r['served']['decode_tps']:.1f} | "
            f"{r['decode_ratio']:.3f} (goal >= 0.98) | {r['pair_ratio']:.3f} | "
            f"{r['ttft_delta_ms']:+.1f} | {r['bare']['engine_tps']:.1f} / "
            f"{r['served']['engine_tps']:.1f} | {r['engine_ratio']:.3f} |"
            for name, r in results.items()
        ),
        "",
        fairness_words(unlike, list(results.values())),
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.write_results:
        write_section(SECTION, text)
    return 0
