"""slmguard bench against bare llama-server: the same settings, the same request, in turns.

Does ``slmguard bench`` measure what the engine does? Each round runs ``slmguard bench``'s
library (the engine started by serve's supervisor, serve's command line) and then a bare
``llama-server`` started by hand from the same binary with serve's command line (a unix
socket and key of this script's; no supervisor, no ``oom_score_adj``, its output
discarded), in a session of its own as serve's engine is (with the kernel's autogroup a
session is a CPU scheduling group), and sends it the same requests with the bench's own
client and reading (:mod:`slmguard.bench.measure` over
:class:`~slmguard.serve.upstream.EngineClient`: the same prompt length, ``n_predict``,
greedy, prompt cache off, one warm-up first); both read llama.cpp's own timings. So the
two sides differ only by serve's supervisor. Rounds alternate (bench, bare; bare, bench;
...) so that a machine whose load changes affects both alike; the medians are compared,
and each round's bench / bare. The machine's load (load average, the other processes' CPU
use) is recorded beside each round.

    .venv/bin/python benchmarks/bench_vs_bare.py                 # 3 rounds, print
    .venv/bin/python benchmarks/bench_vs_bare.py --rounds 5 --write-results

``--write-results`` replaces the "## bench against bare llama-server" section of
benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from launch import stop
from results_md import write_section

from slmguard.bench import measure, record
from slmguard.bench.runner import BenchOptions, run
from slmguard.bench.target import BenchTarget, resolve_target
from slmguard.cli import main as cli_main
from slmguard.host.files import ROOT
from slmguard.host.procfs import read_loadavg
from slmguard.serve.llamaserver import engine_argv
from slmguard.serve.upstream import EngineClient

SECTION = "## bench against bare llama-server"


def bare_argv(target: BenchTarget, sock: Path, key_file: Path) -> list[str]:
    """serve's command line for this target, on a socket and key of this script's."""
    return engine_argv(target.binary, target.config, socket_path=sock, api_key_file=key_file,
                       alias="bench")  # fmt: skip


@contextlib.contextmanager
def bare_server(target: BenchTarget) -> Iterator[tuple[Path, str, int]]:
    """A bare llama-server on serve's command line: (its socket, its key, its pid)."""
    with tempfile.TemporaryDirectory(prefix="bench-bare-") as d:
        sock, key_file, key = Path(d) / "engine.sock", Path(d) / "engine.key", "bare-bench-key"
        key_file.write_text(key + "\n")
        key_file.chmod(0o600)
        proc = subprocess.Popen(
            bare_argv(target, sock, key_file),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**os.environ, **target.env},
            # its own session, as serve's supervisor starts the engine: with the kernel's
            # autogroup on, a session is a scheduling group, and the engine's share of a
            # shared CPU is its group's (in this script's session it shared this one's)
            start_new_session=True,
        )
        try:
            _wait_ready(sock, proc)
            yield sock, key, proc.pid
        finally:
            stop(proc)


def _wait_ready(sock: Path, proc: subprocess.Popen[bytes]) -> None:
    transport = httpx.HTTPTransport(uds=str(sock))
    with httpx.Client(transport=transport, base_url="http://engine", timeout=5) as client:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if client.get("/health").status_code == 200:
                    return
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {proc.returncode}")
            time.sleep(0.5)
    raise RuntimeError("llama-server did not become ready")


async def _bare_measure(
    sock: Path, key: str, prompt_n: int, decode_n: int
) -> measure.StreamFigures:
    """What the bench's run measures, with the bench's own client (serve's
    :class:`EngineClient`, over the unix socket): the same requests, the same reading."""
    t = EngineClient(sock)
    await t.reset(key)
    try:
        warm = await measure.make_prompt(t, min(8, prompt_n), "warm-up")
        await measure.one_stream(t, warm, min(2, decode_n))
        prompt = await measure.make_prompt(t, prompt_n, "stream 0")
        return await measure.one_stream(t, prompt, decode_n)
    finally:
        await t.aclose()


def bare_round(target: BenchTarget, opts: BenchOptions) -> dict[str, Any]:
    prompt_n, decode_n = opts.sized(target.config.n_ctx_slot)
    load0 = read_loadavg(ROOT)
    with bare_server(target) as (sock, key, pid):
        mark = record.cpu_mark(ROOT, pid)
        figures = asyncio.run(_bare_measure(sock, key, prompt_n, decode_n))
        window = record.load_window(mark, record.cpu_mark(ROOT, pid))
    return {
        "decode": figures.decode_tokens_per_s,
        "prefill": figures.prefill_tokens_per_s,
        "loadavg": load0[0] if load0 else None,
        "busy_cores": window.busy_cores if window else None,
        "engine_cores": window.engine_cores if window else None,
        "others_cores": window.others_cores if window else None,
    }


