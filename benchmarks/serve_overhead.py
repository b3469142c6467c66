"""What the server costs over bare llama-cpp-python: decode speed, first token, memory.

One invocation runs, alternating request by request, (a) bare llama-cpp-python
generation in its own process (the same ``Llama.generate`` loop the worker uses,
timed inside that process, so it pays no IPC at all) and (b) the same prompts
through ``slmguard serve`` over HTTP with SSE streaming (``/v1/completions``,
timed by the client as it receives the events). Same model, n_ctx, threads,
greedy sampling, same prompt token ids (BOS + text), same number of tokens.
The prompts rotate so neither side reuses a cached prompt prefix.

Reported:
- decode tokens/s = (tokens - 1) / (time of last token - time of first token),
  medians per side and their ratio (served / bare; goal >= 0.98);
- time to first token (bare: from the call; served: from sending the HTTP
  request to receiving the first text event), median difference (goal <= 10 ms);
- resident memory after the runs: bare engine process, worker, front
  (goal: front <= 60 MB).

Usage (prints only, unless --write-results):
    .venv/bin/python benchmarks/serve_overhead.py
    .venv/bin/python benchmarks/serve_overhead.py --rounds 4 --max-tokens 96 --write-results
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from results_md import write_section

REPO = Path(__file__).resolve().parent.parent
SECTION = "## serve overhead"
SLMGUARD = Path(sys.executable).parent / "slmguard"

PROMPTS = [
    "The history of the printing press begins",
    "A recipe for bread needs flour, water,",
    "In the middle of the ocean there is a small island where",
    "The train left the station at dawn, and the passengers",
    "Rivers carry water from the mountains to",
    "The old library had a secret room behind",
]


def status_bytes(pid: int | str) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
            out[key] = int(rest.split()[0]) * 1024
    return out


# (a) bare engine, in a child process speaking JSON lines on stdin/stdout.


def bare_child(model: str, n_ctx: int, threads: int) -> None:
    import llama_cpp

    llm = llama_cpp.Llama(
        model_path=model, n_gpu_layers=0, n_ctx=n_ctx, n_batch=512, n_ubatch=512,
        n_threads=threads, n_threads_batch=threads, verbose=False,
    )  # fmt: skip
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        if req.get("op") == "rss":
            print(json.dumps(status_bytes("self")), flush=True)
            continue
        started = time.perf_counter()
        tokens = llm.tokenize(req["prompt"].encode(), add_bos=True, special=False)
        times: list[float] = []
        out: list[int] = []
        for tok in llm.generate(tokens, temp=0.0, top_k=1, top_p=1.0, min_p=0.0,
                                repeat_penalty=1.0):  # fmt: skip
            if llm._model.token_is_eog(tok) if hasattr(llm._model, "token_is_eog") else False:
                break
            llm.detokenize([tok], prev_tokens=tokens + out)
            out.append(tok)
            times.append(time.perf_counter() - started)
            if len(out) >= req["max_tokens"]:
                break
        print(json.dumps({"times": times, "tokens": len(out), "prompt_tokens": len(tokens)}),
              flush=True)  # fmt: skip


class Bare:
    def __init__(self, model: str, n_ctx: int, threads: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--bare-child", "--model", model,
             "--n-ctx", str(n_ctx), "--threads", str(threads)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert self.proc.stdout is not None and self.proc.stdin is not None
        json.loads(self.proc.stdout.readline())

    def call(self, req: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdout is not None and self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        result: dict[str, Any] = json.loads(self.proc.stdout.readline())
        return result

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        self.proc.wait(30)


# (b) the server over HTTP.


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Served:
    def __init__(self, model: str, n_ctx: int, threads: int, state_dir: Path) -> None:
        import httpx

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = (state_dir / "serve.log").open("wb")
        self.proc = subprocess.Popen(
            [str(SLMGUARD), "serve", "--model", model, "--port", str(self.port),
             "--n-ctx", str(n_ctx), "--n-threads", str(threads), "--n-batch", "512",
             "--n-ubatch", "512", "--state-dir", str(state_dir)],
            stdout=self.log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        self.http = httpx.Client(timeout=300)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                if self.http.get(self.url + "/health").json().get("state") == "ready":
                    return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.1)
        raise SystemExit("the server did not become ready")

    def call(self, req: dict[str, Any], model_id: str) -> dict[str, Any]:
        body = {
            "model": model_id,
            "prompt": req["prompt"],
            "max_tokens": req["max_tokens"],
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        times: list[float] = []
        usage: dict[str, int] = {}
        started = time.perf_counter()
        with self.http.stream("POST", self.url + "/v1/completions", json=body) as resp:
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if event.get("usage"):
                    usage = event["usage"]
                elif event["choices"] and event["choices"][0]["text"]:
                    times.append(time.perf_counter() - started)
        return {"times": times, "tokens": usage.get("completion_tokens", len(times)),
                "prompt_tokens": usage.get("prompt_tokens")}  # fmt: skip

    def health(self) -> dict[str, Any]:
        data: dict[str, Any] = self.http.get(self.url + "/health").json()
        return data

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)
        self.log.close()


def decode_tps(result: dict[str, Any]) -> float | None:
    times, n = result["times"], result["tokens"]
    if n < 2 or len(times) < 2 or times[-1] <= times[0]:
        return None
    return float((n - 1) / (times[-1] - times[0]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="GGUF (default: the embedded model)")
    parser.add_argument("--n-ctx", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="passes over the prompts")
    parser.add_argument("--write-results", action="store_true")
    parser.add_argument("--bare-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.model is None:
        sys.path.insert(0, str(REPO / "src"))
        from slmguard import paths
        from slmguard.default_model import ensure_default_model

        args.model = str(ensure_default_model(paths.model_dir()))
    if args.bare_child:
        bare_child(args.model, args.n_ctx, args.threads)
        return 0

    model_id = Path(args.model).name.removesuffix(".gguf")
    with tempfile.TemporaryDirectory(prefix="serve-overhead-") as tmp:
        bare = Bare(args.model, args.n_ctx, args.threads)
        served = Served(args.model, args.n_ctx, args.threads, Path(tmp))
        try:
            # Warm-up: one request each, not counted.
            bare.call({"prompt": "Hello", "max_tokens": 4})
            served.call({"prompt": "Hello", "max_tokens": 4}, model_id)
            rows: list[dict[str, Any]] = []
            for rnd in range(args.rounds):
                for i, prompt in enumerate(PROMPTS):
                    req = {"prompt": prompt, "max_tokens": args.max_tokens}
                    order = ["bare", "served"] if (rnd + i) % 2 == 0 else ["served", "bare"]
                    for side in order:
                        r = bare.call(req) if side == "bare" else served.call(req, model_id)
                        rows.append({"side": side, "prompt": i, **r})
            bare_rss = bare.call({"op": "rss"})
            health = served.health()
            worker_rss = status_bytes(health["worker_pid"])
            front_rss = status_bytes(served.proc.pid)
        finally:
            served.close()
            bare.close()

    def side(name: str) -> list[dict[str, Any]]:
        return [r for r in rows if r["side"] == name]

    bare_rows, served_rows = side("bare"), side("served")
    mismatched = sum(
        1 for b, s in zip(sorted(bare_rows, key=lambda r: (r["prompt"])),
                          sorted(served_rows, key=lambda r: (r["prompt"])), strict=True)
        if b["tokens"] != s["tokens"] or b["prompt_tokens"] != s["prompt_tokens"]
    )  # fmt: skip
    tps_b_all = [t for t in map(decode_tps, bare_rows) if t]
    tps_s_all = [t for t in map(decode_tps, served_rows) if t]
    tps_b, tps_s = statistics.median(tps_b_all), statistics.median(tps_s_all)
    ttft_b_all = [r["times"][0] * 1000 for r in bare_rows]
    ttft_s_all = [r["times"][0] * 1000 for r in served_rows]
    ttft_b, ttft_s = statistics.median(ttft_b_all), statistics.median(ttft_s_all)
    mib = 1 / (1 << 20)
    result = {
        "decode_tps_bare": tps_b,
        "decode_tps_served": tps_s,
        "decode_ratio": tps_s / tps_b,
        "ttft_ms_bare": ttft_b,
        "ttft_ms_served": ttft_s,
        "ttft_diff_ms": ttft_s - ttft_b,
        # Best case per side: least disturbed by other load on a shared machine.
        "decode_tps_best_bare": max(tps_b_all),
        "decode_tps_best_served": max(tps_s_all),
        "decode_ratio_best": max(tps_s_all) / max(tps_b_all),
        "ttft_ms_best_bare": min(ttft_b_all),
        "ttft_ms_best_served": min(ttft_s_all),
        "ttft_diff_ms_best": min(ttft_s_all) - min(ttft_b_all),
        "load_avg_1m": os.getloadavg()[0],
        "rss_mib_bare": bare_rss["VmRSS"] * mib,
        "rss_anon_mib_bare": bare_rss["RssAnon"] * mib,
        "rss_mib_worker": worker_rss["VmRSS"] * mib,
        "rss_anon_mib_worker": worker_rss["RssAnon"] * mib,
        "rss_mib_front": front_rss["VmRSS"] * mib,
        "requests_per_side": len(bare_rows),
        "token_count_mismatches": mismatched,
    }
    print(json.dumps(result, indent=2))
    if args.write_results:
        write_results(result, args)
    return 0


def _goal(ok: bool) -> str:
    return "met" if ok else "**not met**"


def write_results(r: dict[str, Any], args: argparse.Namespace) -> None:
    cpu = "unknown CPU"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    import llama_cpp  # only for its version string

    cmd = "python benchmarks/serve_overhead.py " + " ".join(
        a for a in sys.argv[1:] if a != "--write-results"
    )
    section = f"""{SECTION}

`benchmarks/serve_overhead.py`, {datetime.date.today().isoformat()}, {cpu},
{len(os.sched_getaffinity(0))} CPUs in the affinity mask, {platform.platform()},
llama-cpp-python {llama_cpp.__version__}, model `{Path(args.model).name}`,
n_ctx {args.n_ctx}, {args.threads} threads, greedy, {args.max_tokens} tokens per request,
{r["requests_per_side"]} requests per side alternating (bare first and served first in turn).
Command: `{cmd.strip()} --write-results`. The machine is shared (1-minute load
average {r["load_avg_1m"]:.1f} on {os.cpu_count()} CPUs at the end of the run); compare
the two columns of one run, not runs with each other. "Best" is the fastest request
of each side, the one least disturbed by other work.

| measure | bare llama-cpp-python | slmguard serve (HTTP SSE) | result | goal |
|---|---|---|---|---|
| decode tokens/s (median) | {r["decode_tps_bare"]:.1f} | {r["decode_tps_served"]:.1f} | ratio {r["decode_ratio"]:.3f} | >= 0.98: {_goal(r["decode_ratio"] >= 0.98)} |
| decode tokens/s (best) | {r["decode_tps_best_bare"]:.1f} | {r["decode_tps_best_served"]:.1f} | ratio {r["decode_ratio_best"]:.3f} | >= 0.98: {_goal(r["decode_ratio_best"] >= 0.98)} |
| time to first token (median) | {r["ttft_ms_bare"]:.1f} ms | {r["ttft_ms_served"]:.1f} ms | {r["ttft_diff_ms"]:+.1f} ms | <= 10 ms: {_goal(r["ttft_diff_ms"] <= 10)} |
| time to first token (best) | {r["ttft_ms_best_bare"]:.1f} ms | {r["ttft_ms_best_served"]:.1f} ms | {r["ttft_diff_ms_best"]:+.1f} ms | <= 10 ms: {_goal(r["ttft_diff_ms_best"] <= 10)} |
| RSS, engine process | {r["rss_mib_bare"]:.0f} MiB (anon {r["rss_anon_mib_bare"]:.0f}) | worker {r["rss_mib_worker"]:.0f} MiB (anon {r["rss_anon_mib_worker"]:.0f}) | | |
| RSS, API front | - | {r["rss_mib_front"]:.1f} MiB | | <= 60 MB: {_goal(r["rss_mib_front"] * 1.048576 <= 60)} |

Token counts differing between the sides: {r["token_count_mismatches"]} (same prompts,
same greedy sampling: expected 0). Served time to first token is measured by the client
from sending the request, so it includes HTTP, JSON parsing, prompt rendering, the
socketpair hop both ways and SSE framing; bare time is measured inside the engine process.
"""  # noqa: E501
    write_section(SECTION, section)


if __name__ == "__main__":
    sys.exit(main())