def bench_round(target: BenchTarget, opts: BenchOptions) -> dict[str, Any]:
    rec = run(target, opts, lambda _: None)
    load = rec["state"]["load"]
    return {
        "decode": rec["figures"]["one_stream"]["decode_tokens_per_s"],
        "prefill": rec["figures"]["one_stream"]["prefill_tokens_per_s"],
        "loadavg": (load.get("loadavg_before") or [None])[0],
        "busy_cores": load.get("busy_cores"),
        "engine_cores": load.get("engine_cores"),
        "others_cores": load.get("others_cores"),
    }


def make_plan(ctx: int, path: Path) -> Path:
    with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):
        cli_main(["plan", "--ctx", str(ctx), "--slots", "1", "--json", "--out", str(path)])
    return path


def _fmt(v: Any, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def per_core(r: dict[str, Any]) -> float | None:
    """Decode tokens per second per core the engine got: its share of a shared CPU
    taken out (the engine's CPU time covers the whole run, prefill included)."""
    cores = r.get("engine_cores")
    return r["decode"] / cores if r["decode"] and cores else None


def _median_ratio(rows: list[tuple[str, dict[str, Any]]], value: Any) -> tuple[Any, Any, Any]:
    a = [v for k, r in rows if k == "bench" and (v := value(r))]
    b = [v for k, r in rows if k == "bare" and (v := value(r))]
    ma = statistics.median(a) if a else None
    mb = statistics.median(b) if b else None
    return ma, mb, (ma / mb if ma and mb else None)


def pair_ratio(rows: list[tuple[str, dict[str, Any]]]) -> float | None:
    """The median of each round's bench / bare decode (a round: two rows in turn)."""
    pairs = [dict(rows[i : i + 2]) for i in range(0, len(rows) - 1, 2)]
    ratios = [p["bench"]["decode"] / p["bare"]["decode"] for p in pairs
              if p.get("bench", {}).get("decode") and p.get("bare", {}).get("decode")]  # fmt: skip
    return statistics.median(ratios) if ratios else None


def report(rows: list[tuple[str, dict[str, Any]]], args: argparse.Namespace, target: Any) -> str:
    bench_m, bare_m, ratio = _median_ratio(rows, lambda r: r["decode"])
    bench_c, bare_c, ratio_c = _median_ratio(rows, per_core)
    lines = [
        SECTION,
        "",
        f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} by "
        f"`benchmarks/bench_vs_bare.py --rounds {args.rounds} --ctx {args.ctx} "
        f"--prompt-tokens {args.prompt_tokens} --decode-tokens {args.decode_tokens}`: the "
        f"embedded model, one slot of {args.ctx} tokens, {target.config.n_threads} threads, "
        f"{target.version}, {os.cpu_count()} CPUs shared with other work. Rounds alternate "
        "slmguard bench (serve's supervisor and command line) and a bare llama-server "
        "(same binary and command line, its own session, started by hand); both send the same "
        "requests with the bench's client over the engine's unix socket and read llama.cpp's "
        "own timings (one stream).",
        "",
        "| round | run | decode tok/s | prefill tok/s | load average | busy cores "
        "| engine's cores | others' cores | decode tok/s per engine core |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for i, (kind, r) in enumerate(rows):
        lines.append(
            f"| {i // 2 + 1} | {kind} | {_fmt(r['decode'])} | {_fmt(r['prefill'])} | "
            f"{_fmt(r['loadavg'])} | {_fmt(r['busy_cores'])} | {_fmt(r.get('engine_cores'))} | "
            f"{_fmt(r.get('others_cores'))} | {_fmt(per_core(r))} |"
        )
    lines += [
        "",
        f"Median decode: bench {_fmt(bench_m)} tok/s, bare {_fmt(bare_m)} tok/s: bench / bare "
        f"= {_fmt(ratio, 3)} (goal: within 5 %, 0.95-1.05). Per core the engine got: bench "
        f"{_fmt(bench_c)}, bare {_fmt(bare_c)}: bench / bare = {_fmt(ratio_c, 3)}. Each "
        f"round's bench / bare (median): {_fmt(pair_ratio(rows), 3)}. On a "
        "shared machine the engine gets what the others leave it: the cores columns say how "
        "much, in each round.",
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ctx", type=int, default=512, help="tokens of the one slot")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--write-results", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        plan = make_plan(args.ctx, Path(tmp) / "plan.json")
        target = resolve_target(plan, None, Path(tmp) / "state")
        opts = BenchOptions(prompt_tokens=args.prompt_tokens, decode_tokens=args.decode_tokens)
        rows: list[tuple[str, dict[str, Any]]] = []
        runs = (("bench", bench_round), ("bare", bare_round))
        for i in range(args.rounds):
            for kind, fn in runs if i % 2 == 0 else runs[::-1]:  # ABBA: drift cancels
                print(f"round {i + 1}: {kind}", file=sys.stderr, flush=True)
                rows.append((kind, fn(target, opts)))
                print(f"  {rows[-1][1]}", file=sys.stderr, flush=True)
    text = report(rows, args, target)
    print(text)
    if args.write_results:
        write_section(SECTION, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
